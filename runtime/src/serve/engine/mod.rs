//! The engine thread: loads the model once, then runs queued generation requests, up to one per
//! slot at once, each decode carrying a token of every running request.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

mod answer;
mod degraded;
mod fit;
pub mod heat;
mod message_text;
mod prompt;
mod questions;
mod running;
pub mod saved_slots;
mod slot_actions;
pub mod slots;
mod switching;
mod unloaded;

use self::answer::Answer;
use self::degraded::wait_for_worker;
use self::heat::ModelIdentity;
pub use self::prompt::describe;
use self::prompt::Tokenizer;
use self::running::Running;
use self::saved_slots::SlotStore;
use self::slots::{open_store, Slots};
use self::switching::{needs_switch, refuse_switch, state_dir_of, switch};
use self::unloaded::Wake;
use super::error::ApiError;
use super::job::{Event, EventSender, Finish, Job};
use super::job::{PromptBound, TokenUsage};
use super::metrics::GenerationCounts;
use super::model_card::ModelCard;
use super::shared::{Shared, IDLE_BEAT};
use super::shelf::ModelChoice;
use super::state::State;
use crate::generate::{GenerateError, Generation};
use crate::launch::{Launch, LaunchError};
use crate::stream::{StreamError, StreamedSession};

/// The longest one token's grammar checks may take: well inside the watchdog's interval, so a
/// costly grammar fails its request instead of stalling the service (cancel and SIGTERM stop it
/// at once through the request's cancel flag).
pub const GRAMMAR_TOKEN_BOUND: Duration = Duration::from_secs(5);

/// What the engine serves, and how.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The streamed run: model, board, context positions (`--ctx`, else what the board's plan
    /// affords: [`crate::launch::Positions::Planned`]), cache, dense policy, lossy modes, RPC
    /// workers.
    pub launch: Launch,
    /// Where the heat map is kept; `None`: no warm restarts.
    pub state_dir: Option<PathBuf>,
    /// How often the heat map (and the slots that changed) are saved while serving.
    pub save_every: Duration,
    /// What a slot keeps of a later prompt.
    pub reuse: crate::generate::Reuse,
    /// The most bytes the saved slots take in the state directory; 0 saves none.
    pub slot_save_bytes: u64,
}

/// How long the engine waits idle before it saves the slots that changed.
const IDLE_BEFORE_SAVE: Duration = Duration::from_secs(5);

/// Why the engine could not serve the model.
#[derive(Debug, thiserror::Error)]
enum LoadFailure {
    /// The streamed run could not start.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The model's chat templates could not be parsed.
    #[error(transparent)]
    Templates(anyhow::Error),
}

/// How serving the loaded model ended.
enum Served {
    /// Every sender is gone.
    Done,
    /// An RPC worker was lost mid-generation: the model must be loaded again once it is back.
    WorkerLost(String),
    /// A client asked for the model to be unloaded: it is loaded again when asked for. Holds
    /// the model's description, which the front keeps showing meanwhile.
    Unloaded(Option<Arc<ModelCard>>),
    /// A request names another stored model: every request of this one has ended; the other is
    /// loaded and the request runs first.
    Switch(Box<Job>),
}

/// Loads the model, reports ready, and serves `jobs` until every sender is gone; saves the heat
/// map at the end. Errors are load failures. When an RPC worker is lost, the server reports
/// itself degraded, fails requests with 503 until the worker answers again, then loads the
/// model again (a worker lost again during that load is waited for the same way).
pub fn run(mut cfg: EngineConfig, shared: &Shared, jobs: Receiver<Job>) -> Result<()> {
    let mut served_once = false;
    let mut first: Option<Job> = None;
    let (first_model, base_state) = (cfg.launch.model.clone(), cfg.state_dir.clone());
    let mut before_switch: Option<ModelChoice> = None;
    loop {
        if let Some(choice) =
            first.as_ref().filter(|j| needs_switch(j, &cfg.launch.model)).and_then(|j| j.request.model.clone())
        {
            before_switch = Some(shared.shelf.current());
            switch(&mut cfg, shared, &choice, state_dir_of(base_state.as_deref(), &first_model, &choice));
        }
        let served = match serve_loaded(&cfg, shared, &jobs, &mut first) {
            Ok(s) => s,
            Err(e) if before_switch.is_some() && first.is_some() => {
                let back = before_switch.take().unwrap_or_else(|| shared.shelf.current());
                refuse_switch(first.take(), &e, &back);
                switch(&mut cfg, shared, &back, state_dir_of(base_state.as_deref(), &first_model, &back));
                continue;
            }
            Err(LoadFailure::Launch(e)) => match e.lost_worker() {
                Some(endpoint) if served_once => Served::WorkerLost(endpoint.to_string()),
                _ => return Err(e.into()),
            },
            // A stop during the load ends it (its template work, for one, stops at once).
            Err(LoadFailure::Templates(_)) if shared.state() == State::Draining => {
                log::info!("stopped while loading the chat templates");
                return Ok(());
            }
            Err(LoadFailure::Templates(e)) => return Err(e),
        };
        served_once = true;
        before_switch = None;
        match served {
            Served::Done => return Ok(()),
            Served::WorkerLost(endpoint) => {
                shared.set_degraded(&format!(
                    "the RPC worker at {endpoint} is gone: waiting for it to answer, then loading the model again"
                ));
                if !wait_for_worker(&endpoint, shared, &jobs) {
                    return Ok(());
                }
                shared.set_reloading(&format!("the RPC worker at {endpoint} answers again: loading the model"));
            }
            Served::Unloaded(card) => match unloaded::wait(&cfg, shared, &jobs, card)? {
                Wake::Done => return Ok(()),
                Wake::Job(job) => {
                    first = Some(*job);
                    shared.loading_step("a request came: loading the model again");
                }
                Wake::Asked => shared.loading_step("asked for: loading the model again"),
            },
            Served::Switch(job) => {
                first = Some(*job);
                shared.loading_step("a request names another model: loading it");
            }
        }
    }
}

/// Loads the model and serves `jobs` with it (`first` first) until every sender is gone, a
/// worker is lost or an unload is asked.
fn serve_loaded(
    cfg: &EngineConfig,
    shared: &Shared,
    jobs: &Receiver<Job>,
    first: &mut Option<Job>,
) -> Result<Served, LoadFailure> {
    let loaded = cfg.launch.load(&mut |step| shared.loading_step(step))?;
    let (model, index, n_ctx) = (&loaded.model, &loaded.index, loaded.shape.positions);
    shared.set_prompt_bound(PromptBound { n_ctx, max_token_bytes: model.max_token_bytes() });
    shared.metrics.set_ledger(&loaded.ledger);
    shared.metrics.set_lossy(&loaded.config.lossy);
    shared.loading_step("reading dense weights and warming up");
    let (mut session, _) = loaded.open()?;
    session.set_reuse(cfg.reuse);
    let identity = ModelIdentity::of(index);
    let heat_path = cfg.state_dir.as_deref().map(heat::path_in);
    let tokenizer = Tokenizer::start(Arc::clone(model)).map_err(LoadFailure::Templates)?;
    let store = open_store(cfg.state_dir.as_deref(), cfg.slot_save_bytes, &identity, index, loaded.shape, cfg.reuse);
    let slots = Slots::new(loaded.shape.slots);
    let mut engine = Engine {
        tokenizer,
        session,
        shared,
        n_ctx,
        identity,
        heat_path,
        heat_dirty: false,
        lost: None,
        slots,
        store,
        running: Vec::new(),
    };
    engine.publish_model(model);
    engine.warm_start(index);
    engine.restore_slots();
    engine.publish_heat();
    shared.set_ready(&format!(
        "ready: {} ({} positions, expert cache {} MiB of {} MiB)",
        cfg.launch.model.display(),
        n_ctx,
        loaded.cache_bytes() >> 20,
        index.all_expert_window_bytes() >> 20
    ));
    shared.set_resident(true);
    log::info!("the model is in memory");
    let served = engine.serve(cfg, jobs, first.take());
    engine.close();
    Ok(served)
}

/// The loaded model and its session.
struct Engine<'m, 's> {
    tokenizer: Tokenizer,
    session: StreamedSession<'m>,
    shared: &'s Shared,
    n_ctx: u32,
    identity: ModelIdentity,
    heat_path: Option<PathBuf>,
    heat_dirty: bool,
    /// The RPC worker a generation lost: the model is unusable until it is loaded again.
    lost: Option<String>,
    /// The slots' bookkeeping.
    slots: Slots,
    /// The saved slots, when there is a state directory and room for them.
    store: Option<SlotStore>,
    /// The requests being generated, at most one per slot.
    running: Vec<Running<'m>>,
}

impl<'m> Engine<'m, '_> {
    /// Serves `jobs` (`first` first) until every sender is gone, a worker is lost or an
    /// unload is asked.
    fn serve(&mut self, cfg: &EngineConfig, jobs: &Receiver<Job>, first: Option<Job>) -> Served {
        let loaded = cfg.launch.model.as_path();
        // A request for another model: no request starts after it; it is served once every
        // request of this model has ended.
        let mut held: Option<Job> = None;
        let admit = |engine: &mut Self, job: Job, held: &mut Option<Job>| {
            if needs_switch(&job, loaded) {
                *held = Some(job);
            } else {
                engine.start(job);
            }
        };
        if let Some(job) = first {
            admit(self, job, &mut held);
        }
        let mut last_save = Instant::now();
        let mut last_job = Instant::now();
        loop {
            self.shared.beat();
            self.run_slot_actions();
            if self.running.is_empty() {
                if let Some(job) = held.take() {
                    break Served::Switch(Box::new(job));
                }
            }
            if self.running.is_empty() && self.shared.queued() == 0 && self.shared.take_unload() {
                break Served::Unloaded(self.shared.loaded().ok().map(|(card, _)| card));
            }
            if self.running.is_empty() {
                match jobs.recv_timeout(IDLE_BEAT) {
                    Ok(job) => {
                        admit(self, job, &mut held);
                        last_job = Instant::now();
                    }
                    // Idle: reads a cancelled or timed-out request left behind may have landed since.
                    Err(RecvTimeoutError::Timeout) => {
                        self.session.streamer().release_stale();
                        if last_job.elapsed() >= IDLE_BEFORE_SAVE {
                            self.save_slots();
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => break Served::Done,
                }
            } else {
                // Requests that arrived while others run join them in a free slot.
                while self.running.len() < self.slots.count() && held.is_none() {
                    let Ok(job) = jobs.try_recv() else { break };
                    admit(self, job, &mut held);
                }
                self.step();
                last_job = Instant::now();
            }
            if let Some(endpoint) = self.lost.take() {
                self.abandon_all();
                break Served::WorkerLost(endpoint);
            }
            if last_save.elapsed() >= cfg.save_every {
                self.save_heat();
                self.save_slots();
                last_save = Instant::now();
            }
        }
    }

    /// Hands the HTTP front the model's description and text tools.
    fn publish_model(&self, model: &ggml_sys::Model) {
        let card = ModelCard::of(model, self.n_ctx, self.tokenizer.thinks());
        self.shared.set_loaded(Some((Arc::new(card), self.tokenizer.tools())));
    }

    /// Ends serving the loaded model: the front's text tools go, the heat map and slots are
    /// saved.
    fn close(&mut self) {
        self.shared.set_loaded(None);
        self.shared.set_resident(false);
        self.save_heat();
        self.save_slots();
    }

    /// Reads the newest saved slots back into the slots, newest into slot 0.
    fn restore_slots(&mut self) {
        if let Some(store) = &mut self.store {
            self.shared.loading_step("reading the saved slots");
            self.slots.restore(&mut self.session, store);
        }
        self.publish_slots();
    }

    /// Saves the slots that changed since they were saved.
    fn save_slots(&mut self) {
        if let Some(store) = &mut self.store {
            if self.slots.any_unsaved() {
                self.slots.save_all(&self.session, store);
            }
        }
    }

    /// Hands the slots to the status page and `/metrics`.
    fn publish_slots(&self) {
        self.shared.metrics.set_slots(&self.slots.views(&self.session));
    }

    /// Hands the heat map to the status page.
    fn publish_heat(&self) {
        let heat = self.session.streamer().heat().to_vec();
        self.shared.metrics.set_heat(self.identity.n_layer, self.identity.n_expert, &heat);
    }

    /// Saves the heat map if it changed.
    fn save_heat(&mut self) {
        let Some(path) = &self.heat_path else { return };
        if !self.heat_dirty {
            return;
        }
        let counts = self.session.streamer().heat().to_vec();
        match heat::save(path, &self.identity, &counts) {
            Ok(()) => {
                self.heat_dirty = false;
                log::info!("heat map saved to {}", path.display());
            }
            Err(e) => log::warn!("cannot save the heat map: {e}"),
        }
    }

    /// Sends the end of a generation that ran: its last output and `Done` with why it ended
    /// (nothing more when its client cancelled it).
    fn finish(
        &self,
        events: &EventSender,
        cancel: &AtomicBool,
        prompt_tokens: usize,
        g: &Generation,
        mut answer: Answer,
    ) {
        let (last, message) = answer.finish();
        let stop_sequence = answer.stop_sequence().map(str::to_string);
        let stopped = stop_sequence.is_some();
        if let Some(e) = last {
            let _ = events.send(e);
        }
        self.shared.metrics.generation(GenerationCounts {
            prompt_tokens: prompt_tokens as u64,
            reused_tokens: g.reused as u64,
            completion_tokens: g.tokens.len() as u64,
            decode: g.decode,
            decoded: u64::from(g.decoded),
        });
        if cancel.load(Ordering::Relaxed) {
            self.shared.metrics.cancelled();
            return;
        }
        let finish = if !(stopped || g.stopped_at_eog) {
            Finish::Length
        } else if message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()) {
            Finish::ToolCalls
        } else {
            Finish::Stop
        };
        let usage = TokenUsage { prompt: prompt_tokens, cached: g.reused, completion: g.tokens.len() };
        let _ = events.send(Event::Done { finish, usage, message, stop_sequence });
    }

    /// Why a generation failed, for its client: cancelled (503), a grammar too costly for the
    /// request field `grammar_param` (400), a lost RPC worker (503, and the model is loaded
    /// again), or anything else (500).
    fn failure(&mut self, e: &StreamError, grammar_param: &'static str) -> ApiError {
        match e {
            e if e.is_cancelled() => {
                self.shared.metrics.cancelled();
                log::info!("generation cancelled after its client went away or the server began stopping");
                ApiError::new(503, "server_error", "the generation was cancelled")
            }
            StreamError::Generate(GenerateError::Llama(e @ ggml_sys::Error::GrammarTooSlow { .. })) => {
                log::warn!("a request's grammar was too costly: {e}");
                ApiError::invalid(e.to_string(), Some(grammar_param))
            }
            e => {
                log::error!("generation failed: {e}");
                let code = match e.lost_worker() {
                    Some(endpoint) => {
                        self.lost = Some(endpoint.to_string());
                        503
                    }
                    None => 500,
                };
                ApiError::new(code, "server_error", format!("generation failed: {e}"))
            }
        }
    }
}
