//! The expert cache policy: which (layer, expert) slices stay resident under a byte budget.
//!
//! Pure bookkeeping (no I/O, no memory): the engine asks it what to load and what to evict for a
//! layer's routed experts and carries the answer out. Least-recently-used eviction over an
//! intrusive list of slots, so a layer costs O(routed experts) with no allocation. The experts
//! the current layer needs are never evicted. When they alone exceed the budget (prefill batches
//! can route to every expert of a layer), the cache runs over it by at most a staging allowance
//! until the next layer lets it shrink back; a layer that needs more than that keeps what the
//! budget holds and lets the rest pass through (read in waves, given back once computed).

const NIL: u32 = u32::MAX;

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
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    resident: bool,
    ever_loaded: bool,
    pinned_epoch: u64,
    prev: u32,
    next: u32,
}

/// LRU over (layer, expert) under a byte budget.
#[derive(Debug)]
pub struct ExpertCache {
    n_expert: u32,
    bytes: Vec<u64>,
    slots: Vec<Slot>,
    head: u32, // most recently used
    tail: u32, // least recently used
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
    /// most `budget` bytes (0: nothing stays resident beyond the layer that uses it).
    pub fn new(n_layer: u32, n_expert: u32, budget: u64, bytes: impl Fn(u32, u32) -> u64) -> ExpertCache {
        let n = (n_layer * n_expert) as usize;
        let sizes = (0..n as u32).map(|i| bytes(i / n_expert, i % n_expert)).collect();
        let slot = Slot { resident: false, ever_loaded: false, pinned_epoch: 0, prev: NIL, next: NIL };
        ExpertCache {
            n_expert,
            bytes: sizes,
            slots: vec![slot; n],
            head: NIL,
            tail: NIL,
            budget,
            used: 0,
            epoch: 0,
            counters: CacheCounters::default(),
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Changes the budget; the next layer evicts down to it.
    pub fn set_budget(&mut self, budget: u64) {
        self.budget = budget;
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

    fn unlink(&mut self, i: u32) {
        let Slot { prev, next, .. } = self.slots[i as usize];
        if prev != NIL {
            self.slots[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        self.slots[i as usize].prev = NIL;
        self.slots[i as usize].next = NIL;
    }

    fn push_front(&mut self, i: u32) {
        self.slots[i as usize].prev = NIL;
        self.slots[i as usize].next = self.head;
        if self.head != NIL {
            self.slots[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn push_back(&mut self, i: u32) {
        self.slots[i as usize].next = NIL;
        self.slots[i as usize].prev = self.tail;
        if self.tail != NIL {
            self.slots[self.tail as usize].next = i;
        }
        self.tail = i;
        if self.head == NIL {
            self.head = i;
        }
    }

    /// Counts entry `i` as resident (and as loaded once); the caller links it into the LRU list.
    fn make_resident(&mut self, i: u32) {
        self.slots[i as usize].resident = true;
        self.slots[i as usize].ever_loaded = true;
        self.used += self.bytes[i as usize];
    }

    /// Plans `layer` for its distinct routed experts `ids`: hits are refreshed, misses go into
    /// `plan.load` (and count as resident from now on), and least-recently-used experts of other
    /// layers go into `plan.evict` until the budget holds (or only pinned experts remain).
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
            self.slots[i as usize].pinned_epoch = self.epoch;
            if self.slots[i as usize].resident {
                self.counters.hits += 1;
                self.unlink(i);
                self.push_front(i);
            } else {
                self.counters.misses += 1;
                if self.slots[i as usize].ever_loaded {
                    self.counters.rereads += 1;
                }
                incoming += self.bytes[i as usize];
                plan.load.push(e);
            }
        }
        // Evict from the cold end, skipping what this layer needs.
        let mut cursor = self.tail;
        while self.used + incoming > self.budget && cursor != NIL {
            let prev = self.slots[cursor as usize].prev;
            if self.slots[cursor as usize].pinned_epoch != self.epoch {
                self.unlink(cursor);
                self.slots[cursor as usize].resident = false;
                self.used -= self.bytes[cursor as usize];
                self.counters.evictions += 1;
                plan.evict.push((cursor / self.n_expert, cursor % self.n_expert));
            }
            cursor = prev;
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
        for &e in &plan.load {
            let i = self.idx(layer, e);
            self.make_resident(i);
            self.push_front(i);
        }
    }

    /// Makes `(layer, e)` resident ahead of use (a warm start), as the coldest entry, if it is
    /// not resident and fits the budget without evicting anything. Returns whether it was
    /// admitted (the caller then reads it). Counts no hit or miss.
    pub fn admit(&mut self, layer: u32, e: u32) -> bool {
        let i = self.idx(layer, e);
        let slot = self.slots[i as usize];
        if slot.resident || self.used + self.bytes[i as usize] > self.budget {
            return false;
        }
        self.make_resident(i);
        self.push_back(i);
        true
    }

    /// Forgets that `(layer, e)` was loaded (its read failed): it is no longer resident.
    pub fn mark_failed(&mut self, layer: u32, e: u32) {
        let i = self.idx(layer, e);
        if self.slots[i as usize].resident {
            self.unlink(i);
            self.slots[i as usize].resident = false;
            self.used -= self.bytes[i as usize];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(c: &mut ExpertCache, layer: u32, ids: &[u32]) -> LayerPlan {
        let mut p = LayerPlan::with_capacity(8);
        c.plan_layer(layer, ids, &mut p, None);
        p
    }

    #[test]
    fn unbounded_cache_reads_each_expert_once() {
        let mut c = ExpertCache::new(2, 4, u64::MAX, |_, _| 10);
        assert_eq!(plan(&mut c, 0, &[1, 2]).load, vec![1, 2]);
        assert_eq!(plan(&mut c, 1, &[0]).load, vec![0]);
        assert!(plan(&mut c, 0, &[2, 1]).load.is_empty());
        assert_eq!(c.counters(), CacheCounters { hits: 2, misses: 3, evictions: 0, rereads: 0 });
        assert_eq!(c.used(), 30);
    }

    #[test]
    fn zero_budget_keeps_only_the_current_layer() {
        let mut c = ExpertCache::new(2, 4, 0, |_, _| 10);
        plan(&mut c, 0, &[1, 2]);
        let p = plan(&mut c, 1, &[1]);
        assert_eq!(p.load, vec![1]);
        assert_eq!(p.evict.len(), 2);
        assert!(p.evict.contains(&(0, 1)) && p.evict.contains(&(0, 2)));
        let p = plan(&mut c, 0, &[1]);
        assert_eq!(p.load, vec![1], "with no cache every routed expert is read every time");
        assert_eq!(c.counters().rereads, 1);
        assert_eq!(c.used(), 10);
    }

    #[test]
    fn lru_evicts_the_coldest_and_never_the_current_layer() {
        let mut c = ExpertCache::new(2, 4, 30, |_, _| 10);
        plan(&mut c, 0, &[0, 1, 2]);
        plan(&mut c, 0, &[0]); // 0 is now the most recent; 1 is the coldest
        let p = plan(&mut c, 1, &[3]);
        assert_eq!(p.evict, vec![(0, 1)]);
        // A layer needing more than the budget keeps all it needs.
        let p = plan(&mut c, 1, &[0, 1, 2, 3]);
        assert_eq!(p.load, vec![0, 1, 2]);
        assert!(p.evict.iter().all(|&(l, _)| l == 0));
        assert!(c.used() >= 40);
        assert!((0..4).all(|e| c.is_resident(1, e)));
    }

    #[test]
    fn a_layer_beyond_budget_and_staging_passes_the_rest_through() {
        let mut c = ExpertCache::new(2, 8, 30, |_, _| 10);
        plan(&mut c, 0, &[0]);
        let mut p = LayerPlan::with_capacity(8);
        // Within the budget plus 20 of staging: everything stays, as without a bound.
        c.plan_layer(1, &[0, 1, 2, 3, 4], &mut p, Some(20));
        assert_eq!((p.load.len(), p.pass.len()), (5, 0));
        assert_eq!(c.used(), 50);
        // Seven misses need 70 beyond the budget's 30: three are kept, four pass through.
        c.plan_layer(0, &[7, 6, 5, 4, 3, 2, 1], &mut p, Some(20));
        assert_eq!(p.load, vec![7, 6, 5]);
        assert_eq!(p.pass, vec![4, 3, 2, 1]);
        assert_eq!(p.evict.len(), 5, "the other layer's experts went first");
        assert_eq!(c.used(), 30);
        assert!(!c.is_resident(0, 4) && c.is_resident(0, 5));
        assert_eq!(c.counters().misses, 13, "passed experts count as misses");
        // Hits stay resident even when they alone exceed the budget.
        c.set_budget(10);
        c.plan_layer(0, &[5, 6, 7, 0], &mut p, Some(0));
        assert_eq!((p.load.len(), p.pass, c.used()), (0, vec![0], 30));
    }

    #[test]
    fn admitted_experts_fit_the_budget_and_are_evicted_hottest_last() {
        let mut c = ExpertCache::new(2, 4, 30, |_, _| 10);
        assert!(c.admit(0, 1));
        assert!(c.admit(1, 2));
        assert!(!c.admit(1, 2), "already resident");
        assert!(c.admit(0, 3));
        assert!(!c.admit(1, 0), "over the budget: admitting never evicts");
        assert_eq!(c.used(), 30);
        assert_eq!(c.counters(), CacheCounters::default());
        // A hit on an admitted expert; a miss then evicts the coldest: the last admitted.
        assert!(plan(&mut c, 0, &[1]).load.is_empty());
        let p = plan(&mut c, 1, &[0]);
        assert_eq!(p.evict, vec![(0, 3)]);
    }

    #[test]
    fn shrinking_the_budget_evicts_on_the_next_layer() {
        let mut c = ExpertCache::new(2, 4, 100, |_, _| 10);
        plan(&mut c, 0, &[0, 1, 2, 3]);
        c.set_budget(20);
        let p = plan(&mut c, 1, &[0]);
        assert_eq!(p.evict.len(), 3);
        assert_eq!(c.used(), 20);
    }
}
