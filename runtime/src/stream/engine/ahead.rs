//! The engine's reads ahead (`--lookahead`): at a single-token decode's top-k node, the next
//! layer's experts guessed by [`super::super::lookahead::Lookahead`] are read while this layer
//! computes, outside the cache; at the next layer's node those its router did not choose are
//! dropped ([`super::super::io::IoLanes::drop_speculative`]), the chosen ones that landed whole
//! are planned as loads without a second read, and the memory of the rest is given back.

use ggml_sys::TensorView;

use super::super::io::ReadJob;
use super::Streamer;

impl Streamer {
    /// Guesses the next layer's experts from this layer's router input under its top-k node
    /// `t` (a single-token decode) and queues the reads of those not resident in `ahead_jobs`,
    /// in the order the graph uses the tensors. They land outside the cache, which decides
    /// nothing differently, within the ledger's I/O staging (one token's experts of a layer):
    /// the best-ranked first, so a spare guess is read only where the staging has room left.
    pub(super) fn read_ahead(&mut self, t: &TensorView<'_>, layer: u32) {
        let next = layer + 1;
        let Streamer {
            lookahead: Some(lookahead),
            memory,
            index,
            ahead,
            ahead_jobs,
            use_order,
            stats,
            passing,
            staging,
            ..
        } = self
        else {
            return;
        };
        // A layer whose experts pass through holds them in the I/O staging until the next layer
        // begins: the reads ahead would need the same memory.
        if index.layer_tensors(next).next().is_none() || !passing.is_empty() {
            return;
        }
        let worth = lookahead.worth_reading(next);
        // The guesses best first, as far as the staging holds them (a spare guess may not fit).
        let mut room = *staging;
        for &e in lookahead.guess(t, next, t.ne()[0] as usize).iter().take_while(|_| worth) {
            if memory.is_resident(next, e) {
                continue;
            }
            let Some(left) = room.checked_sub(index.expert_window_bytes(next, e)) else { break };
            room = left;
            ahead.push((next, e));
            for &k in &use_order[next as usize] {
                ahead_jobs.push(ReadJob { speculative: true, ..memory.slice_read(k, e, false) });
            }
        }
        stats.lookahead_reads += ahead.len() as u64;
    }

    /// Takes the experts of `layer` read ahead whole out of the planned loads: resident from
    /// now on like any load, without a second read. One passing through is read again: until
    /// it is resident, the release of a neighbour (evicted, or a wrong guess) may take the pages
    /// they share. One not planned at all is spare.
    pub(super) fn take_ready(&mut self, layer: u32) {
        for e in self.ready.drain(..) {
            if let Some(i) = self.plan.load.iter().position(|&x| x == e) {
                self.plan.load.remove(i);
                self.stats.lookahead_used += 1;
            } else if !self.plan.pass.contains(&e) {
                self.spare.push((layer, e));
            }
        }
    }

    /// Gives back the memory of the experts read ahead that their router did not choose (or
    /// whose read did not land whole): none is resident.
    pub(super) fn release_spare(&mut self) {
        for (l, e) in self.spare.drain(..) {
            self.memory.release_expert(l, e);
        }
    }
}
