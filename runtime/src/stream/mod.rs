//! Streaming: routed experts read from storage on demand, byte-identical to resident.
//!
//! [`ExpertIndex`] finds the experts in the file(s); [`StreamedSession`] loads the model,
//! captures its weight tensors in a warm-up decode, rebinds the experts into page-congruent
//! anonymous memory, and from then on makes each layer's routed experts resident when the
//! router has picked them (see [`engine`]), through the [`io`] lanes and under the
//! [`cache`]'s byte budget.

pub mod cache;
pub mod checksums;
pub mod engine;
pub mod index;
pub mod io;
pub mod kernel;
pub mod record;

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ggml_sys::{Model, Token};

use crate::generate::{to_end, Chosen, DecodeEvent, DecodeObserver, GenerateError, Generation, Sampler, Session};
pub use cache::CacheCounters;
pub use engine::{DecodeStats, RouteRecord, Streamer};
pub use index::{ExpertIndex, IndexError};
pub use io::{FaultKind, IoLanes, LaneConfig, ReadFailure, ReadFault, SliceCheck, READ_BOUND};
pub use record::TokenRow;
use sluice_hal::usage::Usage;

/// Errors of the streaming engine.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The model cannot be indexed for streaming.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// An expert tensor never appeared in the warm-up graph.
    #[error("expert tensor {tensor} is not used by llama.cpp's graph for '{arch}', so sluice cannot tell when it is needed; run the model with --resident")]
    NotCaptured {
        /// The tensor.
        tensor: String,
        /// The architecture.
        arch: String,
    },
    /// An expert tensor is used other than by its layer's routed matrix product.
    #[error("expert tensor {tensor} is used by graph node {node} ({op}), not by a routed product over {router}: llama.cpp builds '{arch}' in a way sluice cannot stream; run the model with --resident")]
    Unrouted {
        /// The tensor.
        tensor: String,
        /// The node that uses it.
        node: String,
        /// The node's operation.
        op: String,
        /// The router node the use should take its expert ids from.
        router: String,
        /// The architecture.
        arch: String,
    },
    /// The graph's tensor does not match the file's.
    #[error("expert tensor {tensor}: {detail}")]
    LayoutMismatch {
        /// The tensor.
        tensor: String,
        /// How they differ.
        detail: String,
    },
    /// Address space could not be reserved.
    #[error("cannot reserve memory for an expert tensor: {0}")]
    Reserve(std::io::Error),
    /// A read failed.
    #[error(transparent)]
    Read(#[from] ReadFailure),
    /// `--verify`: the checksums could not be loaded, or the model's headers do not match them.
    #[error(transparent)]
    Sums(#[from] crate::stream::checksums::SumsError),
    /// The lanes could not be started.
    #[error("cannot start the I/O lanes: {0}")]
    Lanes(std::io::Error),
    /// The routed-product kernel could not be registered.
    #[error("cannot register the streamed experts' kernel with ggml: {0}")]
    Kernel(String),
    /// The graph did not look as expected.
    #[error("unexpected graph: {0}")]
    Graph(String),
    /// The router produced an impossible expert id.
    #[error("layer {layer} routed to expert id {id}, outside 0..{n_expert}")]
    BadExpertId {
        /// Layer.
        layer: u32,
        /// The id.
        id: i32,
        /// Experts in the layer.
        n_expert: u32,
    },
    /// The cache budget is below one token's demand.
    #[error("expert cache of {budget_mib:.1} MiB is below one token's routed demand of {min_mib:.1} MiB ({layers} MoE layers x their {k} largest experts); give at least --cache-mb {min_mb}, --cache-mb 0 for no cache, or --force-cache to accept a cache that cannot hold a token")]
    CacheTooSmall {
        /// Requested budget in MiB.
        budget_mib: f64,
        /// Minimum in MiB.
        min_mib: f64,
        /// The minimum rounded up to whole MiB.
        min_mb: u64,
        /// MoE layers.
        layers: usize,
        /// Experts per token (the most over the layers).
        k: u32,
    },
    /// Loading, tokenizing or decoding failed, or the generation was cancelled.
    #[error(transparent)]
    Generate(#[from] GenerateError),
}

impl From<ggml_sys::Error> for StreamError {
    fn from(e: ggml_sys::Error) -> Self {
        StreamError::Generate(e.into())
    }
}

impl StreamError {
    /// The RPC worker whose loss ended the run, if that is what ended it.
    pub fn lost_worker(&self) -> Option<&str> {
        match self {
            StreamError::Generate(e) => e.lost_worker(),
            _ => None,
        }
    }

    /// Whether the run was cancelled (its abort flag set, or a read it waited for given up for
    /// it) rather than failed.
    pub fn is_cancelled(&self) -> bool {
        match self {
            StreamError::Generate(e) => matches!(e, GenerateError::Cancelled),
            StreamError::Read(f) => f.cause.kind() == std::io::ErrorKind::Interrupted,
            _ => false,
        }
    }
}

/// Where dense (non-expert) weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DensePolicy {
    /// Read once with the lanes into anonymous memory: the kernel cannot evict them.
    Anon,
    /// llama.cpp's own file mapping: the kernel may evict and re-read them under pressure.
    Mmap,
}

/// How to stream.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Expert cache budget in bytes (0: no cache).
    pub cache_bytes: u64,
    /// Accept a budget below one token's demand.
    pub force_cache: bool,
    /// Reader configuration.
    pub lanes: LaneConfig,
    /// Dense weights policy.
    pub dense: DensePolicy,
    /// Record every layer's routes (for tests and traces).
    pub trace_routes: bool,
    /// Layers offloaded to a GPU (the `cuda` compute service; 0 on the CPU).
    pub gpu_layers: u32,
    /// Overlap expert reads with expert compute (the kernel computes each expert once its
    /// slices have landed), each wait for one expert bounded by this long; `None` reads each
    /// layer's experts before its products run.
    pub overlap: Option<Duration>,
    /// With `overlap`: overlap prompt batches only, and read single-token decodes' experts
    /// before their products run.
    pub overlap_prompt_only: bool,
    /// Opt-in lossy modes (default: exact).
    pub lossy: crate::lossy::Lossy,
    /// The layers RPC workers hold, resident there (`--rpc`); the index then keeps only this
    /// board's layers ([`ExpertIndex::keep_layers_below`]).
    pub rpc: Option<ggml_sys::RpcSplit>,
    /// Check every expert and dense read against the model's checksum sidecar
    /// ([`crate::stream::checksums`], `storage.verify`).
    pub verify: bool,
}

/// A regular expression matching the routed expert tensors of `index`: of every layer, or with
/// `only_its_layers` of the layers it holds (the others are resident on RPC workers, and a lazy
/// tensor would stay in this board's memory).
fn expert_pattern(index: &ExpertIndex, only_its_layers: bool) -> String {
    let layers = if only_its_layers {
        format!("({})", index.moe_layers().map(|l| l.to_string()).collect::<Vec<_>>().join("|"))
    } else {
        "[0-9]+".to_string()
    };
    format!(r"^blk\.{layers}\.({})\.weight$", index.expert_kinds().join("|"))
}

/// The tensors a streamed open keeps out of llama.cpp's load-time prefetch: the routed experts
/// always (the engine reads them on demand), and with dense `anon` every tensor (the engine reads
/// the dense ones itself, once, with its own reader).
pub fn lazy_pattern(index: &ExpertIndex, dense: DensePolicy) -> String {
    match dense {
        DensePolicy::Anon => ".".to_string(),
        DensePolicy::Mmap => expert_pattern(index, false),
    }
}

/// Loads `path` for streaming: like [`crate::generate::load_model`], but without reading the
/// tensors that [`lazy_pattern`] names (vendor patch 0002). With `gpu_layers > 0` (the `cuda`
/// service) that many layers are offloaded, while the expert tensors stay in CPU buffers so they
/// still stream; the dense weights are then llama.cpp's (use [`DensePolicy::Mmap`]).
pub fn load_streamed_model(
    path: &std::path::Path,
    index: &ExpertIndex,
    dense: DensePolicy,
    gpu_layers: u32,
) -> Result<Model, GenerateError> {
    crate::generate::load_model_with(path, &streamed_params(index, dense, gpu_layers, None))
}

/// [`load_streamed_model`] as `config` says, its lossy `--experts-used` included (checked
/// against the model).
pub fn load_configured(
    path: &std::path::Path,
    index: &ExpertIndex,
    config: &StreamConfig,
) -> Result<Model, GenerateError> {
    config.lossy.check(index.n_expert_used).map_err(GenerateError::Lossy)?;
    let params = ggml_sys::ModelParams {
        int_overrides: config.lossy.model_overrides(&index.arch),
        ..streamed_params(index, config.dense, config.gpu_layers, config.rpc.as_ref())
    };
    crate::generate::load_model_with(path, &params)
}

/// The model parameters of a streamed load (see [`load_streamed_model`]). With `rpc`, the
/// workers' layers and the output layer load resident onto them: nothing of theirs is lazy (a
/// lazy tensor stays in this board's memory). With dense `anon`, everything else is lazy, as on
/// one board, and llama.cpp reads the workers' tensors with O_DIRECT, so their pages do not
/// crowd this board's memory on their way to the workers.
fn streamed_params(
    index: &ExpertIndex,
    dense: DensePolicy,
    gpu_layers: u32,
    rpc: Option<&ggml_sys::RpcSplit>,
) -> ggml_sys::ModelParams {
    let (lazy, direct_io) = match (rpc, dense) {
        (None, _) => (lazy_pattern(index, dense), false),
        (Some(_), DensePolicy::Mmap) => (expert_pattern(index, true), false),
        (Some(split), DensePolicy::Anon) => {
            let first_remote = index.n_layer.saturating_sub(split.layers.iter().sum());
            let remote: Vec<String> = (first_remote..index.n_layer).map(|l| l.to_string()).collect();
            (format!(r"^(?!blk\.({})\.|output)", remote.join("|")), true)
        }
    };
    ggml_sys::ModelParams {
        lazy_tensor_pattern: Some(lazy),
        n_gpu_layers: gpu_layers.min(i32::MAX as u32) as i32,
        cpu_tensor_pattern: (gpu_layers > 0).then(|| expert_pattern(index, false)),
        metadata_only: false,
        int_overrides: Vec::new(),
        rpc: rpc.cloned(),
        direct_io,
    }
}

/// Checks `budget` against one token's routed demand.
pub fn check_cache_budget(index: &ExpertIndex, budget: u64, force: bool) -> Result<(), StreamError> {
    let min = index.one_token_demand();
    if budget == 0 || budget >= min || force {
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    Err(StreamError::CacheTooSmall {
        budget_mib: mib(budget),
        min_mib: mib(min),
        min_mb: min.div_ceil(1 << 20),
        layers: index.moe_layers().count(),
        k: index.n_expert_used,
    })
}

/// The checksums every read of `index`'s model is checked against (`--verify`); the model's
/// headers are checked now. With dense `mmap` llama.cpp's mapping reads the dense weights,
/// unchecked: said once.
fn open_sums(index: &ExpertIndex, dense: DensePolicy) -> Result<crate::stream::checksums::ReadSums, StreamError> {
    let sums = crate::stream::checksums::ReadSums::load(index)?;
    if dense == DensePolicy::Mmap {
        log::warn!(
            "--verify checks the routed experts' reads; with dense mmap (the cuda service) llama.cpp's mapping reads the dense weights unchecked: `sluice verify --check --model MODEL` checks those"
        );
    }
    Ok(sums)
}

/// A session that streams routed experts.
pub struct StreamedSession<'m> {
    // The context first, then the kernel's claim on its expert tensors.
    session: Session<'m>,
    _claims: kernel::Claims,
    streamer: Arc<Mutex<Streamer<'m>>>,
    /// Dense bytes read at open (dense `anon`).
    pub dense_bytes_read: u64,
    /// Time the open (capture, rebind, dense read) took.
    pub open_time: Duration,
}

impl<'m> StreamedSession<'m> {
    /// Sets up streaming over `model` (loaded from `index`'s files): starts the lanes, creates a
    /// context with room for `n_ctx` positions, captures the weights in a warm-up decode, and
    /// rebinds them.
    pub fn open(
        model: &'m Model,
        index: Arc<ExpertIndex>,
        config: &StreamConfig,
        n_ctx: u32,
        threads: &ggml_sys::Threads,
    ) -> Result<Self, StreamError> {
        let t0 = std::time::Instant::now();
        check_cache_budget(&index, config.cache_bytes, config.force_cache)?;
        if !index.verified {
            log::warn!(
                "architecture '{}' is not verified by a sluice gate: its experts ({}) stream by the generic rule, checked at warm-up; compare with --resident once",
                index.arch,
                index.expert_kinds().join(", ")
            );
        }
        let sums = if config.verify { Some(Arc::new(open_sums(&index, config.dense)?)) } else { None };
        let lanes = Arc::new(IoLanes::new(&index.shards, &config.lanes).map_err(StreamError::Lanes)?);
        let bound = config.overlap.unwrap_or(config.lanes.bound);
        let source = Arc::new(kernel::ExpertSource::new(lanes, bound, threads.count));
        let mut streamer = Streamer::new(
            model,
            Arc::clone(&index),
            Arc::clone(&source),
            config.cache_bytes,
            config.dense == DensePolicy::Anon,
            config.gpu_layers > 0,
        );
        if config.trace_routes {
            streamer.enable_trace();
        }
        if let Some(sums) = sums {
            streamer.set_sums(sums);
        }
        streamer.set_substitute(config.lossy.substitute);
        let streamer = Arc::new(Mutex::new(streamer));
        let cb_streamer = Arc::clone(&streamer);
        let callback: ggml_sys::EvalCallback<'m> = Box::new(move |t, phase| lock(&cb_streamer).on_eval(t, phase));
        let (session, claim) = kernel::claiming(&index, || Session::new(model, n_ctx, threads, Some(callback)))?;
        let mut session = session?;
        let claims = kernel::Claims::register(&index, &claim, &source);
        lock(&streamer).set_kernel_tensors(claims.taken());
        let warmed = session.warm_up(model.tokenize("", true)?.first().copied().unwrap_or(0));
        // A capture failure (a failed read stops the warm-up) says more than the decode's status.
        let dense_bytes_read = lock(&streamer).finish_capture()?;
        warmed?;
        if let Some(bound) = config.overlap {
            lock(&streamer).enable_overlap(bound, config.overlap_prompt_only);
        }
        Ok(StreamedSession { session, _claims: claims, streamer, dense_bytes_read, open_time: t0.elapsed() })
    }

    /// The streamer's state (counters, trace, budget).
    pub fn streamer(&self) -> MutexGuard<'_, Streamer<'m>> {
        lock(&self.streamer)
    }

    /// The model this session runs.
    pub fn model(&self) -> &'m Model {
        self.session.model()
    }

    /// Generates like [`Session::generate`], returning per-decode telemetry rows too.
    pub fn generate(
        &mut self,
        prompt: &[Token],
        n_predict: u32,
        on_token: impl FnMut(Token, &[u8]),
        on_row: impl FnMut(&TokenRow),
    ) -> Result<(Generation, Vec<TokenRow>), StreamError> {
        let mut sampler = Sampler::greedy(self.session.model())?;
        self.generate_with(prompt, n_predict, &mut sampler, to_end(on_token), on_row)
    }

    /// Generates like [`Session::generate_with`], returning per-decode telemetry rows too.
    pub fn generate_with(
        &mut self,
        prompt: &[Token],
        n_predict: u32,
        sampler: &mut Sampler,
        on_token: impl FnMut(&Chosen<'_>) -> ControlFlow<()>,
        on_row: impl FnMut(&TokenRow),
    ) -> Result<(Generation, Vec<TokenRow>), StreamError> {
        self.observed(on_row, |session, observer| session.generate_with(prompt, n_predict, sampler, on_token, observer))
    }

    /// Teacher forcing like [`Session::score_continuation`], streamed.
    pub fn score_continuation(
        &mut self,
        prompt: &[Token],
        continuation: &[Token],
        on_logits: impl FnMut(usize, &[f32]),
    ) -> Result<Vec<TokenRow>, StreamError> {
        let ((), rows) = self.observed(
            |_| {},
            |session, observer| session.score_continuation(prompt, continuation, on_logits, observer),
        )?;
        Ok(rows)
    }

    /// Runs `decode` on the session with an observer that ends each decode in the streamer
    /// (its failure becomes the error) and records a telemetry row, passed to `on_row` too.
    fn observed<R>(
        &mut self,
        mut on_row: impl FnMut(&TokenRow),
        decode: impl FnOnce(&mut Session<'m>, &mut DecodeObserver<'_, StreamError>) -> Result<R, StreamError>,
    ) -> Result<(R, Vec<TokenRow>), StreamError> {
        let streamer = Arc::clone(&self.streamer);
        let mut rows = Vec::new();
        let mut usage = Usage::sample();
        let mut observer = |event: DecodeEvent| -> Result<(), StreamError> {
            let mut s = lock(&streamer);
            s.end_decode();
            if let Some(e) = s.take_failure() {
                // A read given up for the abort flag: the generation was cancelled.
                return Err(if e.is_cancelled() { GenerateError::Cancelled.into() } else { e });
            }
            let stats = s.take_stats();
            let now = Usage::sample();
            let row = TokenRow::new(rows.len(), event, stats, &usage, &now, s.cache_counters());
            usage = now;
            drop(s);
            on_row(&row);
            rows.push(row);
            Ok(())
        };
        let result = decode(&mut self.session, &mut observer)?;
        Ok((result, rows))
    }

    /// Drafts up to `max` tokens per decode from the context's n-grams ([`Session::set_draft`]).
    pub fn set_draft(&mut self, max: Option<usize>) {
        self.session.set_draft(max);
    }

    /// Makes every later decode stop as soon as `flag` is set: the generation then ends with
    /// [`GenerateError::Cancelled`] (in [`StreamError::Generate`]) and the session stays usable.
    /// A read the decode waits for is given up as soon as the flag is set, too.
    pub fn set_abort_flag(&mut self, flag: Option<Arc<std::sync::atomic::AtomicBool>>) {
        lock(&self.streamer).lanes().set_cancel_flag(flag.clone());
        self.session.set_abort_flag(flag);
    }
}

/// The streamer, locked. A lock poisoned by a panic mid-decode is not trusted: the streamer's
/// cache is reset first (its residency may not match the memory).
fn lock<'a, 'm>(s: &'a Mutex<Streamer<'m>>) -> MutexGuard<'a, Streamer<'m>> {
    match s.lock() {
        Ok(guard) => guard,
        Err(poisoned) => {
            let mut guard = poisoned.into_inner();
            log::error!("the streaming engine panicked during a decode: forgetting its expert cache");
            guard.reset_after_panic();
            s.clear_poison();
            guard
        }
    }
}
