//! `sluice serve`: an OpenAI-compatible HTTP server over one streamed model, run as a systemd
//! `Type=notify` service.
//!
//! Threads: the HTTP front (the main thread: hyper on a tokio current-thread runtime, every
//! connection a task, see [`http`]), the engine ([`engine`]: owns the model, runs one
//! generation at a time from a bounded queue), and a watchdog pinger that sends `WATCHDOG=1`
//! only while both the engine's and the acceptor's heartbeats are fresh: the engine beats after
//! every decode and every idle quarter second, the acceptor every quarter second, so a decode
//! stuck on storage or a wedged front stops the pings and systemd restarts the service.
//!
//! Stop (SIGTERM or SIGINT): `STOPPING=1`, new requests get 503, queued and running requests
//! finish within the drain bound, then whatever still runs is cancelled; the heat map is saved
//! and the process exits 0.

pub mod access;
pub mod anthropic;
pub mod chat;
pub mod config;
pub mod deltas;
pub mod engine;
pub mod error;
pub mod hosts;
pub mod http;
pub mod job;
pub mod limits;
pub mod llama_server;
pub mod logprobs;
pub mod messages;
pub mod metrics;
pub mod model_card;
pub mod ollama;
pub mod openai;
pub mod routes;
pub mod shared;
pub mod shelf;
pub mod state;
pub mod status;
pub mod stored;
pub mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};

use crate::systemd::notify;
use access::Access;
use engine::EngineConfig;
use http::{Front, HttpLimits};
use job::Job;
use shared::Shared;
use state::State;

/// How often the server looks at the stop flag and the engine.
const POLL: Duration = Duration::from_millis(100);
/// How long responses may take to be written after the engine stopped, and how long past the
/// drain bound a busy engine is waited for.
const LAST_WRITES: Duration = Duration::from_secs(2);
/// The engine thread's stack: llama.cpp's grammar parser recurses as deep as a grammar's
/// nesting (bounded by [`limits`]). Only the pages touched are committed.
const ENGINE_STACK: usize = 16 << 20;
/// File descriptors kept for everything but connections (model files, reader lanes, logs).
const FD_RESERVE: usize = 64;

/// `sluice serve` settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The engine's settings.
    pub engine: EngineConfig,
    /// Address to listen on.
    pub listen: SocketAddr,
    /// A second address for clients that assume Ollama's port, if asked for.
    pub ollama_listen: Option<SocketAddr>,
    /// Generation requests that may wait while one runs; more get 503.
    pub queue: usize,
    /// How long in-flight requests may take to finish after SIGTERM before they are cancelled.
    pub drain: Duration,
    /// The model name clients use (`/v1/models`).
    pub model_id: String,
    /// The HTTP front's limits.
    pub limits: HttpLimits,
    /// API key and CORS.
    pub access: Access,
    /// The store the server finds, pulls and switches models in.
    pub shelf: shelf::ShelfConfig,
}

/// The server's models: the one it starts with, and the store.
fn shelf_of(cfg: &ServeConfig) -> shelf::Shelf {
    let current = shelf::ModelChoice { id: cfg.model_id.clone(), path: cfg.engine.launch.model.clone() };
    shelf::Shelf::new(cfg.shelf.clone(), current, shelf::planned_refusal(cfg.engine.launch.clone()))
}

/// Runs the server until SIGTERM or SIGINT; returns after the drain. A model that fails to
/// load is an error (systemd then restarts the service).
pub fn serve(cfg: ServeConfig) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    let fd_room = http::fd_room(FD_RESERVE);
    let bind = |addr: SocketAddr, flag: &str| {
        let listener = std::net::TcpListener::bind(addr).map_err(|e| {
            anyhow!("cannot listen on {addr}: {e} (is another server using the port? pick another with {flag})")
        })?;
        listener.set_nonblocking(true)?;
        log::info!("listening on http://{addr}");
        Ok::<_, anyhow::Error>(listener)
    };
    let listener = bind(cfg.listen, "--listen")?;
    let second = cfg.ollama_listen.map(|a| bind(a, "--ollama-listen")).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .context("cannot start the HTTP runtime")?;
    // Room for a burst that finds the engine idle: a request per slot runs, `queue` wait.
    let slots = cfg.engine.launch.slots as usize;
    let (tx, rx) = sync_channel::<Job>(cfg.queue + slots);
    let shared = Arc::new(Shared::new(shelf_of(&cfg), cfg.access.clone(), tx, slots, cfg.queue, cfg.ollama_listen));
    shared.acceptor_beat();
    let engine = {
        let shared = Arc::clone(&shared);
        let engine_cfg = cfg.engine.clone();
        std::thread::Builder::new()
            .name("sluice-engine".into())
            .stack_size(ENGINE_STACK)
            .spawn(move || engine::run(engine_cfg, &shared, rx))?
    };
    let pinger_done = Arc::new(AtomicBool::new(false));
    let pinger = notify::watchdog_interval().map(|interval| {
        let (shared, done) = (Arc::clone(&shared), Arc::clone(&pinger_done));
        std::thread::Builder::new()
            .name("sluice-watchdog".into())
            .spawn(move || watchdog(&shared, &done, interval, notify::watchdog))
    });
    let pinger = pinger.transpose()?;
    let front = Front::new(routes::handle, cfg.limits.clone(), Arc::clone(&shared), fd_room);
    let front = Arc::new(front.context("cannot start the request parser thread")?);
    let outcome = runtime.block_on(async {
        let mut acceptors = Vec::new();
        for l in std::iter::once(listener).chain(second) {
            let l = tokio::net::TcpListener::from_std(l)?;
            acceptors.push(tokio::spawn(Arc::clone(&front).accept_loop(l)));
        }
        let outcome = run_until_stopped(&shared, &front, &engine, &stop, cfg.drain).await;
        for a in acceptors {
            a.abort();
        }
        Ok::<_, anyhow::Error>(outcome)
    })?;
    pinger_done.store(true, Ordering::SeqCst);
    if let Some(p) = pinger {
        let _ = p.join();
    }
    if outcome == Outcome::EngineBusy {
        // SIGTERM came while the engine was in a step it cannot leave (loading the model from
        // slow storage, say): honour it within the bound rather than waiting for the step.
        log::warn!("the engine did not stop within the drain bound; exiting without it (the heat map is not saved)");
        notify::status("stopped: the engine was busy loading");
        ggml_sys::exit_now(0);
    }
    let engine_result = engine.join().map_err(|_| anyhow!("the engine thread panicked"))?;
    if let Err(e) = &engine_result {
        notify::status(&format!("failed: {e}"));
    }
    engine_result?;
    if outcome == Outcome::EngineEnded {
        anyhow::bail!("the engine stopped unexpectedly");
    }
    log::info!("stopped");
    Ok(())
}

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// A stop signal, and the engine finished within the drain bound.
    Stopped,
    /// A stop signal, and the engine was still busy well after the drain bound.
    EngineBusy,
    /// The engine ended by itself (it failed to load).
    EngineEnded,
}

/// Serves until a stop signal (then drains: in-flight requests get `drain` to finish, then are
/// cancelled) or until the engine ends by itself.
async fn run_until_stopped(
    shared: &Shared,
    front: &Front,
    engine: &std::thread::JoinHandle<Result<()>>,
    stop: &AtomicBool,
    drain: Duration,
) -> Outcome {
    let mut tick = tokio::time::interval(POLL);
    while !stop.load(Ordering::SeqCst) && !engine.is_finished() {
        tick.tick().await;
    }
    if !stop.load(Ordering::SeqCst) {
        return Outcome::EngineEnded;
    }
    shared.start_draining();
    // A template render (a hostile one at start, say) ends at its next step.
    ggml_sys::stop_template_work();
    notify::stopping(&format!("draining: finishing in-flight requests (at most {} s)", drain.as_secs()));
    log::info!("stopping: draining in-flight requests for at most {:.0} s", drain.as_secs_f64());
    let deadline = Instant::now() + drain;
    while !engine.is_finished() {
        if Instant::now() >= deadline && !shared.cancelling() {
            log::warn!("drain bound reached: cancelling what still runs");
            notify::status("draining: cancelling in-flight requests");
            shared.cancel_everything();
        }
        if Instant::now() >= deadline + LAST_WRITES {
            return Outcome::EngineBusy;
        }
        tick.tick().await;
    }
    // Let the connections write their last bytes.
    let until = Instant::now() + LAST_WRITES;
    while front.registry().busy() > 0 && Instant::now() < until {
        tick.tick().await;
    }
    Outcome::Stopped
}

/// Calls `ping` (`WATCHDOG=1`) every half interval while the engine's heartbeat is younger than
/// the interval, until `done`.
fn watchdog(shared: &Shared, done: &AtomicBool, interval: Duration, ping: impl Fn()) {
    let period = interval / 2;
    while !done.load(Ordering::SeqCst) {
        if beating(shared, interval) {
            ping();
        }
        let until = Instant::now() + period;
        while Instant::now() < until && !done.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10).min(period));
        }
    }
}

/// Whether the engine and the HTTP acceptor both beat within `interval` (the watchdog pings);
/// when not, and the server is ready, says which has been silent how long.
fn beating(shared: &Shared, interval: Duration) -> bool {
    if shared.since_beat() < interval {
        return true;
    }
    if shared.state() == State::Ready {
        let (engine, acceptor) = shared.beat_ages_ms();
        log::warn!(
            "no progress for {:.1} s (engine: last beat {engine} ms ago, HTTP acceptor: {acceptor} ms ago): not pinging the watchdog",
            shared.since_beat().as_secs_f64()
        );
    }
    false
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    const PATIENCE: Duration = Duration::from_secs(60);

    fn shared() -> Arc<Shared> {
        let (tx, _rx) = sync_channel(1);
        let store = crate::store::Store::new(Some("/nonexistent/hub".into()), Some("/nonexistent/ollama".into()));
        let cfg = shelf::ShelfConfig { store, pull: None, switch: false };
        let current = shelf::ModelChoice { id: "m".into(), path: "/nonexistent/m.gguf".into() };
        let shelf = shelf::Shelf::new(cfg, current, Box::new(|_| None));
        Arc::new(Shared::new(shelf, Access::default(), tx, 1, 1, None))
    }

    /// The decision, independent of how fast the machine runs the test: a side counts as stuck
    /// once its last beat is older than the interval, which the test waits for on the shared
    /// clock itself.
    #[test]
    fn the_watchdog_is_pinged_only_while_the_engine_and_the_acceptor_beat() {
        let shared = shared();
        let interval = Duration::from_millis(50);
        let hour = Duration::from_secs(3600);
        let both = || {
            shared.beat();
            shared.acceptor_beat();
        };
        let stuck_while = |beat: &dyn Fn()| {
            let t0 = Instant::now();
            while shared.since_beat() < interval {
                beat();
                assert!(t0.elapsed() < PATIENCE, "the silent side never aged");
                std::thread::sleep(Duration::from_millis(5));
            }
            beat();
            beating(&shared, interval)
        };
        both();
        assert!(beating(&shared, hour), "both beat");
        assert!(!stuck_while(&|| shared.acceptor_beat()), "pinged while the engine made no progress");
        both();
        assert!(beating(&shared, hour), "both beat again");
        assert!(!stuck_while(&|| shared.beat()), "pinged while the acceptor was wedged");
        both();
        assert!(beating(&shared, hour), "pings resume");
    }

    #[test]
    fn the_watchdog_pings_while_both_beat_and_stops_when_done() {
        let shared = shared();
        let done = Arc::new(AtomicBool::new(false));
        let pings = Arc::new(AtomicUsize::new(0));
        let pinger = {
            let (shared, done, pings) = (Arc::clone(&shared), Arc::clone(&done), Arc::clone(&pings));
            std::thread::spawn(move || {
                watchdog(&shared, &done, Duration::from_millis(100), || {
                    pings.fetch_add(1, Ordering::SeqCst);
                })
            })
        };
        let t0 = Instant::now();
        while pings.load(Ordering::SeqCst) < 3 {
            shared.beat();
            shared.acceptor_beat();
            assert!(t0.elapsed() < PATIENCE, "no pings while both beat");
            std::thread::sleep(Duration::from_millis(10));
        }
        done.store(true, Ordering::SeqCst);
        pinger.join().unwrap();
    }
}
