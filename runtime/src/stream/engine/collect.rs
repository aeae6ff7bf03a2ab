//! Collecting the batch out with the lanes: what passed through given back, the reads ahead
//! sorted into those their layer chose and the rest, and the batch's bytes or failure
//! accounted.

use std::time::Instant;

use super::super::io::{ReadFailure, ReadStats};
use super::super::StreamError;
use super::Streamer;

impl Streamer {
    /// Waits for the batch out with the lanes (overlap or waves) and accounts it; what passed
    /// through is given back, pages shared with idle neighbours included.
    ///
    /// Reads ahead for another layer than `keep`, or of experts its router did not choose, are
    /// dropped first; those that did not land whole are not resident afterwards.
    pub(super) fn collect(&mut self, keep: Option<u32>) -> Result<(), StreamError> {
        if !std::mem::take(&mut self.in_flight) {
            self.release_passing();
            self.release_stale();
            return Ok(());
        }
        let ids = self.routing.ids();
        let wanted = |(l, e): (u32, u32)| Some(l) == keep && ids.contains(&e);
        if !self.ahead.is_empty() {
            self.source.lanes().drop_speculative(wanted);
        }
        let bound = self.overlap.as_ref().map_or_else(|| self.source.lanes().bound(), |o| o.bound);
        let t0 = Instant::now();
        let result = self.source.lanes().wait(&mut self.jobs, Some(bound));
        self.stats.io_wait += t0.elapsed();
        let lost = self.source.lanes().take_lost();
        for (l, e) in self.ahead.drain(..) {
            if result.is_ok() && wanted((l, e)) && !lost.contains(&(l, e)) {
                self.ready.push(e);
            } else {
                self.spare.push((l, e));
            }
        }
        self.release_passing();
        self.release_stale();
        self.account(result)
    }

    /// Gives back the experts the last layer read to use once (it has computed them).
    fn release_passing(&mut self) {
        for (l, e) in self.passing.drain(..) {
            self.memory.release_expert(l, e);
        }
    }

    /// Gives back the pages that reads of abandoned batches (a bound passed, a cancel) wrote
    /// after the engine had released them, for each such expert not resident again. Call it
    /// with no batch out with the lanes: the engine does between batches, the server while idle.
    pub fn release_stale(&mut self) {
        for (l, e) in self.source.lanes().take_stale() {
            if !self.memory.is_resident(l, e) {
                self.memory.release_expert(l, e);
            }
        }
    }

    /// Adds a finished batch's bytes to the stats; a failure marks the experts it was loading as
    /// not resident.
    pub(super) fn account(&mut self, result: Result<ReadStats, ReadFailure>) -> Result<(), StreamError> {
        match result {
            Ok(ReadStats { bytes, direct_bytes }) => {
                self.stats.bytes_read += bytes;
                self.stats.direct_bytes += direct_bytes;
                Ok(())
            }
            Err(f) => {
                self.memory.fail(&self.loading);
                Err(StreamError::Read(f))
            }
        }
    }
}
