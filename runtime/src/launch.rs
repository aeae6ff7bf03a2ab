//! The one door for a streamed run: from the model's path, the resolved board and the run's
//! shape, it indexes the model, splits it over RPC workers when asked, loads it, plans its
//! memory within the board's budget (deciding the expert cache once), and opens the streamed
//! session. `sluice run`, `sluice serve`, `sluice bench` and `sluice plan` keep only their own
//! part: printing, metrics, bench rows.
//!
//! The order: index, then (with workers) the split, sized from a metadata-only load; then the
//! load ([`Launch::load`]: metadata and vocabulary, no expert), the context's positions, the
//! ledger; then [`Loaded::open`]: the warm-up capture and the dense read.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ggml_sys::{Model, Token};

use crate::board::{Overlap, ResolvedBoard};
use crate::budget::{self, Batch, BudgetError, Item, Ledger, PlanRequest};
use crate::generate::{self, ContextShape, GenerateError, Session};
use crate::lossy::Lossy;
use crate::scaleout::{self, ScaleError, Split};
use crate::stream::{
    self, CoresLoad, DecodeOverlap, DensePolicy, ExpertIndex, IndexError, ModelLoad, StreamConfig, StreamError,
    StreamedSession,
};
use sluice_hal::usage::PhaseMeter;

/// How many context positions the run holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Positions {
    /// A prompt and the tokens to generate after it: the context holds exactly those.
    Prompt {
        /// The prompt's text.
        text: String,
        /// Tokens to generate.
        n_predict: u32,
        /// At least this many positions (`--ctx`: a long conversation's KV cache; 0: no more).
        reserve: u32,
    },
    /// A fixed count (`--ctx`); beyond the model's own length the plan refuses it.
    Fixed(u32),
    /// The model's own context length, at most this many.
    ModelCapped(u32),
    /// What the board's plan affords (`sluice serve` without `--ctx`):
    /// [`budget::planned_positions`]; with RPC workers (whose split is sized before the plan)
    /// the middle of [`budget::PLANNED_CONTEXTS`].
    Planned,
}

/// How big the expert cache is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// What the budget leaves after the rest of the ledger, at most all the experts.
    Auto,
    /// This many bytes (`--cache-mb`); 0 reads every routed expert every time.
    Fixed(u64),
}

impl Cache {
    /// `--cache-mb`'s value: `None` is automatic.
    pub fn from_mib(mib: Option<u64>) -> Cache {
        mib.map_or(Cache::Auto, |m| Cache::Fixed(m.saturating_mul(1 << 20)))
    }

    fn bytes(self) -> Option<u64> {
        match self {
            Cache::Auto => None,
            Cache::Fixed(b) => Some(b),
        }
    }
}

/// A streamed run's shape: what the door is built from.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The model's first file.
    pub model: PathBuf,
    /// The board it runs on: threads, lanes, budget, compute service, overlap, verify, draft.
    pub board: ResolvedBoard,
    /// The context's positions, per slot.
    pub positions: Positions,
    /// Slots: conversations whose memory the context keeps apart (`serve --slots`; 1 elsewhere).
    pub slots: u32,
    /// The most prompt tokens one decode takes, or how to choose it.
    pub batch: Batch,
    /// The expert cache.
    pub cache: Cache,
    /// Accept a cache below one token's routed demand (`--force-cache`).
    pub force_cache: bool,
    /// Where the dense weights live (the cuda service always uses llama.cpp's mapping).
    pub dense: DensePolicy,
    /// Opt-in lossy modes.
    pub lossy: Lossy,
    /// RPC workers holding the model's last layers (`--rpc`); empty: this board alone.
    pub rpc: Vec<String>,
    /// Bytes the front end keeps beside the generation at most (`serve`: the responses kept for
    /// `previous_response_id`), planned as a ledger line of its own; 0 for none.
    pub kept_bytes: u64,
}

/// Why a streamed run could not start (or, from a session it opened, could not go on).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The model cannot be indexed for streaming.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// The model could not be checked, loaded or tokenized, or the prompt does not fit it.
    #[error(transparent)]
    Model(#[from] GenerateError),
    /// The model could not be split over the RPC workers.
    #[error(transparent)]
    Split(#[from] ScaleError),
    /// The run does not fit the budget.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The streamed session could not be opened.
    #[error(transparent)]
    Stream(#[from] StreamError),
}

impl LaunchError {
    /// The RPC worker this error is about, when one could not be reached or was lost.
    pub fn lost_worker(&self) -> Option<&str> {
        match self {
            LaunchError::Model(e) => e.lost_worker(),
            LaunchError::Split(ScaleError::Worker(e)) => e.lost_worker(),
            LaunchError::Split(ScaleError::Budget(e)) | LaunchError::Budget(e) => e.lost_worker(),
            LaunchError::Stream(e) => e.lost_worker(),
            LaunchError::Index(_) | LaunchError::Split(_) => None,
        }
    }

    /// Whether the run was cancelled (its abort flag set) rather than failed.
    pub fn is_cancelled(&self) -> bool {
        match self {
            LaunchError::Model(e) => matches!(e, GenerateError::Cancelled),
            LaunchError::Stream(e) => e.is_cancelled(),
            _ => false,
        }
    }
}

/// What [`Launch::plan`] found: the index (this board's layers), the split and the ledger (or
/// why the run does not fit; the error holds the ledger too).
#[derive(Debug)]
pub struct Planned {
    /// The index of the layers this board streams.
    pub index: ExpertIndex,
    /// The split over the RPC workers, when there are any.
    pub split: Option<Split>,
    /// The ledger within the budget, or the refusal with the fixes.
    pub ledger: Result<Ledger, BudgetError>,
}

/// A loaded model, planned and ready for [`Loaded::open`].
pub struct Loaded {
    /// The model (its experts not read).
    pub model: Arc<Model>,
    /// The index of the layers this board streams.
    pub index: Arc<ExpertIndex>,
    /// The streaming configuration, its cache size from the ledger.
    pub config: StreamConfig,
    /// The memory plan.
    pub ledger: Ledger,
    /// The context's shape: its positions per slot, slots and prompt batch.
    pub shape: ContextShape,
    /// The prompt's tokens, when the positions came from a prompt (else empty).
    pub prompt: Vec<Token>,
    /// The split over the RPC workers, when there are any.
    pub split: Option<Split>,
    threads: ggml_sys::Threads,
    draft: Option<usize>,
    load: Cost,
}

/// What opening a model cost: wall time and the bytes this process read from storage (`None`
/// where the kernel does not count them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cost {
    /// Wall time.
    pub wall: Duration,
    /// Bytes read from storage.
    pub read: Option<u64>,
}

impl Cost {
    fn measure<T, E>(f: impl FnOnce() -> Result<T, E>) -> Result<(T, Cost), E> {
        let meter = PhaseMeter::start();
        let out = f()?;
        let (wall, read) = meter.finish();
        Ok((out, Cost { wall, read }))
    }

    fn plus(self, other: Cost) -> Cost {
        Cost { wall: self.wall + other.wall, read: self.read.zip(other.read).map(|(a, b)| a + b) }
    }
}

impl Launch {
    /// Indexes the model and splits it over the RPC workers (when any), and plans this board's
    /// memory, loading nothing but metadata: what `sluice plan` prints. A prompt's positions are
    /// counted with the model's tokenizer.
    pub fn plan(&self) -> Result<Planned, LaunchError> {
        let positions = self.positions_before_load()?;
        let (index, split) = self.index_and_split(Some(positions))?;
        let rpc = split.as_ref().map(Split::rpc);
        let shape = ContextShape { positions, slots: self.slots, batch: self.batch.first(), kv: self.board.kv };
        let ledger = self.plan_ledger(&index, shape, rpc.as_ref());
        Ok(Planned { index, split, ledger })
    }

    /// Indexes, splits, loads (metadata and vocabulary; no expert is read) and plans: the
    /// ledger decides the expert cache once, and a run that does not fit is refused here.
    /// `on_step` hears each step as it starts (the service's status page shows them).
    pub fn load(&self, on_step: &mut dyn FnMut(&str)) -> Result<Loaded, LaunchError> {
        if self.dense != self.dense() {
            log::info!("cuda service: dense weights are loaded by llama.cpp (--dense mmap)");
        }
        on_step("indexing the model's experts");
        let (index, split) = if self.rpc.is_empty() {
            self.index_and_split(None)?
        } else {
            on_step("connecting to the RPC workers and splitting the model");
            self.index_and_split(Some(self.positions_before_load()?))?
        };
        let rpc = split.as_ref().map(Split::rpc);
        on_step("loading the model's metadata and vocabulary");
        let (model, load) = Cost::measure(|| self.load_model(&index, rpc.as_ref()))?;
        let (n_ctx, prompt) = match &self.positions {
            Positions::Prompt { text, n_predict, reserve } => {
                let tokens = Session::prepare(&model, text, *n_predict)?;
                (((tokens.len() + *n_predict as usize) as u32).max(*reserve), tokens)
            }
            Positions::Fixed(n) => (*n, Vec::new()),
            Positions::ModelCapped(cap) => (model.n_ctx_train().min(*cap), Vec::new()),
            Positions::Planned => (self.planned_positions(&index, rpc.as_ref(), model.n_ctx_train()), Vec::new()),
        };
        on_step("planning memory");
        let shape = ContextShape { positions: n_ctx, slots: self.slots, batch: self.batch.first(), kv: self.board.kv };
        let ledger = self.plan_ledger(&index, shape, rpc.as_ref())?;
        let shape = match self.batch {
            Batch::FromBudget => ContextShape { batch: ledger.n_batch, ..shape },
            Batch::Fixed(_) => shape,
        };
        log::info!("{}", ledger.describe());
        let config = self.stream_config(&ledger, rpc);
        if !config.lossy.is_exact() {
            log::warn!("{}", config.lossy.describe(index.n_expert_used));
        }
        Ok(Loaded {
            model: Arc::new(model),
            index: Arc::new(index),
            config,
            ledger,
            shape,
            prompt,
            split,
            threads: self.board.threads(),
            draft: self.board.draft_max(),
            load,
        })
    }

    /// The context's positions before the model is loaded, from a metadata-only load.
    fn positions_before_load(&self) -> Result<u32, GenerateError> {
        match &self.positions {
            Positions::Prompt { text, n_predict, reserve } => {
                Ok(generate::prompt_positions(&self.model, text, *n_predict)?.max(*reserve))
            }
            Positions::Fixed(n) => Ok(*n),
            Positions::ModelCapped(cap) => Ok(generate::context_length(&self.model)?.min(*cap)),
            Positions::Planned => Ok(generate::context_length(&self.model)?.min(budget::PLANNED_CONTEXTS[1])),
        }
    }

    /// The context of [`Positions::Planned`] for a model trained for `trained` positions.
    fn planned_positions(&self, index: &ExpertIndex, rpc: Option<&ggml_sys::RpcSplit>, trained: u32) -> u32 {
        if rpc.is_some() {
            return budget::PLANNED_CONTEXTS[1].min(trained);
        }
        budget::planned_positions(trained, |positions| {
            let shape = ContextShape { positions, slots: self.slots, batch: self.batch.first(), kv: self.board.kv };
            budget::plan_within_budget(&self.plan_request(index, shape, None)).ok()
        })
    }

    /// The index, narrowed to this board's layers when `positions` (known when there are
    /// workers) sized a split.
    fn index_and_split(&self, positions: Option<u32>) -> Result<(ExpertIndex, Option<Split>), LaunchError> {
        let index = ExpertIndex::open(&self.model)?;
        let Some(positions) = positions.filter(|_| !self.rpc.is_empty()) else {
            return Ok((index, None));
        };
        let (split, head) = scaleout::prepare(
            &self.rpc,
            &self.model,
            index,
            ContextShape { positions, slots: self.slots, batch: self.batch.first(), kv: self.board.kv },
            self.gpu_layers() > 0,
        )?;
        if let Some(split) = &split {
            log::info!("{}", split.describe());
        }
        Ok((head, split))
    }

    fn load_model(&self, index: &ExpertIndex, rpc: Option<&ggml_sys::RpcSplit>) -> Result<Model, GenerateError> {
        let load = ModelLoad { dense: self.dense(), gpu_layers: self.gpu_layers(), rpc, lossy: self.lossy };
        stream::load_configured(&self.model, index, &load)
    }

    /// The ledger of `shape`, its batch chosen from the budget when asked. With RPC workers the
    /// batch stays the first one: the split was sized with it.
    fn plan_ledger(
        &self,
        index: &ExpertIndex,
        shape: ContextShape,
        rpc: Option<&ggml_sys::RpcSplit>,
    ) -> Result<Ledger, BudgetError> {
        let req = self.plan_request(index, shape, rpc);
        match self.batch {
            Batch::FromBudget if rpc.is_none() => budget::plan_batch_from_budget(&req, self.board.medium),
            _ => budget::plan_within_budget(&req),
        }
    }

    fn plan_request<'a>(
        &'a self,
        index: &'a ExpertIndex,
        shape: ContextShape,
        rpc: Option<&'a ggml_sys::RpcSplit>,
    ) -> PlanRequest<'a> {
        PlanRequest {
            model: &self.model,
            index,
            shape,
            dense: self.dense(),
            cache_bytes: self.cache.bytes(),
            budget: self.board.budget.clone(),
            gpu: self.gpu_layers() > 0,
            rpc,
            kept: self.kept_bytes,
            lookahead: self.board.lookahead,
        }
    }

    fn gpu_layers(&self) -> u32 {
        self.board.compute.gpu_layers()
    }

    /// The dense policy the run uses: the cuda service's dense weights are llama.cpp's.
    fn dense(&self) -> DensePolicy {
        if self.gpu_layers() > 0 {
            DensePolicy::Mmap
        } else {
            self.dense
        }
    }

    /// The engine's configuration with the cache (and, with expert slots, the pool of its cache
    /// and staging lines) the ledger decided and the split's layers.
    fn stream_config(&self, ledger: &Ledger, rpc: Option<ggml_sys::RpcSplit>) -> StreamConfig {
        let overlap = self.board.overlap.value;
        let cache_bytes = ledger.cache_bytes();
        StreamConfig {
            cache_bytes,
            force_cache: self.force_cache,
            lanes: self.board.lanes(),
            dense: self.dense(),
            trace_routes: false,
            cache_policy: self.board.cache_policy.value,
            expert_pool: self.board.expert_slots.then(|| cache_bytes + ledger.bytes(Item::IoStaging)),
            gpu_layers: self.gpu_layers(),
            overlap: (overlap != Overlap::Off).then_some(stream::READ_BOUND),
            overlap_decodes: match overlap {
                Overlap::Off | Overlap::Prompt => DecodeOverlap::Never,
                Overlap::Auto => DecodeOverlap::WhenIdle,
                Overlap::On => DecodeOverlap::Always,
            },
            cores_load: CoresLoad::Measured,
            lossy: self.lossy,
            rpc,
            verify: self.board.verify,
            lookahead: self.board.lookahead,
            force_routes: None,
            record_routes: false,
        }
    }
}

impl Loaded {
    /// Opens the streamed session: starts the lanes, captures the weights in a warm-up decode
    /// and reads the dense ones; drafting as the board says. Returns it with what the load and
    /// the open cost together (the planning not counted).
    pub fn open(&self) -> Result<(StreamedSession<'_>, Cost), LaunchError> {
        let (mut session, open) = Cost::measure(|| {
            StreamedSession::open(&self.model, Arc::clone(&self.index), &self.config, self.shape, &self.threads)
        })?;
        session.set_draft(self.draft)?;
        log::info!(
            "streaming {} experts/layer over {} layers; cache {} MiB",
            self.index.n_expert,
            self.index.n_layer,
            self.config.cache_bytes >> 20
        );
        Ok((session, self.load.plus(open)))
    }

    /// The expert cache the session keeps, at most all the experts' bytes.
    pub fn cache_bytes(&self) -> u64 {
        self.config.cache_bytes.min(self.index.all_expert_window_bytes())
    }
}

#[cfg(test)]
mod tests;
