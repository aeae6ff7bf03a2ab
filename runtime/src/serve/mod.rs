//! `sluice serve`: an OpenAI-compatible HTTP server over one streamed model, run as a systemd
//! `Type=notify` service.
//!
//! Threads: the accept loop (main), one short-lived thread per HTTP request (`http`), the
//! engine ([`engine`]: owns the model, runs one generation at a time from a bounded queue), and
//! a watchdog pinger that sends `WATCHDOG=1` only while the engine's heartbeat is fresh: the
//! engine beats after every decode and every idle quarter second, so a decode stuck on storage
//! stops the pings and systemd restarts the service.
//!
//! Stop (SIGTERM or SIGINT): `STOPPING=1`, new requests get 503, queued and running requests
//! finish within the drain bound, then whatever still runs is cancelled; the heat map is saved
//! and the process exits 0.

pub mod api;
pub mod engine;
pub mod heat;
mod http;
pub mod metrics;
pub mod notify;
pub mod text;
pub mod unit;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Result};

use engine::{EngineConfig, Job};
use metrics::Metrics;

/// How long one loading step may take before systemd's start timeout applies again
/// (`EXTEND_TIMEOUT_USEC`).
const LOAD_STEP_ALLOWANCE: Duration = Duration::from_secs(300);
/// How often the accept loop looks at the stop flag.
const POLL: Duration = Duration::from_millis(100);

/// The server's life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Loading the model; generation requests get 503.
    Loading,
    /// Serving.
    Ready,
    /// Stopping: in-flight requests finish, new ones get 503.
    Draining,
}

impl State {
    /// The name `/health` and `/metrics` report.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Loading => "loading",
            State::Ready => "ready",
            State::Draining => "draining",
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
    /// Largest request body accepted.
    pub max_body: usize,
}

/// State shared by the accept loop, the request threads, the engine and the watchdog.
pub struct Shared {
    state: AtomicU8,
    started: Instant,
    heartbeat_ms: AtomicU64,
    queue: Mutex<Option<SyncSender<Job>>>,
    queued: AtomicUsize,
    current: Mutex<Option<Arc<AtomicBool>>>,
    cancelling: AtomicBool,
    next_id: AtomicU64,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The model name.
    pub model_id: String,
    /// Unix time the server started (`created` in responses).
    pub created: u64,
    /// Largest request body accepted.
    pub max_body: usize,
}

impl Shared {
    fn new(model_id: String, max_body: usize, queue: SyncSender<Job>) -> Shared {
        Shared {
            state: AtomicU8::new(State::Loading as u8),
            started: Instant::now(),
            heartbeat_ms: AtomicU64::new(0),
            queue: Mutex::new(Some(queue)),
            queued: AtomicUsize::new(0),
            current: Mutex::new(None),
            cancelling: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            metrics: Metrics::default(),
            model_id,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            max_body,
        }
    }

    /// The current state.
    pub fn state(&self) -> State {
        match self.state.load(Ordering::SeqCst) {
            0 => State::Loading,
            1 => State::Ready,
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

    /// The engine is alive and making progress.
    pub fn beat(&self) {
        self.heartbeat_ms.store(self.started.elapsed().as_millis() as u64, Ordering::SeqCst);
    }

    /// How long since the engine last made progress.
    fn since_beat(&self) -> Duration {
        let now = self.started.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.heartbeat_ms.load(Ordering::SeqCst)))
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
    let server = tiny_http::Server::http(cfg.listen).map_err(|e| {
        anyhow!("cannot listen on {}: {e} (is another server using the port? pick another with --listen)", cfg.listen)
    })?;
    log::info!("listening on http://{}", cfg.listen);
    let (tx, rx) = sync_channel::<Job>(cfg.queue);
    let shared = Arc::new(Shared::new(cfg.model_id.clone(), cfg.max_body, tx));
    let engine = {
        let shared = Arc::clone(&shared);
        let engine_cfg = cfg.engine.clone();
        std::thread::Builder::new().name("sluice-engine".into()).spawn(move || engine::run(engine_cfg, &shared, rx))?
    };
    let pinger_done = Arc::new(AtomicBool::new(false));
    let pinger = notify::watchdog_interval().map(|interval| {
        let (shared, done) = (Arc::clone(&shared), Arc::clone(&pinger_done));
        std::thread::spawn(move || watchdog(&shared, &done, interval, notify::watchdog))
    });
    let handlers = Arc::new(AtomicUsize::new(0));
    let accept = |timeout: Duration| -> Result<()> {
        if let Some(request) = server.recv_timeout(timeout)? {
            let (shared, handlers) = (Arc::clone(&shared), Arc::clone(&handlers));
            handlers.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                http::handle(request, &shared);
                handlers.fetch_sub(1, Ordering::SeqCst);
            });
        }
        Ok(())
    };
    while !stop.load(Ordering::SeqCst) && !engine.is_finished() {
        accept(POLL)?;
    }
    if engine.is_finished() && !stop.load(Ordering::SeqCst) {
        pinger_done.store(true, Ordering::SeqCst);
        let result = engine.join().map_err(|_| anyhow!("the engine thread panicked"))?;
        if let Err(e) = &result {
            notify::status(&format!("failed: {e}"));
        }
        result?;
        anyhow::bail!("the engine stopped unexpectedly");
    }
    // Drain.
    shared.state.store(State::Draining as u8, Ordering::SeqCst);
    notify::stopping(&format!("draining: finishing in-flight requests (at most {} s)", cfg.drain.as_secs()));
    log::info!("stopping: draining in-flight requests for at most {:.0} s", cfg.drain.as_secs_f64());
    shared.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
    let deadline = Instant::now() + cfg.drain;
    while !engine.is_finished() {
        if Instant::now() >= deadline && !shared.cancelling() {
            log::warn!("drain bound reached: cancelling what still runs");
            notify::status("draining: cancelling in-flight requests");
            shared.cancel_everything();
        }
        accept(POLL)?;
    }
    pinger_done.store(true, Ordering::SeqCst);
    let result = engine.join().map_err(|_| anyhow!("the engine thread panicked"))?;
    // Let the request threads write their last bytes.
    let until = Instant::now() + Duration::from_secs(2);
    while handlers.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        accept(POLL)?;
    }
    if let Some(p) = pinger {
        let _ = p.join();
    }
    result?;
    log::info!("stopped");
    Ok(())
}

/// Calls `ping` (`WATCHDOG=1`) every half interval while the engine's heartbeat is younger than
/// the interval, until `done`.
fn watchdog(shared: &Shared, done: &AtomicBool, interval: Duration, ping: impl Fn()) {
    let period = interval / 2;
    while !done.load(Ordering::SeqCst) {
        if shared.since_beat() < interval {
            ping();
        } else if shared.state() == State::Ready {
            log::warn!(
                "the engine made no progress for {:.1} s: not pinging the watchdog",
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
    fn the_watchdog_is_pinged_only_while_the_engine_beats() {
        let (tx, _rx) = sync_channel(1);
        let shared = Arc::new(Shared::new("m".into(), 1, tx));
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
        // Beating: pings flow.
        let t0 = Instant::now();
        while pings.load(Ordering::SeqCst) < 3 {
            shared.beat();
            assert!(t0.elapsed() < Duration::from_secs(60), "no pings while beating");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Stuck: once the last beat is older than the interval, no ping is sent.
        std::thread::sleep(Duration::from_millis(150));
        let stalled = pings.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(pings.load(Ordering::SeqCst), stalled, "pinged while the engine made no progress");
        // Progress again: pings resume.
        let t0 = Instant::now();
        while pings.load(Ordering::SeqCst) == stalled {
            shared.beat();
            assert!(t0.elapsed() < Duration::from_secs(60), "pings did not resume");
            std::thread::sleep(Duration::from_millis(10));
        }
        done.store(true, Ordering::SeqCst);
        pinger.join().unwrap();
    }
}
