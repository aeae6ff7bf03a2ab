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
mod answer;
pub mod api;
pub mod chat;
pub mod config;
pub mod engine;
pub mod heat;
pub mod http;
pub mod limits;
pub mod logprobs;
pub mod metrics;
pub mod notify;
mod prompt;
pub mod text;
pub mod unit;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Context as _, Result};

use access::Access;
use api::PromptBound;
use engine::{EngineConfig, Job};
use http::{Front, HttpLimits};
use metrics::Metrics;

/// How long one loading step may take before systemd's start timeout applies again
/// (`EXTEND_TIMEOUT_USEC`).
const LOAD_STEP_ALLOWANCE: Duration = Duration::from_secs(300);
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

/// The server's life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Loading the model; generation requests get 503.
    Loading,
    /// Serving.
    Ready,
    /// Stopping: in-flight requests finish, new ones get 503.
    Draining,
    /// An RPC worker is gone: requests get 503 until it is back and the model is loaded again.
    Degraded,
}

impl State {
    /// Every state, as `/metrics` lists them.
    pub const ALL: [State; 4] = [State::Loading, State::Ready, State::Draining, State::Degraded];

    /// The name `/health` and `/metrics` report.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Loading => "loading",
            State::Ready => "ready",
            State::Draining => "draining",
            State::Degraded => "degraded",
        }
    }
}

/// `sluice serve` settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The engine's settings.
    pub engine: EngineConfig,
    /// Address to listen on.
    pub listen: SocketAddr,
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
}

/// State shared by the HTTP front, the engine and the watchdog.
pub struct Shared {
    state: AtomicU8,
    started: Instant,
    heartbeat_ms: AtomicU64,
    acceptor_ms: AtomicU64,
    prompt_bound: Mutex<PromptBound>,
    queue: Mutex<Option<SyncSender<Job>>>,
    queued: AtomicUsize,
    current: Mutex<Option<Arc<AtomicBool>>>,
    cancelling: AtomicBool,
    next_id: AtomicU64,
    /// Why the server is degraded (with [`State::Degraded`]).
    degraded: Mutex<String>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The model name.
    pub model_id: String,
    /// Unix time the server started (`created` of the model in `/v1/models`).
    pub created: u64,
    /// API key and CORS.
    pub access: Access,
}

impl Shared {
    fn new(model_id: String, access: Access, queue: SyncSender<Job>) -> Shared {
        Shared {
            state: AtomicU8::new(State::Loading as u8),
            started: Instant::now(),
            heartbeat_ms: AtomicU64::new(0),
            acceptor_ms: AtomicU64::new(0),
            prompt_bound: Mutex::new(PromptBound::default()),
            queue: Mutex::new(Some(queue)),
            queued: AtomicUsize::new(0),
            current: Mutex::new(None),
            cancelling: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            degraded: Mutex::new(String::new()),
            metrics: Metrics::default(),
            model_id,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            access,
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The HTTP acceptor is alive.
    pub fn acceptor_beat(&self) {
        self.acceptor_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    /// The bound a prompt's size must keep (set once the model is loaded).
    pub fn prompt_bound(&self) -> PromptBound {
        *self.prompt_bound.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the prompt bound of the loaded model.
    pub fn set_prompt_bound(&self, bound: PromptBound) {
        *self.prompt_bound.lock().unwrap_or_else(|e| e.into_inner()) = bound;
    }

    /// The current state.
    pub fn state(&self) -> State {
        match self.state.load(Ordering::SeqCst) {
            0 => State::Loading,
            1 => State::Ready,
            3 => State::Degraded,
            _ => State::Draining,
        }
    }

    /// Reports a loading step (log, systemd status, more start time) and beats.
    pub fn loading_step(&self, what: &str) {
        log::info!("{what}");
        notify::loading(&format!("loading: {what}"), LOAD_STEP_ALLOWANCE);
        self.beat();
    }

    /// Marks the server ready (unless it is already draining) and tells systemd.
    pub fn set_ready(&self, status: &str) {
        if self
            .state
            .compare_exchange(State::Loading as u8, State::Ready as u8, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            log::info!("{status}");
            notify::ready(status);
        }
        self.beat();
    }

    /// Marks a ready (or reloading) server degraded (a worker is gone), with the reason
    /// `/health` gives. A draining server stays draining.
    pub fn set_degraded(&self, why: &str) {
        *self.degraded.lock().unwrap_or_else(|e| e.into_inner()) = why.to_string();
        let serving = |s: u8| (s == State::Ready as u8 || s == State::Loading as u8).then_some(State::Degraded as u8);
        if self.state.fetch_update(Ordering::SeqCst, Ordering::SeqCst, serving).is_ok() {
            log::warn!("degraded: {why}");
            notify::status(&format!("degraded: {why}"));
        }
        self.beat();
    }

    /// Why the server is degraded.
    pub fn degraded_reason(&self) -> String {
        self.degraded.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A degraded server loads its model again: loading until [`Shared::set_ready`].
    pub fn set_reloading(&self, why: &str) {
        let _ = self.state.compare_exchange(
            State::Degraded as u8,
            State::Loading as u8,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        self.loading_step(why);
    }

    /// The engine is alive and making progress.
    pub fn beat(&self) {
        self.heartbeat_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    /// How long since the engine last made progress.
    pub fn engine_silent(&self) -> Duration {
        Duration::from_millis(self.now_ms().saturating_sub(self.heartbeat_ms.load(Ordering::SeqCst)))
    }

    /// Whether a generation is running.
    pub fn engine_busy(&self) -> bool {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// How long since the engine last made progress, and since the acceptor last ran: the
    /// older of the two.
    fn since_beat(&self) -> Duration {
        let oldest = self.heartbeat_ms.load(Ordering::SeqCst).min(self.acceptor_ms.load(Ordering::SeqCst));
        Duration::from_millis(self.now_ms().saturating_sub(oldest))
    }

    /// Queues `job`: `Err` with the reason when the queue is full or closed.
    fn enqueue(&self, job: Job) -> Result<(), &'static str> {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = queue.as_ref() else { return Err("the server is shutting down") };
        self.queued.fetch_add(1, Ordering::SeqCst);
        match tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => "the server is busy: the request queue is full; retry later",
                    TrySendError::Disconnected(_) => "the server is shutting down",
                })
            }
        }
    }

    /// A request left the queue for the engine.
    pub fn dequeued(&self) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// The running generation's cancel flag.
    pub fn set_current(&self, flag: Option<Arc<AtomicBool>>) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if self.cancelling.load(Ordering::SeqCst) {
            if let Some(f) = &flag {
                f.store(true, Ordering::SeqCst);
            }
        }
        *current = flag;
    }

    /// Whether the drain bound has passed: everything still queued or running is cancelled.
    pub fn cancelling(&self) -> bool {
        self.cancelling.load(Ordering::SeqCst)
    }

    fn cancel_everything(&self) {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        self.cancelling.store(true, Ordering::SeqCst);
        if let Some(f) = current.as_ref() {
            f.store(true, Ordering::SeqCst);
        }
    }

    /// A new response id.
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// Runs the server until SIGTERM or SIGINT; returns after the drain. A model that fails to
/// load is an error (systemd then restarts the service).
pub fn serve(cfg: ServeConfig) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }
    let fd_room = http::fd_room(FD_RESERVE);
    let listener = std::net::TcpListener::bind(cfg.listen).map_err(|e| {
        anyhow!("cannot listen on {}: {e} (is another server using the port? pick another with --listen)", cfg.listen)
    })?;
    listener.set_nonblocking(true)?;
    log::info!("listening on http://{}", cfg.listen);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .context("cannot start the HTTP runtime")?;
    let (tx, rx) = sync_channel::<Job>(cfg.queue);
    let shared = Arc::new(Shared::new(cfg.model_id.clone(), cfg.access.clone(), tx));
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
    let front = Arc::new(Front::new(cfg.limits.clone(), Arc::clone(&shared), fd_room));
    let outcome = runtime.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let acceptor = tokio::spawn(Arc::clone(&front).accept_loop(listener));
        let outcome = run_until_stopped(&shared, &front, &engine, &stop, cfg.drain).await;
        acceptor.abort();
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
    shared.state.store(State::Draining as u8, Ordering::SeqCst);
    notify::stopping(&format!("draining: finishing in-flight requests (at most {} s)", drain.as_secs()));
    log::info!("stopping: draining in-flight requests for at most {:.0} s", drain.as_secs_f64());
    shared.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
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
        if shared.since_beat() < interval {
            ping();
        } else if shared.state() == State::Ready {
            let engine = shared.now_ms().saturating_sub(shared.heartbeat_ms.load(Ordering::SeqCst));
            let acceptor = shared.now_ms().saturating_sub(shared.acceptor_ms.load(Ordering::SeqCst));
            log::warn!(
                "no progress for {:.1} s (engine: last beat {engine} ms ago, HTTP acceptor: {acceptor} ms ago): not pinging the watchdog",
                shared.since_beat().as_secs_f64()
            );
        }
        let until = Instant::now() + period;
        while Instant::now() < until && !done.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10).min(period));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_pinged_only_while_the_engine_and_the_acceptor_beat() {
        let (tx, _rx) = sync_channel(1);
        let shared = Arc::new(Shared::new("m".into(), Access::default(), tx));
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
        let both = || {
            shared.beat();
            shared.acceptor_beat();
        };
        let pings_while = |beat: &dyn Fn()| {
            // Beating: pings flow.
            let t0 = Instant::now();
            let before = pings.load(Ordering::SeqCst);
            while pings.load(Ordering::SeqCst) < before + 3 {
                both();
                assert!(t0.elapsed() < Duration::from_secs(60), "no pings while both beat");
                std::thread::sleep(Duration::from_millis(10));
            }
            // One side stuck: once its last beat is older than the interval, no ping is sent.
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(150) {
                beat();
                std::thread::sleep(Duration::from_millis(10));
            }
            let stalled = pings.load(Ordering::SeqCst);
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(300) {
                beat();
                std::thread::sleep(Duration::from_millis(10));
            }
            pings.load(Ordering::SeqCst) - stalled
        };
        assert_eq!(pings_while(&|| shared.acceptor_beat()), 0, "pinged while the engine made no progress");
        assert_eq!(pings_while(&|| shared.beat()), 0, "pinged while the acceptor was wedged");
        // Both again: pings resume.
        let t0 = Instant::now();
        let stalled = pings.load(Ordering::SeqCst);
        while pings.load(Ordering::SeqCst) == stalled {
            both();
            assert!(t0.elapsed() < Duration::from_secs(60), "pings did not resume");
            std::thread::sleep(Duration::from_millis(10));
        }
        done.store(true, Ordering::SeqCst);
        pinger.join().unwrap();
    }
}
