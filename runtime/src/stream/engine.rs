//! The streaming engine's state, driven from llama.cpp's eval callback.
//!
//! Capture (one warm-up decode): every graph node's sources are scanned for the model's weight
//! tensors; nothing is isolated. Each use of an expert tensor is checked to be a routed product
//! over its own layer's top-k node, the only use streaming can serve. The first time an expert
//! tensor is seen, before any node that uses it computes, it is rebound into an empty
//! page-congruent anonymous reservation, so the warm-up never faults expert bytes in from the
//! file mapping; with dense `anon`, each resident
//! weight is likewise read once by the lanes into its own reservation and rebound. (Asks run
//! ahead of compute within a split, and the CPU backend computes synchronously.)
//!
//! Stream (every later decode): the callback asks for `ffn_moe_topk-<il>` only. When it has been
//! computed, the layer's routed expert ids are read (stride-aware: the node is a view of the
//! whole argsort), deduplicated, planned against the cache, evicted experts' pages released, and
//! the missing slices read by the I/O lanes straight into place before the callback returns and
//! the layer's expert matmuls run. Serial reads go out in file order (a prompt batch that routes
//! most of a layer reads its tensors nearly end to end); overlapped ones tensor by tensor in the
//! order the graph uses the tensors (recorded at capture), so the first product's slices land
//! first, each tensor's experts in file order.
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

use std::sync::Arc;
use std::time::{Duration, Instant};

use ggml_sys::{EvalPhase, Model, Reservation, TensorView, WeightTensor};

use super::cache::{CacheCounters, ExpertCache, LayerPlan};
use super::index::ExpertIndex;
use super::io::{IoLanes, ReadJob, ReadStats, SliceCheck};
use super::kernel::{self, ExpertSource};
use super::StreamError;
use crate::stream::checksums::ReadSums;

/// The smallest batch ggml's scheduler may move from the CPU to a GPU (its `op_offload` of
/// products over weights in host memory): such a batch's products may not run in the kernel.
const GPU_OFFLOAD_BATCH: i64 = 32;

/// What the callback is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Observe the graph and record weight tensors.
    Capture,
    /// Make routed experts resident at each layer's top-k node.
    Stream,
}

/// Streaming work done since the last [`Streamer::take_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeStats {
    /// Time spent waiting for expert reads at the top-k node (serial), or submitting and
    /// collecting them (overlap).
    pub io_wait: Duration,
    /// Time compute threads spent blocked in the kernel waiting for an expert's slices,
    /// averaged over the threads (overlap).
    pub stall: Duration,
    /// Routed products (`MUL_MAT_ID` nodes) the extension kernel computed.
    pub kernel_nodes: u64,
    /// Expert bytes read.
    pub bytes_read: u64,
    /// Of which through `O_DIRECT`.
    pub direct_bytes: u64,
    /// Distinct routed experts, summed over layers.
    pub experts_routed: u64,
    /// Cache hits among them.
    pub hits: u64,
    /// Cache misses among them.
    pub misses: u64,
    /// Experts evicted.
    pub evictions: u64,
    /// Chosen experts replaced by a cached one (lossy `--substitute`).
    pub substituted: u64,
    /// Routed experts read in waves and given back once computed (not kept by the cache).
    pub passed: u64,
}

/// One layer's distinct routed experts in one decode (recorded when tracing is on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRecord {
    /// Decode number (0 = the first decode after capture).
    pub decode: u64,
    /// Layer.
    pub layer: u32,
    /// Distinct expert ids, in the order first routed.
    pub experts: Vec<u32>,
}

/// Overlap settings: the bound of a batch's collection, and whether only prompt batches
/// overlap.
struct Overlap {
    bound: Duration,
    prompt_only: bool,
}

/// An empty expert cache of `budget` bytes over `index`'s experts, each accounted by its windows.
fn empty_cache(index: &Arc<ExpertIndex>, budget: u64) -> ExpertCache {
    let idx = Arc::clone(index);
    ExpertCache::new(index.n_layer, index.n_expert, budget, move |l, e| idx.expert_window_bytes(l, e))
}

/// The read of expert `e`'s slice of expert tensor `k`, page-aligned within its reservation;
/// with `pass`, a read the kernel gives back once it has computed the expert.
fn slice_read(
    index: &ExpertIndex,
    reservations: &[Arc<Reservation>],
    sums: Option<&ReadSums>,
    k: usize,
    e: u32,
    pass: bool,
) -> ReadJob {
    let tensor = &index.experts[k];
    let r = &reservations[k];
    let (a, b) = tensor.slice(e);
    let (start, end) = r.window(a, b);
    ReadJob {
        target: Arc::clone(r),
        shard: tensor.shard,
        start,
        len: (end - start) as usize,
        tag: (tensor.layer, e),
        tensor: k,
        pass: pass.then_some((a, b)),
        check: sums.map(|s| SliceCheck { from: a, to: b, sum: s.expert(k, e) }),
    }
}

/// The state shared between the eval callback and the session.
pub struct Streamer<'m> {
    model: &'m Model,
    index: Arc<ExpertIndex>,
    mode: Mode,
    dense_anon: bool,
    pending: Vec<Option<Arc<Reservation>>>,
    captured_dense: Vec<bool>,
    dense_bytes_read: u64,
    reservations: Vec<Arc<Reservation>>,
    source: Arc<ExpertSource>,
    /// What every read is checked against (`--verify`).
    sums: Option<Arc<ReadSums>>,
    /// Each layer's expert tensors in the order the graph uses them (from the capture).
    use_order: Vec<Vec<usize>>,
    /// Layers offloaded to a GPU (their prompt batches may run there, outside the kernel).
    gpu: bool,
    /// Which expert tensors the kernel computes (the others run in ggml's own kernel).
    in_kernel: Vec<bool>,
    /// Which expert tensors the graph uses more than once (their experts never pass through:
    /// a second product would read what the first gave back).
    reused: Vec<bool>,
    overlap: Option<Overlap>,
    /// Whether a batch is out with the lanes (overlap or waves), collected at the next layer.
    in_flight: bool,
    /// How far a layer may run over the cache's budget; the window its passing reads share.
    staging: u64,
    cache: ExpertCache,
    plan: LayerPlan,
    /// The layer's reads in file order, each with whether it passes through.
    reads: Vec<(u32, bool)>,
    /// The (layer, expert) pairs of the batch being read into the cache.
    loading: Vec<(u32, u32)>,
    /// The (layer, expert) pairs of the batch passing through.
    passing: Vec<(u32, u32)>,
    jobs: Vec<ReadJob>,
    /// The layer's distinct routed experts, filled on the eval callback's path: fixed capacity,
    /// so routing allocates nothing there.
    ids: heapless::Vec<u32, { crate::metadata::MAX_EXPERTS as usize }>,
    seen: Vec<bool>,
    stats: DecodeStats,
    failure: Option<StreamError>,
    trace: Option<Vec<RouteRecord>>,
    decode_no: u64,
    /// Times each (layer, expert) was routed, `layer * n_expert + expert`.
    heat: Vec<u64>,
    /// Lossy: the router ranks after a token's chosen experts a cached substitute may come from.
    substitute: Option<u32>,
    /// One token's router ranking (the argsort row), for substitution.
    ranking: Vec<i32>,
}

/// What a warm start read ahead of the first request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefill {
    /// Experts made resident.
    pub experts: u64,
    /// Bytes read.
    pub bytes: u64,
}

impl<'m> Streamer<'m> {
    /// A streamer in capture mode, reading with `source`'s lanes; `gpu` when layers are
    /// offloaded to a GPU.
    pub fn new(
        model: &'m Model,
        index: Arc<ExpertIndex>,
        source: Arc<ExpertSource>,
        cache_budget: u64,
        dense_anon: bool,
        gpu: bool,
    ) -> Self {
        let cache = empty_cache(&index, cache_budget);
        let n_expert = index.n_expert as usize;
        Streamer {
            model,
            pending: vec![None; index.experts.len()],
            captured_dense: vec![false; index.dense.len()],
            dense_bytes_read: 0,
            reservations: Vec::new(),
            source,
            sums: None,
            use_order: vec![Vec::new(); index.n_layer as usize],
            gpu,
            in_kernel: vec![false; index.experts.len()],
            reused: vec![false; index.experts.len()],
            overlap: None,
            in_flight: false,
            staging: index.layer_token_demand(),
            cache,
            plan: LayerPlan::with_capacity(n_expert * index.n_layer as usize),
            reads: Vec::with_capacity(n_expert),
            loading: Vec::with_capacity(n_expert),
            passing: Vec::with_capacity(n_expert),
            jobs: Vec::with_capacity(n_expert * 4),
            ids: heapless::Vec::new(),
            seen: vec![false; n_expert],
            stats: DecodeStats::default(),
            failure: None,
            trace: None,
            decode_no: 0,
            heat: vec![0; n_expert * index.n_layer as usize],
            substitute: None,
            ranking: Vec::with_capacity(n_expert),
            mode: Mode::Capture,
            dense_anon,
            index,
        }
    }

    /// Checks every read from now on against `sums` (`--verify`): a read whose bytes differ
    /// fails naming its expert or tensor.
    pub fn set_sums(&mut self, sums: Arc<ReadSums>) {
        self.sums = Some(sums);
    }

    /// Records which expert tensors the kernel computes: only layers whose tensors it all
    /// computes are overlapped.
    pub fn set_kernel_tensors(&mut self, taken: &[bool]) {
        self.in_kernel = taken.to_vec();
    }

    /// Streams with overlap from now on: reads are submitted at the top-k node and waited for,
    /// expert by expert, by the kernel. `bound` limits each collection of a batch. With
    /// `prompt_only`, batches of one token are read serially.
    pub fn enable_overlap(&mut self, bound: Duration, prompt_only: bool) {
        self.overlap = Some(Overlap { bound, prompt_only });
    }

    /// Lossy: from now on, a single token's chosen expert that the cache misses is replaced by
    /// a cached expert the router ranked within `window` places after the chosen ones
    /// ([`crate::lossy`]); `None` turns it off.
    pub fn set_substitute(&mut self, window: Option<u32>) {
        self.substitute = window;
    }

    /// Records every layer's routed experts from now on.
    pub fn enable_trace(&mut self) {
        self.trace = Some(Vec::new());
    }

    /// The recorded routes.
    pub fn trace(&self) -> &[RouteRecord] {
        self.trace.as_deref().unwrap_or(&[])
    }

    /// The I/O lanes.
    pub fn lanes(&self) -> &Arc<IoLanes> {
        self.source.lanes()
    }

    /// The cache's counters.
    pub fn cache_counters(&self) -> CacheCounters {
        self.cache.counters()
    }

    /// Bytes the cache holds now.
    pub fn cache_used(&self) -> u64 {
        self.cache.used()
    }

    /// Changes the cache budget (applies from the next layer on).
    pub fn set_cache_budget(&mut self, bytes: u64) {
        self.cache.set_budget(bytes);
    }

    /// How often each expert was routed (distinct per layer and decode), indexed
    /// `layer * n_expert + expert`; includes what [`Streamer::add_heat`] added.
    pub fn heat(&self) -> &[u64] {
        &self.heat
    }

    /// Adds earlier counts (a saved heat map of the same model) to the heat map.
    pub fn add_heat(&mut self, counts: &[u64]) {
        for (h, c) in self.heat.iter_mut().zip(counts) {
            *h = h.saturating_add(*c);
        }
    }

    /// Reads the experts of `order` (`(layer, expert)`, most wanted first) into the cache while
    /// they fit its budget, without evicting anything: a warm start. A failed read leaves the
    /// experts of its batch not resident and is returned.
    pub fn prefill(&mut self, order: &[(u32, u32)]) -> Result<Prefill, StreamError> {
        const BATCH: usize = 32;
        let mut done = Prefill::default();
        for chunk in order.chunks(BATCH) {
            self.loading.clear();
            for &(layer, e) in chunk {
                if layer >= self.index.n_layer || e >= self.index.n_expert || !self.cache.admit(layer, e) {
                    continue;
                }
                self.loading.push((layer, e));
                for (k, _) in self.index.layer_tensors(layer) {
                    self.jobs.push(slice_read(&self.index, &self.reservations, self.sums.as_deref(), k, e, false));
                }
            }
            if self.jobs.is_empty() {
                continue;
            }
            let result = self.source.lanes().read_all(&mut self.jobs);
            let bytes = result.as_ref().map_or(0, |s| s.bytes);
            self.account(result)?;
            done.experts += self.loading.len() as u64;
            done.bytes += bytes;
        }
        // The warm start is not the first request's work.
        self.stats = DecodeStats::default();
        Ok(done)
    }

    /// Gives back the memory of expert `e` of `layer`, which is not resident (any more). A page
    /// it shares with a neighbour goes too when that neighbour is not resident either: else such
    /// pages would stay in RAM, unaccounted, once both were evicted.
    fn release_expert(&self, layer: u32, e: u32) {
        let idle = |n: u32| n < self.index.n_expert && !self.cache.is_resident(layer, n);
        for (k, tensor) in self.index.layer_tensors(layer) {
            let (mut from, mut to) = tensor.slice(e);
            if e > 0 && idle(e - 1) {
                from = tensor.slice(e - 1).0;
            }
            if idle(e + 1) {
                to = tensor.slice(e + 1).1;
            }
            self.reservations[k].release(from, to);
        }
    }

    /// Bytes of expert memory really in RAM now (`mincore` over every expert reservation); the
    /// cache's accounting must never be below it.
    pub fn resident_expert_bytes(&self) -> u64 {
        self.reservations.iter().map(|r| r.resident_bytes()).sum()
    }

    /// Each expert tensor's bytes in RAM (`mincore`, in [`ExpertIndex::experts`] order), for
    /// another thread to sample while decodes run (it holds the reservations, not the streamer).
    /// Each tensor is one `mincore` call; the tensors are sampled one after another, so their
    /// sum is not one instant's.
    pub fn expert_memory_probe(&self) -> impl Fn() -> Vec<u64> + Send + 'static {
        let reservations = self.reservations.clone();
        move || reservations.iter().map(|r| r.resident_bytes()).collect()
    }

    /// Forgets what a panic in the middle of a decode may have left half-done: reads still out
    /// are waited for (bounded) and dropped, no expert stays marked resident, and every expert's
    /// memory is released, so the next decode reads what it needs afresh.
    pub fn reset_after_panic(&mut self) {
        let bound = self.overlap.as_ref().map_or(super::io::READ_BOUND, |o| o.bound);
        let _ = self.source.lanes().wait(&mut self.jobs, Some(bound));
        self.in_flight = false;
        self.jobs.clear();
        self.loading.clear();
        self.passing.clear();
        self.failure = None;
        self.cache = empty_cache(&self.index, self.cache.budget());
        for r in &self.reservations {
            r.release(0, r.size());
        }
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
        if let Err(e) = self.collect() {
            self.failure.get_or_insert(e);
        }
        if self.mode == Mode::Stream {
            self.decode_no += 1;
        }
    }

    /// Waits for the batch out with the lanes (overlap or waves) and accounts it; what passed
    /// through is given back, pages shared with idle neighbours included.
    fn collect(&mut self) -> Result<(), StreamError> {
        if !std::mem::take(&mut self.in_flight) {
            self.release_stale();
            return Ok(());
        }
        let bound = self.overlap.as_ref().map_or_else(|| self.source.lanes().bound(), |o| o.bound);
        let t0 = Instant::now();
        let result = self.source.lanes().wait(&mut self.jobs, Some(bound));
        self.stats.io_wait += t0.elapsed();
        for &(l, e) in &self.passing {
            self.release_expert(l, e);
        }
        self.passing.clear();
        self.release_stale();
        self.account(result)
    }

    /// Gives back the pages that reads of abandoned batches (a bound passed, a cancel) wrote
    /// after the engine had released them, for each such expert not resident again. Call it
    /// with no batch out with the lanes: the engine does between batches, the server while idle.
    pub fn release_stale(&mut self) {
        if self.mode != Mode::Stream {
            return;
        }
        for (l, e) in self.source.lanes().take_stale() {
            if !self.cache.is_resident(l, e) {
                self.release_expert(l, e);
            }
        }
    }

    /// Adds a finished batch's bytes to the stats; a failure marks the experts it was loading as
    /// not resident.
    fn account(&mut self, result: Result<ReadStats, super::io::ReadFailure>) -> Result<(), StreamError> {
        match result {
            Ok(ReadStats { bytes, direct_bytes }) => {
                self.stats.bytes_read += bytes;
                self.stats.direct_bytes += direct_bytes;
                Ok(())
            }
            Err(f) => {
                for &(l, e) in &self.loading {
                    self.cache.mark_failed(l, e);
                }
                // Released once all are marked: a failed neighbour's shared pages go too.
                for &(l, e) in &self.loading {
                    self.release_expert(l, e);
                }
                Err(StreamError::Read(f))
            }
        }
    }

    /// The eval callback.
    pub fn on_eval(&mut self, t: TensorView<'_>, phase: EvalPhase) -> bool {
        match (self.mode, phase) {
            (Mode::Capture, EvalPhase::Ask) => {
                if self.failure.is_none() {
                    if let Err(e) = self.capture_sources(t) {
                        self.failure = Some(e);
                    }
                }
                // A failure stops the warm-up right after this node (its Computed answer), before
                // any later node computes over what failed.
                self.failure.is_some()
            }
            (Mode::Capture, EvalPhase::Computed) => self.failure.is_none(),
            // Only the routers of layers that stream here: another layer's router may be on an
            // RPC worker, and asking for it would split that worker's graph for nothing.
            (Mode::Stream, EvalPhase::Ask) => t
                .name()
                .strip_prefix("ffn_moe_topk-")
                .and_then(|l| l.parse::<u32>().ok())
                .is_some_and(|l| self.index.layer_tensors(l).next().is_some()),
            (Mode::Stream, EvalPhase::Computed) => {
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

    fn capture_sources(&mut self, t: TensorView<'_>) -> Result<(), StreamError> {
        for i in 0..10 {
            let Some(src) = t.src(i) else { continue };
            let name = src.name();
            if let Some(k) = self.index.expert_by_name(name) {
                self.check_routed_use(t, i, k)?;
                let layer = self.index.experts[k].layer as usize;
                if self.use_order[layer].contains(&k) {
                    self.reused[k] = true;
                } else {
                    self.use_order[layer].push(k);
                }
                if self.pending[k].is_none() {
                    if let Some(w) = src.as_weight(self.model) {
                        self.pending[k] = Some(self.rebind_expert(k, w)?);
                    }
                }
            } else if self.dense_anon {
                if let Some(k) = self.index.dense_by_name(name) {
                    if !self.captured_dense[k] {
                        if let Some(w) = src.as_weight(self.model) {
                            self.read_dense(k, w)?;
                            self.captured_dense[k] = true;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks that `node` uses expert tensor `k` (as its source `slot`) the one way streaming
    /// can serve: as the weights of a routed product (`MUL_MAT_ID`) whose expert ids are the
    /// top-k node of the tensor's own layer, computed before it. Any other use would read expert
    /// slices the router did not ask for, which are not resident.
    fn check_routed_use(&self, node: TensorView<'_>, slot: usize, k: usize) -> Result<(), StreamError> {
        let tensor = &self.index.experts[k];
        let router = format!("ffn_moe_topk-{}", tensor.layer);
        let routed = slot == 0 && node.op_name() == "MUL_MAT_ID" && node.src(2).is_some_and(|ids| ids.name() == router);
        if routed {
            return Ok(());
        }
        Err(StreamError::Unrouted {
            tensor: tensor.name.clone(),
            node: node.name().to_string(),
            op: node.op_name().to_string(),
            router,
            arch: self.index.arch.clone(),
        })
    }

    /// Checks the graph's expert tensor `k` against the file and rebinds it into an empty
    /// reservation.
    fn rebind_expert(&self, k: usize, w: WeightTensor<'m>) -> Result<Arc<Reservation>, StreamError> {
        let t = &self.index.experts[k];
        let view = w.view();
        if view.n_bytes() as u64 != t.size || view.nb()[2] as u64 != t.stride {
            return Err(StreamError::LayoutMismatch {
                tensor: t.name.clone(),
                detail: format!(
                    "graph has {} bytes, stride {}; file has {} bytes, stride {}",
                    view.n_bytes(),
                    view.nb()[2],
                    t.size,
                    t.stride
                ),
            });
        }
        let r = Arc::new(Reservation::new(t.offset, t.size).map_err(StreamError::Reserve)?);
        w.rebind(Arc::clone(&r)).map_err(|e| StreamError::Graph(e.to_string()))?;
        Ok(r)
    }

    /// Reads dense tensor `k` once into anonymous memory through the lanes and rebinds it.
    fn read_dense(&mut self, k: usize, w: WeightTensor<'m>) -> Result<(), StreamError> {
        let d = &self.index.dense[k];
        let r = Arc::new(Reservation::new(d.offset, d.size).map_err(StreamError::Reserve)?);
        let (start, end) = r.window(0, d.size);
        self.jobs.push(ReadJob {
            target: Arc::clone(&r),
            shard: d.shard,
            start,
            len: (end - start) as usize,
            tag: (u32::MAX, k as u32),
            tensor: usize::MAX,
            pass: None,
            check: self.sums.as_ref().map(|s| SliceCheck { from: 0, to: d.size, sum: s.dense(k) }),
        });
        // The tensor leaves llama.cpp's file mapping before the read: if the read fails, the node
        // that asked computes over zeros (and the warm-up stops after it), never over a mapping
        // whose pages fault on the failing file.
        w.rebind(Arc::clone(&r)).map_err(|e| StreamError::Graph(e.to_string()))?;
        let stats = self.source.lanes().read_all(&mut self.jobs).map_err(|mut f| {
            f.what = format!("tensor {}", d.name);
            f
        })?;
        self.dense_bytes_read += stats.bytes;
        Ok(())
    }

    /// Ends capture: checks that every expert tensor was found and rebound, and switches to
    /// streaming. Returns the dense bytes read (dense `anon`).
    pub fn finish_capture(&mut self) -> Result<u64, StreamError> {
        if let Some(e) = self.failure.take() {
            return Err(e);
        }
        if let Some(k) = self.pending.iter().position(Option::is_none) {
            return Err(StreamError::NotCaptured {
                tensor: self.index.experts[k].name.clone(),
                arch: self.index.arch.clone(),
            });
        }
        self.reservations = self.pending.drain(..).flatten().collect();
        // The warm-up computed over the empty reservations, which maps the zero page where it
        // read: unmap it, so that what is in RAM is only what the cache and the staging hold.
        for r in &self.reservations {
            r.release(0, r.size());
        }
        self.mode = Mode::Stream;
        Ok(self.dense_bytes_read)
    }

    fn on_topk(&mut self, t: TensorView<'_>) -> Result<(), StreamError> {
        let layer: u32 = t
            .name()
            .strip_prefix("ffn_moe_topk-")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| StreamError::Graph(format!("unexpected node name {}", t.name())))?;
        self.collect()?;
        if self.index.layer_tensors(layer).next().is_none() {
            // A router whose layer streams nothing (the capture checked that no expert tensor
            // is used through it).
            return Ok(());
        }
        if let Some(window) = self.substitute.filter(|_| t.ne()[1] == 1) {
            self.substitute_cached(t, layer, window)?;
        }
        self.read_routed_ids(t, layer)?;
        if let Some(trace) = self.trace.as_mut() {
            trace.push(RouteRecord { decode: self.decode_no, layer, experts: self.ids.to_vec() });
        }
        let row = (layer * self.index.n_expert) as usize;
        for &e in &self.ids {
            self.heat[row + e as usize] += 1;
        }
        let tokens = t.ne()[1];
        let in_kernel = !(self.gpu && tokens >= GPU_OFFLOAD_BATCH)
            && self.index.layer_tensors(layer).all(|(k, x)| self.in_kernel[k] && kernel::computes(x.ty, tokens));
        // Waves need every product of the layer in the kernel, each tensor used once.
        let staging =
            (in_kernel && self.index.layer_tensors(layer).all(|(k, _)| !self.reused[k])).then_some(self.staging);
        let before = self.cache.counters();
        self.cache.plan_layer(layer, &self.ids, &mut self.plan, staging);
        let after = self.cache.counters();
        self.stats.experts_routed += self.ids.len() as u64;
        self.stats.hits += after.hits - before.hits;
        self.stats.misses += after.misses - before.misses;
        self.stats.evictions += after.evictions - before.evictions;
        for &(l, e) in &self.plan.evict {
            self.release_expert(l, e);
        }
        // Each tensor's experts in file order: a prompt batch that routes most of a layer reads
        // its tensors nearly end to end.
        self.reads.clear();
        self.reads.extend(self.plan.load.iter().map(|&e| (e, false)));
        self.reads.extend(self.plan.pass.iter().map(|&e| (e, true)));
        self.reads.sort_unstable();
        for &k in &self.use_order[layer as usize] {
            for &(e, pass) in &self.reads {
                self.jobs.push(slice_read(&self.index, &self.reservations, self.sums.as_deref(), k, e, pass));
            }
        }
        if self.jobs.is_empty() {
            return Ok(());
        }
        self.loading.clear();
        self.loading.extend(self.plan.load.iter().map(|&e| (layer, e)));
        self.passing.clear();
        self.passing.extend(self.plan.pass.iter().map(|&e| (layer, e)));
        self.stats.passed += self.passing.len() as u64;
        let t0 = Instant::now();
        if !self.passing.is_empty() {
            // Waves, in the products' order: the kernel gives each passing expert back.
            self.source.lanes().submit_waves(&mut self.jobs, self.staging);
            self.in_flight = true;
            self.stats.io_wait += t0.elapsed();
            return Ok(());
        }
        if self.overlap.as_ref().is_some_and(|o| in_kernel && (tokens > 1 || !o.prompt_only)) {
            self.source.lanes().submit(&mut self.jobs);
            self.in_flight = true;
            self.stats.io_wait += t0.elapsed();
            return Ok(());
        }
        // Serial: nothing computes before the whole batch has landed, so the lanes take it in
        // file order (the graph's use order only matters to an overlapped kernel).
        self.jobs.sort_unstable_by_key(|j| (j.shard, j.start));
        let result = self.source.lanes().read_all(&mut self.jobs);
        self.stats.io_wait += t0.elapsed();
        self.account(result)
    }

    /// Lossy substitution for one token: each chosen expert of `layer` the cache misses (the
    /// lowest-ranked first) is swapped, in the router's ranking, with the best-ranked cached
    /// expert among the `window` ranked right after the chosen ones. The ranking is the argsort
    /// the top-k node `topk` views, rewritten in place before the layer's products (and the
    /// routing weights) read it.
    fn substitute_cached(&mut self, topk: TensorView<'_>, layer: u32, window: u32) -> Result<(), StreamError> {
        let graph = |what: &str| StreamError::Graph(format!("{}: {what}", topk.name()));
        let sorted = topk.src(0).filter(|s| s.op_name() == "ARGSORT").ok_or_else(|| {
            graph("--substitute needs the router's full ranking, and this node is not a view of an argsort")
        })?;
        let k = topk.ne()[0] as usize;
        let n = (sorted.ne()[0] as usize).min(self.index.n_expert as usize);
        let reach = n.min(k + window as usize);
        if !sorted.has_host_bytes() {
            return Err(graph("the ranking is not in host memory"));
        }
        self.ranking.clear();
        for r in 0..reach {
            self.ranking.push(sorted.i32_at(r, 0).ok_or_else(|| graph("the ranking is shorter than its shape"))?);
        }
        let cached = |cache: &ExpertCache, id: i32| {
            u32::try_from(id).is_ok_and(|e| e < self.index.n_expert && cache.is_resident(layer, e))
        };
        let mut next = k;
        let mut changed = false;
        for chosen in (0..k.min(reach)).rev() {
            if cached(&self.cache, self.ranking[chosen]) {
                continue;
            }
            while next < reach && !cached(&self.cache, self.ranking[next]) {
                next += 1;
            }
            if next == reach {
                break;
            }
            self.ranking.swap(chosen, next);
            next += 1;
            changed = true;
            self.stats.substituted += 1;
        }
        if changed {
            let nb0 = sorted.nb()[0];
            for (r, id) in self.ranking.iter().enumerate() {
                if !sorted.write_host_bytes(r * nb0, &id.to_ne_bytes()) {
                    return Err(graph("the ranking could not be rewritten"));
                }
            }
        }
        Ok(())
    }

    /// Fills `self.ids` with the distinct expert ids of the top-k view `t` (`ne = [k, n_tokens]`,
    /// rows `nb[1]` apart: it is a view of the whole argsort).
    fn read_routed_ids(&mut self, t: TensorView<'_>, layer: u32) -> Result<(), StreamError> {
        if !t.has_host_bytes() {
            return Err(StreamError::Graph(format!("{} is not in host memory", t.name())));
        }
        let [k, n_tokens, ..] = t.ne();
        self.ids.clear();
        self.seen.fill(false);
        for tok in 0..n_tokens as usize {
            for j in 0..k as usize {
                let id = t
                    .i32_at(j, tok)
                    .ok_or_else(|| StreamError::Graph(format!("{} is shorter than its shape", t.name())))?;
                let e = u32::try_from(id)
                    .ok()
                    .filter(|&e| e < self.index.n_expert)
                    .ok_or(StreamError::BadExpertId { layer, id, n_expert: self.index.n_expert })?;
                if !self.seen[e as usize] {
                    self.seen[e as usize] = true;
                    // Distinct ids below n_expert, which the metadata check bounds by the capacity.
                    self.ids.push(e).map_err(|_| StreamError::BadExpertId {
                        layer,
                        id,
                        n_expert: self.index.n_expert,
                    })?;
                }
            }
        }
        Ok(())
    }
}
