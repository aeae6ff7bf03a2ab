//! The best fixed set of experts in hindsight: what a cache that never changes its mind could
//! have hit, knowing how often the whole trace routes each expert.
//!
//! When each token's routes are drawn independently of the tokens before it (the independent
//! reference model), keeping the most probable experts is the best any online policy can do on
//! average, so this is the ceiling of the online policies there, where Belady's MIN also knows
//! which expert comes next. Routing with reuse from token to token lets a policy that follows
//! recency beat it.

use super::{Outcome, Replayed};
use crate::stream::RouteTrace;

/// Replays `trace` with a fixed set chosen in hindsight: the experts the single-token decodes
/// route most often (ties: more routes in every step, then the lower layer and expert), added
/// while they fit in `budget` bytes. A member is read on its first use and hits after; an expert
/// outside the set is read at every use.
pub fn hindsight(trace: &RouteTrace, budget: u64) -> Outcome {
    let n = (trace.n_layer * trace.n_expert) as usize;
    let mut routed = vec![(0u64, 0u64); n];
    for s in &trace.steps {
        for &e in &s.experts {
            let r = &mut routed[trace.index(s.layer, e)];
            r.0 += u64::from(s.tokens == 1);
            r.1 += 1;
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(routed[i]), i));
    let mut member = vec![false; n];
    let mut used = 0u64;
    for i in order.into_iter().filter(|&i| routed[i].0 > 0) {
        if used + trace.expert_bytes[i] <= budget {
            used += trace.expert_bytes[i];
            member[i] = true;
        }
    }
    let mut out = Outcome::new(Replayed::Hindsight, budget, trace.n_layer);
    let mut seen = vec![false; n];
    for s in &trace.steps {
        for &e in &s.experts {
            let i = trace.index(s.layer, e);
            out.count(trace, s, e, member[i] && seen[i]);
            seen[i] = true;
        }
    }
    out.count_decodes(trace);
    out
}
