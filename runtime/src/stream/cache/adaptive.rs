//! The adaptive policy's two parts: ghost caches that tell which half-life has been hitting
//! lately, and admission, which keeps a routed expert out of the cache when it ranks below the
//! experts it would evict.
//!
//! A ghost is a cache of the same budget ranked by one half-life's decayed frequency, with the
//! same admission: resident flags and keys, no memory. Each counts its hits, decaying with a
//! half-life of [`WINDOW_DECODES`]; the real cache ranks by the half-life whose ghost leads, and
//! is re-ranked when the lead changes (checked once a decode). Short half-lives follow text
//! that moves between experts (recency), long ones keep the experts a layer favours over the
//! whole run (frequency); which one pays changes with the model, the layer's skew, the budget
//! and the text, and the ghosts measure it instead of a fixed choice.

use std::collections::BTreeSet;

use super::{ExpertCache, Key, LayerPlan, Ranking};

/// The half-lives, in decodes, the ghosts rank by: from nearly recency alone to nearly the
/// whole run's counts (chosen by replaying the public traces and the trained model's routes,
/// docs/benchmarks.md).
pub const HALF_LIVES: [f64; 6] = [0.25, 1.0, 4.0, 16.0, 64.0, 256.0];

/// The half-life, in decodes, of a ghost's hit count: the window that decides the lead.
pub const WINDOW_DECODES: u64 = 16;

/// What [`admit`] decided for a layer's misses.
#[derive(Debug, Default)]
pub(super) struct Admission {
    /// Misses that stay resident.
    pub admitted: Vec<u32>,
    /// Misses read, used and given back.
    pub passed: Vec<u32>,
    /// Residents evicted for the admitted.
    pub evicted: Vec<u32>,
}

/// Decides which of a layer's `misses` (entry, key) stay: from the best ranked down, each is
/// admitted where the budget's `room` holds it, evicting residents of `order` (lowest first,
/// skipping those `pinned`) only while they rank below it; one that would have to evict a
/// better-ranked resident passes through. `bytes` gives an entry's size.
pub(super) fn admit(
    order: &BTreeSet<(Key, u32)>,
    pinned: impl Fn(u32) -> bool,
    mut misses: Vec<(Key, u32)>,
    mut room: i128,
    bytes: impl Fn(u32) -> u64,
) -> Admission {
    misses.sort_unstable_by(|a, b| b.cmp(a));
    let mut victims = order.iter().filter(|&&(_, i)| !pinned(i)).peekable();
    let mut out = Admission::default();
    for (key, i) in misses {
        let need = i128::from(bytes(i));
        while room < need {
            match victims.next_if(|&&(k, _)| k < key) {
                Some(&(_, v)) => {
                    room += i128::from(bytes(v));
                    out.evicted.push(v);
                }
                None => break,
            }
        }
        if room >= need {
            room -= need;
            out.admitted.push(i);
        } else {
            out.passed.push(i);
        }
    }
    out
}

/// One ghost: which entries a cache ranked by one half-life would hold.
#[derive(Debug)]
struct Ghost {
    resident: Vec<Option<Key>>,
    order: BTreeSet<(Key, u32)>,
    used: u64,
    /// Hits, each decaying with a half-life of [`WINDOW_DECODES`].
    recent: f64,
}

/// The ghost caches of each half-life of [`HALF_LIVES`].
#[derive(Debug)]
pub(super) struct Ghosts {
    ghosts: Vec<Ghost>,
    leader: usize,
}

impl Ghosts {
    /// Ghosts over `n` entries, empty; the leader is the frequency policy's half-life.
    pub fn new(n: usize) -> Ghosts {
        let ghost = || Ghost { resident: vec![None; n], order: BTreeSet::new(), used: 0, recent: 0.0 };
        Ghosts { ghosts: (0..HALF_LIVES.len()).map(|_| ghost()).collect(), leader: super::FREQUENCY_HALF_LIFE }
    }

    /// The half-life (its index in [`HALF_LIVES`]) whose ghost leads.
    pub fn leader(&self) -> usize {
        self.leader
    }

    /// Replays one layer's routed `entries` on every ghost under `budget`: `key(h, i)` is entry
    /// `i`'s key at half-life `h` now, `pinned(i)` whether the layer routes it, `bytes(i)` its
    /// size; each ghost's hit count decays by `decay` first.
    pub fn plan(
        &mut self,
        entries: &[u32],
        budget: u64,
        decay: f64,
        key: impl Fn(usize, u32) -> Key,
        pinned: impl Fn(u32) -> bool + Copy,
        bytes: impl Fn(u32) -> u64 + Copy,
    ) {
        for (h, g) in self.ghosts.iter_mut().enumerate() {
            g.recent *= decay;
            let mut misses = Vec::new();
            for &i in entries {
                let k = key(h, i);
                match &mut g.resident[i as usize] {
                    Some(old) => {
                        g.recent += 1.0;
                        g.order.remove(&(*old, i));
                        g.order.insert((k, i));
                        *old = k;
                    }
                    None => misses.push((k, i)),
                }
            }
            let room = i128::from(budget) - i128::from(g.used);
            let a = admit(&g.order, pinned, misses, room, bytes);
            for v in a.evicted {
                let k = g.resident[v as usize].take().expect("a ghost evicts only its residents");
                g.order.remove(&(k, v));
                g.used -= bytes(v);
            }
            for i in a.admitted {
                let k = key(h, i);
                g.resident[i as usize] = Some(k);
                g.order.insert((k, i));
                g.used += bytes(i);
            }
        }
    }

    /// Makes the ghost that hit most lately the leader, if it hit more than the leader's;
    /// returns whether the lead changed.
    pub fn elect(&mut self) -> bool {
        let recent = |h: usize| self.ghosts[h].recent;
        let best = (0..self.ghosts.len()).max_by(|&a, &b| recent(a).total_cmp(&recent(b))).unwrap_or(self.leader);
        let changed = recent(best) > recent(self.leader);
        if changed {
            self.leader = best;
        }
        changed
    }
}

impl ExpertCache {
    /// Adaptive admission ([`admit`]): of the layer's misses in `plan.load`, those
    /// that outrank what they would evict stay; the others move to `plan.pass`.
    pub(super) fn admit_misses(&mut self, layer: u32, plan: &mut LayerPlan) {
        let misses = plan.load.iter().map(|&e| self.idx(layer, e)).map(|i| (self.key(i, self.ranking), i)).collect();
        let room = i128::from(self.budget) - i128::from(self.used);
        let (slots, bytes, epoch) = (&self.slots, &self.bytes, self.epoch);
        let a = admit(&self.order, |i| slots[i as usize].pinned_epoch == epoch, misses, room, |i| bytes[i as usize]);
        let split = |i: u32| (i / self.n_expert, i % self.n_expert);
        plan.evict.extend(a.evicted.iter().map(|&i| split(i)));
        plan.load.clear();
        plan.load.extend(a.admitted.iter().map(|&i| split(i).1));
        plan.pass.extend(a.passed.iter().map(|&i| split(i).1));
        for i in a.evicted {
            self.evict(i);
        }
    }

    /// Adaptive, once a decode: follows the ghost that has been hitting most, re-ranking the
    /// resident experts when the lead changes.
    pub(super) fn follow_leader(&mut self) {
        let Some(ghosts) = self.ghosts.as_deref_mut() else { return };
        if self.epoch % self.plans_per_decode != 0 || !ghosts.elect() {
            return;
        }
        self.ranking = Ranking::Decayed(ghosts.leader());
        let resident: Vec<u32> = self.order.iter().map(|&(_, i)| i).collect();
        for i in resident {
            self.rekey(i, self.key(i, self.ranking));
        }
    }
}
