//! `sluice replay`: a recorded route trace ([`RouteTrace`]) run again through the expert cache
//! under another policy or budget, and through Belady's MIN, the offline optimum, so a policy's
//! hit rate can be read against the best any policy could do on the same routes.
//!
//! An online policy replays through the engine's own [`ExpertCache`], step by step with the
//! staging the run had, so its counts are the live run's. MIN ([`belady`]) knows every future
//! step: after each step it keeps the experts whose next use comes soonest, as many as the
//! budget holds (an expert used furthest in the future, or never again, is the one to go, the
//! one just read included). With experts of one size this keeps the most hits possible.
//! Between the two, [`hindsight`] keeps the experts routed most often over the whole trace: the
//! ceiling of online policies when a token's routes do not depend on the tokens before it.

mod belady;
pub mod formats;
mod hindsight;
mod report;

pub use belady::belady;
pub use hindsight::hindsight;
pub use report::{csv, summary_csv, table};

use crate::stream::cache::{ExpertCache, LayerPlan};
use crate::stream::{CachePolicy, RouteTrace};

/// Which policy a replay ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replayed {
    /// An online policy, through the engine's cache.
    Online(CachePolicy),
    /// Belady's MIN, the offline optimum.
    Min,
    /// The best fixed set in hindsight.
    Hindsight,
}

impl std::fmt::Display for Replayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replayed::Online(p) => write!(f, "{p}"),
            Replayed::Min => f.write_str("belady-min"),
            Replayed::Hindsight => f.write_str("best-fixed-set"),
        }
    }
}

/// Routed experts found resident and read, by count and by bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Routed experts found resident.
    pub hits: u64,
    /// Routed experts read.
    pub misses: u64,
    /// Bytes of the hits.
    pub hit_bytes: u64,
    /// Bytes read.
    pub miss_bytes: u64,
}

impl Tally {
    /// Counts one routed expert of `bytes`.
    fn add(&mut self, hit: bool, bytes: u64) {
        if hit {
            self.hits += 1;
            self.hit_bytes += bytes;
        } else {
            self.misses += 1;
            self.miss_bytes += bytes;
        }
    }

    /// Hit bytes as a share of routed bytes (0 when nothing was routed).
    pub fn byte_hit_rate(&self) -> f64 {
        crate::units::share(self.hit_bytes, self.miss_bytes)
    }
}

/// A cache size to replay at: its budget and how it was asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSize {
    /// The budget, bytes.
    pub budget: u64,
    /// The size as asked: MiB, or a share of the experts (for reports).
    pub label: String,
}

impl CacheSize {
    /// `mib` MiB.
    pub fn mib(mib: u64) -> CacheSize {
        CacheSize { budget: mib << 20, label: mib.to_string() }
    }

    /// `budget` bytes, labelled in MiB.
    pub fn bytes(budget: u64) -> CacheSize {
        CacheSize { budget, label: format!("{:.1}", crate::units::mib(budget)) }
    }

    /// `percent` of all of `trace`'s experts' bytes, labelled `percent%`.
    pub fn share(trace: &RouteTrace, percent: f64) -> CacheSize {
        let all: u64 = trace.expert_bytes.iter().sum();
        CacheSize { budget: (all as f64 * percent / 100.0) as u64, label: format!("{percent}%") }
    }
}

/// What a replay counted.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The policy.
    pub policy: Replayed,
    /// The budget, bytes.
    pub budget: u64,
    /// The cache size as asked (for reports).
    pub cache: String,
    /// Every step (prompt batches included): what the live cache's counters count.
    pub all: Tally,
    /// Single-token decodes only: what decode speed depends on.
    pub decode: Tally,
    /// Single-token decodes per layer.
    pub per_layer: Vec<Tally>,
    /// Single-token decodes replayed.
    pub decodes: u64,
}

impl Outcome {
    fn new(policy: Replayed, budget: u64, n_layer: u32) -> Outcome {
        Outcome {
            policy,
            budget,
            cache: crate::units::mib(budget).to_string(),
            all: Tally::default(),
            decode: Tally::default(),
            per_layer: vec![Tally::default(); n_layer as usize],
            decodes: 0,
        }
    }

    /// Counts routed expert `e` of step `s` of `trace`.
    fn count(&mut self, trace: &RouteTrace, s: &crate::stream::RouteRecord, e: u32, hit: bool) {
        let bytes = trace.bytes(s.layer, e);
        self.all.add(hit, bytes);
        if s.tokens == 1 {
            self.decode.add(hit, bytes);
            self.per_layer[s.layer as usize].add(hit, bytes);
        }
    }

    /// Counts the single-token decodes among `trace`'s steps.
    fn count_decodes(&mut self, trace: &RouteTrace) {
        let mut last = None;
        for s in trace.steps.iter().filter(|s| s.tokens == 1) {
            if last != Some(s.decode) {
                self.decodes += 1;
                last = Some(s.decode);
            }
        }
    }

    /// MiB read per single-token decode.
    pub fn mib_per_decode(&self) -> f64 {
        if self.decodes == 0 {
            0.0
        } else {
            crate::units::mib(self.decode.miss_bytes) / self.decodes as f64
        }
    }
}

/// Replays `trace` through the engine's cache under `policy` with `budget` bytes.
pub fn replay(trace: &RouteTrace, policy: CachePolicy, budget: u64) -> Outcome {
    let mut cache = ExpertCache::new(policy, trace.n_layer, trace.n_expert, budget, |l, e| trace.bytes(l, e));
    let mut out = Outcome::new(Replayed::Online(policy), budget, trace.n_layer);
    let mut plan = LayerPlan::with_capacity(trace.n_expert as usize);
    for s in &trace.steps {
        let hits: Vec<bool> = s.experts.iter().map(|&e| cache.is_resident(s.layer, e)).collect();
        cache.plan_layer(s.layer, &s.experts, &mut plan, s.staged.then_some(trace.staging));
        for (&e, hit) in s.experts.iter().zip(hits) {
            out.count(trace, s, e, hit);
        }
    }
    out.count_decodes(trace);
    out
}

/// Replays `trace` under each online policy of `policies`, the best fixed set in hindsight and
/// MIN at each of `sizes`.
pub fn compare(trace: &RouteTrace, policies: &[CachePolicy], sizes: &[CacheSize]) -> Vec<Outcome> {
    sizes
        .iter()
        .flat_map(|size| {
            let b = size.budget;
            let offline = [hindsight(trace, b), belady(trace, b)];
            policies
                .iter()
                .map(move |&p| replay(trace, p, b))
                .chain(offline)
                .map(|o| Outcome { cache: size.label.clone(), ..o })
        })
        .collect()
}

#[cfg(test)]
mod tests;
