//! The expert cache policy: which (layer, expert) slices stay resident under a byte budget.
//!
//! Pure bookkeeping (no I/O, no memory): the engine asks it what to load and what to evict for a
//! layer's routed experts and carries the answer out, and `sluice replay` runs the same code over
//! a recorded trace. Every resident expert has an eviction key, the smallest evicted first, kept
//! in an ordered set, so a layer costs O(routed experts × log resident). The experts the current
//! layer needs are never evicted. When they alone exceed the budget (prefill batches can route to
//! every expert of a layer), the cache runs over it by at most a staging allowance until the next
//! layer lets it shrink back; a layer that needs more than that keeps what the budget holds and
//! lets the rest pass through (read in waves, given back once computed).

mod adaptive;
mod policy;

use std::collections::BTreeSet;

use adaptive::{Ghosts, HALF_LIVES};
pub use policy::CachePolicy;

/// Counters since the cache was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Routed experts found resident.
    pub hits: u64,
    /// Routed experts that had to be read.
    pub misses: u64,
    /// Experts evicted.
    pub evictions: u64,
    /// Misses on experts that had been resident before (read again after eviction).
    pub rereads: u64,
}

impl CacheCounters {
    /// Hits as a share of routed experts (0 when nothing was routed).
    pub fn hit_rate(&self) -> f64 {
        crate::units::share(self.hits, self.misses)
    }
}

/// How many decodes (one plan per layer each) halve a routing's weight under
/// [`CachePolicy::Frequency`]: four, chosen by replaying the bench models' traces at half-lives
/// of half a decode to 128 (docs/benchmarks.md). Where consecutive tokens share experts (the
/// skewed model) a long memory is the classic LFU fault: an expert the text has moved to cannot
/// outrank one routed twenty times some decodes ago, so it is read again at every token until
/// it has (72.4% of bytes hit at 128 decodes, 94.4% at four, LRU 94.6%, MIN 97.0%). Where they
/// do not (a random router) recency alone cycles (LRU 55.2%), and four decodes of memory keep the
/// favoured experts as well as 128 did (61.8% against 61.6%).
pub const HALF_LIFE_DECODES: u64 = 4;

/// An eviction key: the smallest goes first.
type Key = (u64, u64);

/// The half-life of [`HALF_LIVES`] that [`CachePolicy::Frequency`] ranks by.
const FREQUENCY_HALF_LIFE: usize = 2;
const _: () = assert!(HALF_LIVES[FREQUENCY_HALF_LIFE] == HALF_LIFE_DECODES as f64);

/// How resident experts are ranked for eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ranking {
    /// By the last routing.
    Recency,
    /// By the decayed frequency at half-life `HALF_LIVES[.0]`, then by the last routing.
    Decayed(usize),
}

/// Fixed-point scale of a frequency score in a key (32 fractional bits).
const SCORE_SCALE: f64 = (1u64 << 32) as f64;

/// Where admitted (warm-start) experts' keys start, counting down: below every key a routed
/// expert gets, whose recency stamps count up from here.
const STAMP_ORIGIN: u64 = 1 << 62;

#[derive(Debug, Clone, Copy)]
struct Slot {
    resident: bool,
    ever_loaded: bool,
    pinned_epoch: u64,
    /// Times routed (distinct per layer and decode), kept across evictions.
    uses: u64,
    /// At each half-life of [`HALF_LIVES`]: log2 of the sum of `2^(t / half-life)` over the
    /// plans `t` that routed it (the decayed count, scaled by the growing `2^(now / half-life)`
    /// so no stored score changes).
    score: [f64; HALF_LIVES.len()],
    /// The recency stamp of its last routing.
    routed: u64,
    key: Key,
}

impl Slot {
    /// The entry's eviction key under `ranking`.
    fn rank(&self, ranking: Ranking) -> Key {
        match ranking {
            Ranking::Recency => (self.routed, 0),
            Ranking::Decayed(h) => ((self.score[h] * SCORE_SCALE) as u64, self.routed),
        }
    }
}

/// The experts resident under a byte budget, evicted by a [`CachePolicy`].
#[derive(Debug)]
pub struct ExpertCache {
    policy: CachePolicy,
    n_expert: u32,
    bytes: Vec<u64>,
    slots: Vec<Slot>,
    /// Resident experts by key.
    order: BTreeSet<(Key, u32)>,
    /// The next recency stamp (counts up).
    stamp: u64,
    /// The next admitted expert's stamp (counts down).
    admitted: u64,
    /// Layers: plans per decode.
    plans_per_decode: u64,
    /// How the resident experts are ranked now.
    ranking: Ranking,
    /// Adaptive: the ghost caches of each half-life.
    ghosts: Option<Box<Ghosts>>,
    budget: u64,
    used: u64,
    epoch: u64,
    counters: CacheCounters,
}

/// What a layer needs done: experts to read, and experts to release.
#[derive(Debug, Default)]
pub struct LayerPlan {
    /// Experts of the layer to read into the cache (not resident).
    pub load: Vec<u32>,
    /// Experts of the layer to read and give back once the layer has computed them: they do not
    /// fit the budget and its staging allowance (see [`ExpertCache::plan_layer`]).
    pub pass: Vec<u32>,
    /// (layer, expert) pairs evicted to make room.
    pub evict: Vec<(u32, u32)>,
}

impl LayerPlan {
    /// An empty plan with room for `n` entries of each kind.
    pub fn with_capacity(n: usize) -> LayerPlan {
        LayerPlan { load: Vec::with_capacity(n), pass: Vec::with_capacity(n), evict: Vec::with_capacity(n) }
    }
}

impl ExpertCache {
    /// A cache over `n_layer × n_expert` experts with `bytes(layer, expert)` each, holding at
    /// most `budget` bytes (0: nothing stays resident beyond the layer that uses it), evicting by
    /// `policy`.
    pub fn new(
        policy: CachePolicy,
        n_layer: u32,
        n_expert: u32,
        budget: u64,
        bytes: impl Fn(u32, u32) -> u64,
    ) -> ExpertCache {
        let n = (n_layer * n_expert) as usize;
        let sizes = (0..n as u32).map(|i| bytes(i / n_expert, i % n_expert)).collect();
        let slot = Slot {
            resident: false,
            ever_loaded: false,
            pinned_epoch: 0,
            uses: 0,
            score: [0.0; HALF_LIVES.len()],
            routed: 0,
            key: (0, 0),
        };
        let ranking = match policy {
            CachePolicy::Lru => Ranking::Recency,
            CachePolicy::Frequency | CachePolicy::Adaptive => Ranking::Decayed(FREQUENCY_HALF_LIFE),
        };
        ExpertCache {
            policy,
            n_expert,
            bytes: sizes,
            slots: vec![slot; n],
            order: BTreeSet::new(),
            stamp: STAMP_ORIGIN,
            admitted: STAMP_ORIGIN,
            plans_per_decode: u64::from(n_layer.max(1)),
            ranking,
            ghosts: (policy == CachePolicy::Adaptive).then(|| Box::new(Ghosts::new(n))),
            budget,
            used: 0,
            epoch: 0,
            counters: CacheCounters::default(),
        }
    }

    /// The eviction policy.
    pub fn policy(&self) -> CachePolicy {
        self.policy
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Changes the budget; the next layer evicts down to it.
    pub fn set_budget(&mut self, budget: u64) {
        self.budget = budget;
    }

    /// Layers.
    pub fn n_layer(&self) -> u32 {
        (self.slots.len() / self.n_expert.max(1) as usize) as u32
    }

    /// Experts per layer.
    pub fn n_expert(&self) -> u32 {
        self.n_expert
    }

    /// The bytes expert `e` of `layer` takes.
    pub fn bytes(&self, layer: u32, e: u32) -> u64 {
        self.bytes[self.idx(layer, e) as usize]
    }

    /// Bytes resident now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The counters.
    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    /// Whether (layer, expert) is resident.
    pub fn is_resident(&self, layer: u32, e: u32) -> bool {
        self.slots[self.idx(layer, e) as usize].resident
    }

    fn idx(&self, layer: u32, e: u32) -> u32 {
        layer * self.n_expert + e
    }

    /// Entry `i`'s key under `ranking`.
    fn key(&self, i: u32, ranking: Ranking) -> Key {
        self.slots[i as usize].rank(ranking)
    }

    /// Entry `i` was just routed: its key as the cache ranks it now.
    fn routed_key(&mut self, i: u32) -> Key {
        self.stamp += 1;
        self.slots[i as usize].routed = self.stamp;
        self.key(i, self.ranking)
    }

    /// Counts a routing of entry `i` in this plan into its decayed frequencies.
    fn count_use(&mut self, i: u32) {
        let decodes = self.epoch as f64 / self.plans_per_decode as f64;
        let slot = &mut self.slots[i as usize];
        slot.uses += 1;
        for (score, &h) in slot.score.iter_mut().zip(&HALF_LIVES) {
            let now = decodes / h;
            *score = if slot.uses == 1 {
                now
            } else {
                // log2(2^score + 2^now), from the larger term.
                let (hi, lo) = if *score > now { (*score, now) } else { (now, *score) };
                hi + (lo - hi).exp2().ln_1p() / std::f64::consts::LN_2
            };
        }
    }

    /// Re-keys resident entry `i`.
    fn rekey(&mut self, i: u32, key: Key) {
        let slot = &mut self.slots[i as usize];
        self.order.remove(&(slot.key, i));
        slot.key = key;
        self.order.insert((key, i));
    }

    /// Counts entry `i` as resident (and as loaded once) under `key`.
    fn make_resident(&mut self, i: u32, key: Key) {
        let slot = &mut self.slots[i as usize];
        slot.resident = true;
        slot.ever_loaded = true;
        slot.key = key;
        self.used += self.bytes[i as usize];
        self.order.insert((key, i));
    }

    /// Evicts entry `i`.
    fn evict(&mut self, i: u32) {
        let slot = &mut self.slots[i as usize];
        slot.resident = false;
        self.order.remove(&(slot.key, i));
        self.used -= self.bytes[i as usize];
        self.counters.evictions += 1;
    }

    /// Plans `layer` for its distinct routed experts `ids`: hits are re-keyed, misses go into
    /// `plan.load` (and count as resident from now on), and the experts of other layers that
    /// the policy ranks lowest go into `plan.evict` until the budget holds (or only pinned
    /// experts remain).
    ///
    /// With `staging` (bytes), the layer may run over the budget by at most that much: when its
    /// misses need more, those that fit the budget are loaded (in `ids` order) and the rest go
    /// into `plan.pass`, never resident. Without it the layer keeps everything it routes.
    pub fn plan_layer(&mut self, layer: u32, ids: &[u32], plan: &mut LayerPlan, staging: Option<u64>) {
        plan.load.clear();
        plan.pass.clear();
        plan.evict.clear();
        self.epoch += 1;
        let mut incoming = 0u64;
        for &e in ids {
            let i = self.idx(layer, e);
            self.count_use(i);
            let slot = &mut self.slots[i as usize];
            slot.pinned_epoch = self.epoch;
            if slot.resident {
                self.counters.hits += 1;
                let key = self.routed_key(i);
                self.rekey(i, key);
            } else {
                self.counters.misses += 1;
                if slot.ever_loaded {
                    self.counters.rereads += 1;
                }
                incoming += self.bytes[i as usize];
                plan.load.push(e);
            }
        }
        if let Some(ghosts) = self.ghosts.as_deref_mut() {
            let entries: Vec<u32> = ids.iter().map(|&e| layer * self.n_expert + e).collect();
            let decay = (-1.0 / (adaptive::WINDOW_DECODES * self.plans_per_decode) as f64).exp2();
            let (slots, bytes, epoch) = (&self.slots, &self.bytes, self.epoch);
            ghosts.plan(
                &entries,
                self.budget,
                decay,
                |h, i| slots[i as usize].rank(Ranking::Decayed(h)),
                |i| slots[i as usize].pinned_epoch == epoch,
                |i| bytes[i as usize],
            );
        }
        if self.policy == CachePolicy::Adaptive && staging.is_some() {
            self.admit_misses(layer, plan);
        } else {
            self.evict_for(layer, incoming, plan, staging);
        }
        for &e in &plan.load {
            let i = self.idx(layer, e);
            let key = self.routed_key(i);
            self.make_resident(i, key);
        }
        self.follow_leader();
    }

    /// Evicts the lowest-ranked experts of other layers until the layer's misses (`incoming`
    /// bytes, in `plan.load`) fit; with `staging`, misses beyond the budget and its staging
    /// allowance move to `plan.pass`.
    fn evict_for(&mut self, layer: u32, incoming: u64, plan: &mut LayerPlan, staging: Option<u64>) {
        // Evict from the low end, skipping what this layer needs.
        let mut freed = 0u64;
        for &(_, i) in &self.order {
            if self.used - freed + incoming <= self.budget {
                break;
            }
            if self.slots[i as usize].pinned_epoch != self.epoch {
                freed += self.bytes[i as usize];
                plan.evict.push((i / self.n_expert, i % self.n_expert));
            }
        }
        for &(l, e) in &plan.evict {
            self.evict(self.idx(l, e));
        }
        if staging.is_some_and(|s| self.used + incoming > self.budget.saturating_add(s)) {
            let mut used = self.used;
            let (bytes, n_expert) = (&self.bytes, self.n_expert);
            let pass = &mut plan.pass;
            plan.load.retain(|&e| {
                let b = bytes[(layer * n_expert + e) as usize];
                let fits = used + b <= self.budget;
                if fits {
                    used += b;
                } else {
                    pass.push(e);
                }
                fits
            });
        }
    }

    /// Makes `(layer, e)` resident ahead of use (a warm start), ranked below every routed
    /// expert and below those admitted before it, if it is not resident and fits the budget
    /// without evicting anything. Returns whether it was admitted (the caller then reads it).
    /// Counts no hit or miss.
    pub fn admit(&mut self, layer: u32, e: u32) -> bool {
        let i = self.idx(layer, e);
        let slot = self.slots[i as usize];
        if slot.resident || self.used + self.bytes[i as usize] > self.budget {
            return false;
        }
        self.admitted -= 1;
        self.make_resident(i, (0, self.admitted));
        true
    }

    /// Forgets that `(layer, e)` was loaded (its read failed): it is no longer resident.
    pub fn mark_failed(&mut self, layer: u32, e: u32) {
        let i = self.idx(layer, e);
        let slot = &mut self.slots[i as usize];
        if slot.resident {
            slot.resident = false;
            self.order.remove(&(slot.key, i));
            self.used -= self.bytes[i as usize];
        }
    }
}

#[cfg(test)]
mod tests;
