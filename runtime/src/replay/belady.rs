//! Belady's MIN over a route trace: the offline optimum the online policies are measured against.

use std::collections::BTreeSet;

use super::{Outcome, Replayed};
use crate::stream::RouteTrace;

/// A step number no step reaches: "never used again".
const NEVER: usize = usize::MAX;

/// Replays `trace` under Belady's MIN with `budget` bytes: after each step the experts whose
/// next use comes soonest stay, as many as fit, and the rest (those used furthest ahead or never
/// again, the ones just read included) go. Experts of other steps' layers compete for one budget,
/// as in the live cache.
pub fn belady(trace: &RouteTrace, budget: u64) -> Outcome {
    let n = (trace.n_layer * trace.n_expert) as usize;
    // next[s][j]: the step that next routes step s's j-th expert after s.
    let mut upcoming = vec![NEVER; n];
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); trace.steps.len()];
    for (s, step) in trace.steps.iter().enumerate().rev() {
        next[s] =
            step.experts.iter().map(|&e| std::mem::replace(&mut upcoming[trace.index(step.layer, e)], s)).collect();
    }
    let mut out = Outcome::new(Replayed::Min, budget, trace.n_layer);
    // Resident experts by next use; `when[i]` is expert i's entry key (None: not resident).
    let mut resident: BTreeSet<(usize, usize)> = BTreeSet::new();
    let mut when: Vec<Option<usize>> = vec![None; n];
    let mut used = 0u64;
    for (s, step) in trace.steps.iter().enumerate() {
        for (j, &e) in step.experts.iter().enumerate() {
            let i = trace.index(step.layer, e);
            out.count(trace, step, e, when[i].is_some());
            match when[i].replace(next[s][j]) {
                Some(old) => {
                    resident.remove(&(old, i));
                }
                None => used += trace.bytes(step.layer, e),
            }
            resident.insert((next[s][j], i));
        }
        while used > budget {
            let Some((_, i)) = resident.pop_last() else { break };
            when[i] = None;
            used -= trace.expert_bytes[i];
        }
    }
    out.count_decodes(trace);
    out
}
