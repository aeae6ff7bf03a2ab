//! The routed experts' memory: the reservations the capture bound the expert tensors to, the
//! cache that says which experts are resident in them, the reads that make an expert resident,
//! and the rule that gives an expert's memory back, pages it shares with an idle neighbour
//! included.
//!
//! Expert slots: with `expert_pool` set, every expert tensor's reservation lands its slices in
//! one pool of pages committed now ([`ggml_sys::ExpertPool`]), as many bytes as the ledger's cache
//! and staging lines (at most every expert): a read lands in memory that is already there
//! instead of faulting in fresh pages, and an eviction unmaps pool pages instead of giving pages
//! back to the kernel. What a slice takes from the pool (the pages it owns) is never more than
//! the window the cache accounts for it, so a read finds pages free whenever the cache is within
//! its budget and staging; one that does not (a layer outside the kernel that keeps more than
//! that) lands in fresh pages as without the pool, and [`Residency::slots`] counts it.

use std::sync::Arc;

use ggml_sys::{ExpertPool, Reservation};

use super::cache::{CacheCounters, CachePolicy, ExpertCache, LayerPlan};
use super::checksums::ReadSums;
use super::index::ExpertIndex;
use super::io::{ReadJob, SliceCheck};

/// The experts' memory and what is resident in it.
pub struct Residency {
    index: Arc<ExpertIndex>,
    reservations: Vec<Arc<Reservation>>,
    cache: ExpertCache,
    /// What every read is checked against (`--verify`).
    sums: Option<Arc<ReadSums>>,
    /// The pool the expert reads land in (none without `expert_pool`).
    pool: Option<Arc<ExpertPool>>,
}

impl Drop for Residency {
    /// Gives back every expert's memory and lets go of the pool: the model keeps the
    /// reservations after the session that streamed into them ends.
    fn drop(&mut self) {
        for r in &self.reservations {
            r.leave_pool();
        }
    }
}

/// The expert pool's size and use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotUse {
    /// Bytes committed.
    pub bytes: u64,
    /// Reads that found too few free pages in the pool and landed in fresh pages.
    pub misses: u64,
}

impl Residency {
    /// Nothing resident yet in `reservations` (one per expert tensor of `index`), under a cache
    /// of `budget` bytes evicting by `policy`, its reads landing in a pool of `expert_pool` bytes
    /// (fresh pages without); reads are checked against `sums` when given.
    pub fn new(
        index: Arc<ExpertIndex>,
        reservations: Vec<Arc<Reservation>>,
        (budget, policy, expert_pool): (u64, CachePolicy, Option<u64>),
        sums: Option<Arc<ReadSums>>,
    ) -> Residency {
        let cache = empty_cache(&index, budget, policy);
        let pool = expert_pool.and_then(|room| self::expert_pool(&index, &reservations, room));
        Residency { index, reservations, cache, sums, pool }
    }

    /// The expert pool's size and use (zero without it).
    pub fn slots(&self) -> SlotUse {
        self.pool.as_ref().map_or_else(SlotUse::default, |p| SlotUse { bytes: p.bytes(), misses: p.misses() })
    }

    /// The cache.
    pub fn cache(&self) -> &ExpertCache {
        &self.cache
    }

    /// Whether expert `e` of `layer` is resident.
    pub fn is_resident(&self, layer: u32, e: u32) -> bool {
        self.cache.is_resident(layer, e)
    }

    /// The cache's counters.
    pub fn counters(&self) -> CacheCounters {
        self.cache.counters()
    }

    /// Changes the cache budget (applies from the next layer on).
    pub fn set_budget(&mut self, bytes: u64) {
        self.cache.set_budget(bytes);
    }

    /// Admits expert `e` of `layer` if it fits without evicting anything (a warm start).
    pub fn admit(&mut self, layer: u32, e: u32) -> bool {
        self.cache.admit(layer, e)
    }

    /// Plans `layer`'s routed `ids` against the cache (see [`ExpertCache::plan_layer`]). The
    /// memory of the experts it evicts (`plan.evict`) is the caller's to give back
    /// ([`Residency::release_evicted`]): before the layer's reads when they need those pages,
    /// else while the reads are with the device.
    pub fn plan_layer(&mut self, layer: u32, ids: &[u32], plan: &mut LayerPlan, staging: Option<u64>) {
        self.cache.plan_layer(layer, ids, plan, staging);
    }

    /// Whether reads of `bytes` find free pool pages now (no pool: they land in fresh pages,
    /// which is never short).
    pub fn pool_holds(&self, bytes: u64) -> bool {
        self.pool.as_ref().is_none_or(|p| p.free_bytes() >= bytes)
    }

    /// Gives back the memory of the experts a plan evicted.
    pub fn release_evicted(&self, evicted: &[(u32, u32)]) {
        for &(l, e) in evicted {
            self.release_expert(l, e);
        }
    }

    /// The read of expert `e`'s slice of expert tensor `k`, page-aligned within its reservation;
    /// with `pass`, a read the kernel gives back once it has computed the expert.
    pub fn slice_read(&self, k: usize, e: u32, pass: bool) -> ReadJob {
        let tensor = &self.index.experts[k];
        let r = &self.reservations[k];
        let (a, b) = tensor.slice(e);
        let (start, end) = r.window(a, b);
        ReadJob {
            target: Arc::clone(r),
            shard: tensor.shard,
            start,
            len: (end - start) as usize,
            tag: (tensor.layer, e),
            tensor: k,
            slice: Some((a, b)),
            pass,
            speculative: false,
            check: self.sums.as_deref().map(|s| SliceCheck { from: a, to: b, sum: s.expert(k, e) }),
        }
    }

    /// Gives back the memory of expert `e` of `layer`, which is not resident (any more). A page
    /// it shares with a neighbour goes too when that neighbour is not resident either: else such
    /// pages would stay in RAM, unaccounted, once both were evicted.
    pub fn release_expert(&self, layer: u32, e: u32) {
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

    /// Marks the experts of a batch whose read failed as not resident, and gives back their
    /// memory once all are marked (a failed neighbour's shared pages go too).
    pub fn fail(&mut self, experts: &[(u32, u32)]) {
        for &(l, e) in experts {
            self.cache.mark_failed(l, e);
        }
        for &(l, e) in experts {
            self.release_expert(l, e);
        }
    }

    /// Forgets every resident expert and gives back all their memory.
    pub fn clear(&mut self) {
        self.cache = empty_cache(&self.index, self.cache.budget(), self.cache.policy());
        for r in &self.reservations {
            r.release(0, r.size());
        }
    }

    /// Bytes of expert memory really in RAM now (`mincore` over every expert reservation); the
    /// cache's accounting must never be below it.
    pub fn resident_bytes(&self) -> u64 {
        self.reservations.iter().map(|r| r.resident_bytes()).sum()
    }

    /// Each expert tensor's bytes in RAM (`mincore`, in [`ExpertIndex::experts`] order), for
    /// another thread to sample while decodes run (it holds the reservations, not the streamer).
    /// Each tensor is one `mincore` call; the tensors are sampled one after another, so their
    /// sum is not one instant's.
    pub fn memory_probe(&self) -> impl Fn() -> Vec<u64> + Send + 'static {
        let reservations = self.reservations.clone();
        move || reservations.iter().map(|r| r.resident_bytes()).collect()
    }
}

/// The pool for `index`'s experts, bound to their `reservations`: `room` bytes, at most every
/// expert's window. None (with a warning where it fails) when there is no room or no pool can be
/// made: reads then land in fresh pages.
fn expert_pool(index: &ExpertIndex, reservations: &[Arc<Reservation>], room: u64) -> Option<Arc<ExpertPool>> {
    let bytes = room.min(index.all_expert_window_bytes());
    if bytes == 0 {
        return None;
    }
    match ExpertPool::new("experts", bytes) {
        Ok(pool) => {
            let pool = Arc::new(pool);
            for r in reservations {
                r.use_pool(Arc::clone(&pool));
            }
            Some(pool)
        }
        Err(e) => {
            log::warn!("expert slots: a pool of {} MiB could not be made ({e}); reading into fresh pages", bytes >> 20);
            None
        }
    }
}

/// An empty expert cache of `budget` bytes over `index`'s experts, each accounted by its windows,
/// evicting by `policy`.
fn empty_cache(index: &Arc<ExpertIndex>, budget: u64, policy: CachePolicy) -> ExpertCache {
    let idx = Arc::clone(index);
    ExpertCache::new(policy, index.n_layer, index.n_expert, budget, move |l, e| idx.expert_window_bytes(l, e))
}
