//! The warm start: the experts a saved heat map ranks highest read into the cache before the
//! first request, without evicting anything.

use super::super::record::{DecodeStats, Prefill};
use super::super::StreamError;
use super::Streamer;

impl Streamer {
    /// Reads the experts of `order` (`(layer, expert)`, most wanted first) into the cache while
    /// they fit its budget, without evicting anything: a warm start. A failed read leaves the
    /// experts of its batch not resident and is returned.
    pub fn prefill(&mut self, order: &[(u32, u32)]) -> Result<Prefill, StreamError> {
        const BATCH: usize = 32;
        let mut done = Prefill::default();
        for chunk in order.chunks(BATCH) {
            self.loading.clear();
            for &(layer, e) in chunk {
                if layer >= self.index.n_layer || e >= self.index.n_expert || !self.memory.admit(layer, e) {
                    continue;
                }
                self.loading.push((layer, e));
                for (k, _) in self.index.layer_tensors(layer) {
                    self.jobs.push(self.memory.slice_read(k, e, false));
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
}
