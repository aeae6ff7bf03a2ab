//! The streaming engine, driven from llama.cpp's eval callback once the warm-up capture
//! ([`super::capture`]) has bound the expert tensors: it plans and submits each layer's reads.
//! The experts' memory is [`super::residency`]'s, the router's choices [`super::routing`]'s.
//!
//! Every decode: the callback asks for `ffn_moe_topk-<il>` only. When it has been
//! computed, the layer's routed expert ids are read (stride-aware: the node is a view of the
//! whole argsort), deduplicated, planned against the cache, and the missing slices read by the
//! I/O lanes straight into place before the callback returns and the layer's expert matmuls run;
//! evicted experts' pages are released before the reads, or while they are with the device
//! where a single token's loads leave the pool room (`schedule::release_while_reading`). Serial
//! reads go out in file order (a prompt batch that routes most of a layer reads its tensors
//! nearly end to end); overlapped ones tensor by tensor in the order the graph uses the tensors
//! (recorded at capture), so the first product's slices land first, each tensor's experts in
//! file order.
//!
//! The layer's routed products run in the extension kernel ([`super::kernel`]), which computes
//! each expert once its slices have landed. Overlap (`--overlap`): the callback hands the
//! layer's reads to the lanes and returns at once, and the kernel computes the experts already
//! resident while the others arrive. A layer the kernel leaves to ggml-cpu (a prompt batch that
//! ggml-cpu's tiled K-quant path would round differently) is read serially. The batch is
//! collected at the next layer's top-k node (or at the end of the decode), before anything is
//! evicted: by then the layer's products have run, so no expert an in-flight layer needs is ever
//! released.
//!
//! Waves: a layer may run over the cache's budget by one token's routed demand in its largest
//! layer ([`ExpertIndex::layer_token_demand`], the ledger's I/O staging). A prompt batch that
//! routes more than that beyond the cache keeps what the budget holds and passes the rest
//! through the kernel: those reads share a window of that size, in the order the products use
//! them, and each expert's pages go back as soon as the kernel has computed it, so a layer
//! larger than the budget streams through it with each expert read once.
//!
//! Lookahead (`--lookahead`, in `ahead`): a single-token decode also reads the experts the
//! next layer's router is guessed to choose while this layer computes; the next layer's node
//! drops the wrong guesses. In `collect`: collecting a batch; in `prefill`: the warm start.
//! In [`idle`]: whether single-token decodes overlap now (`overlap = "auto"`).

use std::sync::Arc;

use ggml_sys::{EvalPhase, TensorView};

mod ahead;
mod collect;
pub mod idle;
mod prefill;
mod routes;
mod schedule;

use super::cache::{CacheCounters, LayerPlan};
use super::capture::Bound;
use super::index::ExpertIndex;
use super::io::{IoLanes, ReadJob};
use super::kernel::{self, ExpertSource};
use super::lookahead::Lookahead;
use super::record::DecodeStats;
use super::residency::Residency;
use super::routes::force::RouteForcer;
use super::routes::record::RouteRecorder;
use super::routing::{RouteRecord, Routing};
use super::trace::RouteTrace;
use super::StreamError;
use schedule::Schedule;
pub use schedule::{DecodeOverlap, Overlap};

/// The smallest batch ggml's scheduler may move from the CPU to a GPU (its `op_offload` of
/// products over weights in host memory): such a batch's products may not run in the kernel.
const GPU_OFFLOAD_BATCH: i64 = 32;

/// How the streamer runs, beyond what the capture bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamerSettings {
    /// The expert cache's budget, bytes.
    pub cache_budget: u64,
    /// Layers are offloaded to a GPU (their prompt batches may run there, outside the kernel).
    pub gpu: bool,
    /// Overlap reads with the kernel's compute (`None`: serial).
    pub overlap: Option<Overlap>,
    /// Lossy substitution's window ([`Routing::new`]).
    pub substitute: Option<u32>,
    /// Record every layer's routes.
    pub trace: bool,
    /// How the expert cache evicts.
    pub cache_policy: super::cache::CachePolicy,
    /// Bytes of the pool expert reads land in, committed now ([`Residency::new`]).
    pub expert_pool: Option<u64>,
    /// Guess the next layer's experts in single-token decodes and read them early.
    pub lookahead: bool,
    /// The cores the run computes and reads on (whose other use [`DecodeOverlap::WhenIdle`]
    /// watches; empty: every CPU the process may use).
    pub cores: Vec<usize>,
    /// Where [`DecodeOverlap::WhenIdle`] reads the cores' other use.
    pub cores_load: idle::CoresLoad,
    /// Recorded routes forced on the routers.
    pub force_routes: Option<RouteForcer>,
    /// Record every computed token's routes.
    pub record_routes: bool,
}

/// The state the eval callback drives after the capture.
pub struct Streamer {
    index: Arc<ExpertIndex>,
    source: Arc<ExpertSource>,
    memory: Residency,
    routing: Routing,
    /// Each layer's expert tensors in the order the graph uses them (from the capture).
    use_order: Vec<Vec<usize>>,
    /// Which expert tensors the graph uses more than once (their experts never pass through:
    /// a second product would read what the first gave back).
    reused: Vec<bool>,
    /// Which expert tensors the kernel computes (the others run in ggml's own kernel).
    in_kernel: Vec<bool>,
    gpu: bool,
    overlap: Option<Overlap>,
    /// Whether decodes overlap now ([`DecodeOverlap::WhenIdle`]).
    idle: Option<idle::IdleCores>,
    /// Whether a batch is out with the lanes (overlap or waves), collected at the next layer.
    in_flight: bool,
    /// How far a layer may run over the cache's budget; the window its passing reads share.
    staging: u64,
    plan: LayerPlan,
    /// The layer's reads in file order, each with whether it passes through.
    reads: Vec<(u32, bool)>,
    /// The (layer, expert) pairs of the batch being read into the cache.
    loading: Vec<(u32, u32)>,
    /// The (layer, expert) pairs of the batch passing through.
    passing: Vec<(u32, u32)>,
    jobs: Vec<ReadJob>,
    stats: DecodeStats,
    failure: Option<StreamError>,
    decode_no: u64,
    /// The guesser of the next layer's experts (`--lookahead`).
    lookahead: Option<Lookahead>,
    /// The context's compute threads, told to sleep before a wait for storage.
    compute_threads: Option<ggml_sys::ComputeThreads>,
    /// The (layer, expert) pairs read ahead in the batch out with the lanes (outside the
    /// cache, in the memory of the ledger's I/O staging).
    ahead: Vec<(u32, u32)>,
    /// The lookahead's reads, before they join the batch.
    ahead_jobs: Vec<ReadJob>,
    /// This layer's experts read ahead whole and then routed: planned as loads, not read again.
    ready: Vec<u32>,
    /// Experts read ahead (whole or not) that their router did not choose: their memory is given
    /// back once the layer's plan has made the chosen ones resident (they may share pages).
    spare: Vec<(u32, u32)>,
    /// Recorded routes forced on the routers (`--routes`).
    forcer: Option<RouteForcer>,
    /// Every computed token's routes (`--record-routes`).
    recorder: Option<RouteRecorder>,
}

impl Streamer {
    /// The streaming state over what the capture `bound`, reading with `source`'s lanes;
    /// `in_kernel` says which expert tensors the kernel computes.
    pub fn new(
        index: Arc<ExpertIndex>,
        source: Arc<ExpertSource>,
        bound: Bound,
        in_kernel: &[bool],
        sums: Option<Arc<super::checksums::ReadSums>>,
        settings: StreamerSettings,
    ) -> Self {
        let n_expert = index.n_expert as usize;
        let memory = (settings.cache_budget, settings.cache_policy, settings.expert_pool);
        Streamer {
            memory: Residency::new(Arc::clone(&index), bound.reservations, memory, sums),
            routing: Routing::new(index.n_layer, index.n_expert, settings.substitute, settings.trace),
            use_order: bound.use_order,
            reused: bound.reused,
            in_kernel: in_kernel.to_vec(),
            gpu: settings.gpu,
            overlap: settings.overlap,
            idle: settings
                .overlap
                .is_some_and(|o| o.decodes == DecodeOverlap::WhenIdle)
                .then(|| idle::IdleCores::new(&settings.cores, &settings.cores_load)),
            in_flight: false,
            staging: index.layer_token_demand(),
            plan: LayerPlan::with_capacity(n_expert * index.n_layer as usize),
            reads: Vec::with_capacity(n_expert),
            loading: Vec::with_capacity(n_expert),
            passing: Vec::with_capacity(n_expert),
            jobs: Vec::with_capacity(n_expert * 4),
            stats: DecodeStats::default(),
            failure: None,
            decode_no: 0,
            lookahead: settings.lookahead.then(|| Lookahead::new(index.n_layer, index.n_expert)),
            compute_threads: None,
            ahead: Vec::new(),
            ahead_jobs: Vec::new(),
            ready: Vec::new(),
            spare: Vec::new(),
            forcer: settings.force_routes,
            recorder: settings.record_routes.then(|| RouteRecorder::new(index.n_layer, index.n_expert)),
            source,
            index,
        }
    }

    /// The recorded routes.
    pub fn trace(&self) -> &[RouteRecord] {
        self.routing.trace()
    }

    /// Starts recording every layer's routes from now on (an empty trace).
    pub fn start_trace(&mut self) {
        self.routing.start_trace();
    }

    /// The routes recorded so far, with what replaying them needs: each expert's bytes, the
    /// staging allowance, this cache's budget and policy; `model` names the model.
    pub fn route_trace(&self, model: String) -> RouteTrace {
        RouteTrace::of(model, self.memory.cache(), self.staging, self.routing.trace())
    }

    /// The I/O lanes.
    pub fn lanes(&self) -> &Arc<IoLanes> {
        self.source.lanes()
    }

    /// The cache's counters.
    pub fn cache_counters(&self) -> CacheCounters {
        self.memory.counters()
    }

    /// The expert pool's size and use.
    pub fn slots(&self) -> super::residency::SlotUse {
        self.memory.slots()
    }

    /// The lookahead's guesses per layer against its routers' choices, as a line (`--lookahead`
    /// only, once a layer has been guessed).
    pub fn lookahead_report(&self) -> Option<String> {
        self.lookahead.as_ref().and_then(|l| super::lookahead::describe_tally(l.tally()))
    }

    /// Bytes of the lookahead's router copies (the ledger's `lookahead routers` line bounds it).
    pub fn lookahead_bytes(&self) -> u64 {
        self.lookahead.as_ref().map_or(0, Lookahead::bytes)
    }

    /// Bytes the cache holds now.
    pub fn cache_used(&self) -> u64 {
        self.memory.cache().used()
    }

    /// Changes the cache budget (applies from the next layer on); the expert pool keeps its size.
    pub fn set_cache_budget(&mut self, bytes: u64) {
        self.memory.set_budget(bytes);
    }

    /// How often each expert was routed (distinct per layer and decode), indexed
    /// `layer * n_expert + expert`; includes what [`Streamer::add_heat`] added.
    pub fn heat(&self) -> &[u64] {
        self.routing.heat()
    }

    /// Adds earlier counts (a saved heat map of the same model) to the heat map.
    pub fn add_heat(&mut self, counts: &[u64]) {
        self.routing.add_heat(counts);
    }

    /// Bytes of expert memory really in RAM now (`mincore` over every expert reservation); the
    /// cache's accounting must never be below it.
    pub fn resident_expert_bytes(&self) -> u64 {
        self.memory.resident_bytes()
    }

    /// Each expert tensor's bytes in RAM, for another thread to sample while decodes run
    /// ([`Residency::memory_probe`]).
    pub fn expert_memory_probe(&self) -> impl Fn() -> Vec<u64> + Send + 'static {
        self.memory.memory_probe()
    }

    /// Forgets what a panic in the middle of a decode may have left half-done: reads still out
    /// are waited for (bounded) and dropped, no expert stays marked resident, and every expert's
    /// memory is released, so the next decode reads what it needs afresh.
    pub fn reset_after_panic(&mut self) {
        let bound = self.overlap.as_ref().map_or(super::io::READ_BOUND, |o| o.bound);
        let _ = self.source.lanes().wait(&mut self.jobs, Some(bound));
        self.in_flight = false;
        self.jobs.clear();
        self.ahead.clear();
        self.ahead_jobs.clear();
        self.ready.clear();
        self.spare.clear();
        let _ = self.source.lanes().take_lost();
        self.loading.clear();
        self.passing.clear();
        self.failure = None;
        self.memory.clear();
    }

    /// Returns and resets the work counted since the last call.
    pub fn take_stats(&mut self) -> DecodeStats {
        self.stats.stall = self.source.take_stall();
        self.stats.kernel_nodes = self.source.take_nodes();
        std::mem::take(&mut self.stats)
    }

    /// Returns the failure of the last decode, if any; the next decode starts clean.
    pub fn take_failure(&mut self) -> Option<StreamError> {
        self.failure.take()
    }

    /// Marks the end of a decode: collects the last batch of an overlapped decode (its failure,
    /// if any, is then reported by [`Streamer::take_failure`]) and numbers the route trace.
    pub fn end_decode(&mut self) {
        if let Err(e) = self.collect(None) {
            self.failure.get_or_insert(e);
        }
        self.release_spare();
        self.decode_no += 1;
    }

    /// The eval callback: asks only for the routers of layers that stream here (another layer's
    /// router may be on an RPC worker, and asking for it would split that worker's graph for
    /// nothing), and makes each one's routed experts resident once it is computed.
    pub fn on_eval(&mut self, t: TensorView<'_>, phase: EvalPhase) -> bool {
        match phase {
            EvalPhase::Ask => t.moe_topk_layer().is_some_and(|l| self.index.layer_tensors(l).next().is_some()),
            EvalPhase::Computed => {
                if self.failure.is_some() {
                    return false;
                }
                match self.on_topk(t) {
                    Ok(()) => true,
                    Err(e) => {
                        self.failure = Some(e);
                        false
                    }
                }
            }
        }
    }

    fn on_topk(&mut self, t: TensorView<'_>) -> Result<(), StreamError> {
        let layer =
            t.moe_topk_layer().ok_or_else(|| StreamError::Graph(format!("unexpected node name {}", t.name())))?;
        self.force_and_record(t, layer)?;
        if self.index.layer_tensors(layer).next().is_none() {
            // A router whose layer streams nothing (the capture checked that no expert tensor
            // is used through it).
            self.collect(None)?;
            self.release_spare();
            return Ok(());
        }
        // Pages given back or mapped here make the kernel interrupt every CPU the process runs
        // on (TLB shootdowns): compute threads polling there for the next graph slow each one.
        if self.in_flight || !self.passing.is_empty() {
            self.rest_compute_threads();
        }
        let memory = &self.memory;
        self.stats.substituted += self.routing.read(t, layer, |e| memory.is_resident(layer, e))?;
        if let Some(lookahead) = self.lookahead.as_mut().filter(|_| t.ne()[1] == 1) {
            lookahead.score(layer, self.routing.ids());
        }
        // What was read ahead for this layer and not chosen is dropped, the rest waited for.
        self.collect(Some(layer))?;
        let tokens = t.ne()[1];
        let in_kernel = !(self.gpu && tokens >= GPU_OFFLOAD_BATCH)
            && self.index.layer_tensors(layer).all(|(k, x)| self.in_kernel[k] && kernel::computes(x.ty, tokens));
        self.plan_layer(layer, in_kernel, tokens);
        if !self.reads.is_empty() || !self.plan.evict.is_empty() {
            self.rest_compute_threads();
        }
        self.release_spare();
        let schedule = self.schedule(in_kernel, tokens);
        let release_later = self.release_while_reading(schedule, tokens);
        if !release_later {
            self.memory.release_evicted(&self.plan.evict);
        }
        if let Some(lookahead) = self.lookahead.as_mut() {
            lookahead.learn(&t, layer);
            if tokens == 1 && schedule != Schedule::Waves {
                self.read_ahead(&t, layer);
            }
        }
        if self.jobs.is_empty() && self.ahead_jobs.is_empty() {
            return Ok(());
        }
        self.submit_layer(schedule, tokens, release_later)
    }

    /// Plans `layer`'s routed experts against the cache (the evicted experts' memory is given
    /// back by the caller) and queues the reads of those to load or pass through, tensor by
    /// tensor in the graph's use order, each tensor's experts in file order: a prompt batch that
    /// routes most of a layer reads its tensors nearly end to end. Waves need every product of
    /// the layer in the kernel (`in_kernel`), each tensor used once.
    fn plan_layer(&mut self, layer: u32, in_kernel: bool, tokens: i64) {
        let staging =
            (in_kernel && self.index.layer_tensors(layer).all(|(k, _)| !self.reused[k])).then_some(self.staging);
        self.routing.record(self.decode_no, layer, tokens.try_into().unwrap_or(u32::MAX), staging.is_some());
        let ids = self.routing.ids();
        let before = self.memory.counters();
        self.memory.plan_layer(layer, ids, &mut self.plan, staging);
        let after = self.memory.counters();
        self.stats.experts_routed += ids.len() as u64;
        self.take_ready(layer);
        self.stats.hits += after.hits - before.hits;
        self.stats.misses += after.misses - before.misses;
        self.stats.evictions += after.evictions - before.evictions;
        self.reads.clear();
        self.reads.extend(self.plan.load.iter().map(|&e| (e, false)));
        self.reads.extend(self.plan.pass.iter().map(|&e| (e, true)));
        self.reads.sort_unstable();
        for &k in &self.use_order[layer as usize] {
            for &(e, pass) in &self.reads {
                self.jobs.push(self.memory.slice_read(k, e, pass));
            }
        }
        self.loading.clear();
        self.loading.extend(self.plan.load.iter().map(|&e| (layer, e)));
        self.passing.clear();
        self.passing.extend(self.plan.pass.iter().map(|&e| (layer, e)));
        self.stats.passed += self.passing.len() as u64;
    }
}
