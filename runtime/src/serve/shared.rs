//! The state the HTTP front, the engine and the watchdog share: the server's life cycle, the
//! heartbeats, the queue and the requests being generated, the prompt bound and the counters.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::access::Access;
use super::error::ApiError;
use super::job::{Admission, EventSender, GenerationRequest, Job, PromptBound};
use super::messages::SlotActions;
use super::messages::TextTools;
use super::metrics::Metrics;
use super::model_card::ModelCard;
use super::state::State;
use super::stored::StoredResponses;
use crate::systemd::notify;

/// How long the engine waits for a request before it reports that it is alive.
pub(super) const IDLE_BEAT: Duration = Duration::from_millis(250);
/// How long one loading step may take before systemd's start timeout applies again
/// (`EXTEND_TIMEOUT_USEC`).
const LOAD_STEP_ALLOWANCE: Duration = Duration::from_secs(300);

/// State shared by the HTTP front, the engine and the watchdog.
pub struct Shared {
    state: AtomicU8,
    started: Instant,
    heartbeat_ms: AtomicU64,
    acceptor_ms: AtomicU64,
    prompt_bound: Mutex<PromptBound>,
    queue: Mutex<Option<SyncSender<Job>>>,
    queued: AtomicUsize,
    /// The responses kept for `previous_response_id`.
    pub responses: Mutex<StoredResponses>,
    /// Requests admitted and not finished (running or waiting), against `admit_limit`.
    admitted: Arc<AtomicUsize>,
    /// The requests that run (one per slot) and the `--queue` that may wait beside them.
    admit_limit: usize,
    /// The cancel flags of the requests being generated.
    running: Mutex<Vec<Arc<AtomicBool>>>,
    cancelling: Arc<AtomicBool>,
    next_id: AtomicU64,
    /// Why the server is degraded (with [`State::Degraded`]).
    degraded: Mutex<String>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The models: the one served and the others in the store.
    pub shelf: super::shelf::Shelf,
    /// Unix time the server started (`created` of the model in `/v1/models`).
    pub created: u64,
    /// API key and CORS.
    pub access: Access,
    /// The loaded model's description and text tools; `None` while none is loaded.
    loaded: Mutex<Option<(Arc<ModelCard>, TextTools)>>,
    /// Slot actions clients asked for, which the engine runs between its steps.
    pub slot_actions: SlotActions,
    /// The address of the listener that stands for Ollama (`--ollama-listen`), if any.
    ollama_listen: Option<SocketAddr>,
    /// Whether the model is in memory (not before it is first loaded, nor once unloaded).
    resident: AtomicBool,
    /// A client asked for the model to be unloaded once no request runs or waits.
    unload_asked: AtomicBool,
    /// A client asked for the unloaded model to be loaded again.
    load_asked: AtomicBool,
}

impl Shared {
    /// The state of a server whose engine takes jobs from `queue` and runs up to `slots` of them
    /// at once, with `waiting` requests allowed to wait while they run.
    pub(super) fn new(
        shelf: super::shelf::Shelf,
        access: Access,
        queue: SyncSender<Job>,
        slots: usize,
        waiting: usize,
        ollama_listen: Option<SocketAddr>,
    ) -> Shared {
        Shared {
            state: AtomicU8::new(State::Loading as u8),
            started: Instant::now(),
            heartbeat_ms: AtomicU64::new(0),
            acceptor_ms: AtomicU64::new(0),
            prompt_bound: Mutex::new(PromptBound::default()),
            queue: Mutex::new(Some(queue)),
            queued: AtomicUsize::new(0),
            responses: Mutex::new(StoredResponses::default()),
            admitted: Arc::new(AtomicUsize::new(0)),
            admit_limit: waiting + slots.max(1),
            running: Mutex::new(Vec::new()),
            cancelling: Arc::new(AtomicBool::new(false)),
            next_id: AtomicU64::new(0),
            degraded: Mutex::new(String::new()),
            metrics: Metrics::default(),
            shelf,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            access,
            loaded: Mutex::new(None),
            slot_actions: SlotActions::default(),
            ollama_listen,
            resident: AtomicBool::new(false),
            unload_asked: AtomicBool::new(false),
            load_asked: AtomicBool::new(false),
        }
    }

    /// The name the served model goes by.
    pub fn model_id(&self) -> String {
        self.shelf.current().id
    }

    /// Whether the model is in memory (`/api/ps` lists it).
    pub fn resident(&self) -> bool {
        self.resident.load(Ordering::SeqCst)
    }

    /// The model was loaded (true) or unloaded (false).
    pub(super) fn set_resident(&self, resident: bool) {
        self.resident.store(resident, Ordering::SeqCst);
    }

    /// Unload the model once no request runs or waits (Ollama's `keep_alive: 0`).
    pub fn ask_unload(&self) {
        self.load_asked.store(false, Ordering::SeqCst);
        self.unload_asked.store(true, Ordering::SeqCst);
    }

    /// Load the model again if it was unloaded (Ollama's request with neither messages nor
    /// prompt).
    pub fn ask_load(&self) {
        self.unload_asked.store(false, Ordering::SeqCst);
        if !self.resident() {
            self.load_asked.store(true, Ordering::SeqCst);
        }
    }

    /// Whether an unload was asked (and no longer is).
    pub(super) fn take_unload(&self) -> bool {
        self.unload_asked.swap(false, Ordering::SeqCst)
    }

    /// Whether a load was asked (and no longer is).
    pub(super) fn take_load(&self) -> bool {
        self.load_asked.swap(false, Ordering::SeqCst)
    }

    /// Whether a connection accepted at `local` (its own address) came through the listener
    /// that stands for Ollama: the same address, or the same port when it listens on all.
    pub fn on_ollama_listener(&self, local: SocketAddr) -> bool {
        self.ollama_listen
            .is_some_and(|o| o.port() == local.port() && (o.ip().is_unspecified() || o.ip() == local.ip()))
    }

    /// The loaded model's description and text tools; 503 while none is loaded.
    pub fn loaded(&self) -> Result<(Arc<ModelCard>, TextTools), ApiError> {
        let loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner()).clone();
        loaded.ok_or_else(|| ApiError::new(503, "server_error", "the model is still loading; retry shortly"))
    }

    /// Sets (or clears, while the model is loaded again) the loaded model's description and
    /// text tools.
    pub(super) fn set_loaded(&self, loaded: Option<(Arc<ModelCard>, TextTools)>) {
        *self.loaded.lock().unwrap_or_else(|e| e.into_inner()) = loaded;
    }

    pub(super) fn now_ms(&self) -> u64 {
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
        !self.running.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// How long since the engine last made progress, and since the acceptor last ran: the
    /// older of the two.
    /// How long ago the engine and the HTTP acceptor last beat, ms.
    pub(super) fn beat_ages_ms(&self) -> (u64, u64) {
        let now = self.now_ms();
        (
            now.saturating_sub(self.heartbeat_ms.load(Ordering::SeqCst)),
            now.saturating_sub(self.acceptor_ms.load(Ordering::SeqCst)),
        )
    }

    /// Starts draining: new requests get 503 and the queue takes no more jobs.
    pub(super) fn start_draining(&self) {
        self.state.store(State::Draining as u8, Ordering::SeqCst);
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    pub(super) fn since_beat(&self) -> Duration {
        let oldest = self.heartbeat_ms.load(Ordering::SeqCst).min(self.acceptor_ms.load(Ordering::SeqCst));
        Duration::from_millis(self.now_ms().saturating_sub(oldest))
    }

    /// Queues a request: `Err` with the reason when the queue is closed, or when every slot runs
    /// a request and `--queue` wait already (a burst that finds the engine idle: a slot's worth of
    /// it runs, the queue's worth waits).
    pub(super) fn enqueue(
        &self,
        request: GenerationRequest,
        events: EventSender,
        cancel: Arc<AtomicBool>,
    ) -> Result<(), &'static str> {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = queue.as_ref() else { return Err("the server is shutting down") };
        let Some(admission) = Admission::take(&self.admitted, self.admit_limit) else {
            return Err("the server is busy: the request queue is full; retry later");
        };
        let job = Job { request, events, cancel, admission };
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

    /// A generation starts: its cancel flag is set when the drain bound passes.
    pub fn add_running(&self, flag: Arc<AtomicBool>) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if self.cancelling.load(Ordering::SeqCst) {
            flag.store(true, Ordering::SeqCst);
        }
        running.push(flag);
    }

    /// A generation ended.
    pub fn remove_running(&self, flag: &Arc<AtomicBool>) {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).retain(|f| !Arc::ptr_eq(f, flag));
    }

    /// The flag set when the drain bound passes: what stops a decode that carries several
    /// requests (each request's own flag stops a decode it runs alone).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancelling)
    }

    /// Whether the drain bound has passed: everything still queued or running is cancelled.
    pub fn cancelling(&self) -> bool {
        self.cancelling.load(Ordering::SeqCst)
    }

    pub(super) fn cancel_everything(&self) {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        self.cancelling.store(true, Ordering::SeqCst);
        for f in running.iter() {
            f.store(true, Ordering::SeqCst);
        }
    }

    /// A new response id after `prefix`: 128 random bits from the OS in hex, so that no client
    /// can derive another's id from its own (a stored response is continued by its id alone).
    pub(super) fn new_id(&self, prefix: &str) -> String {
        let mut bits = [0u8; 16];
        if let Err(e) = getrandom::fill(&mut bits) {
            // The OS's generator failing is not a reason to refuse the request: a counter keeps
            // the ids unique (and says so).
            log::error!("no random bits for a response id ({e}); falling back to a counter");
            bits[..8].copy_from_slice(&self.next_id.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        }
        let hex: String = bits.iter().map(|b| format!("{b:02x}")).collect();
        format!("{prefix}{hex}")
    }
}
