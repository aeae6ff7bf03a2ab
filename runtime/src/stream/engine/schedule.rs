//! How a layer's reads go out: serially, overlapped with the layer's compute, or in waves; and
//! when single-token decodes overlap.

use std::time::{Duration, Instant};

use super::{idle, StreamError, Streamer};

/// Overlap settings: the bound of a batch's collection, and when single-token decodes overlap
/// (prompt batches always do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overlap {
    /// The longest a batch's collection (or a compute thread's wait for one expert) may take.
    pub bound: Duration,
    /// When single-token decodes overlap.
    pub decodes: DecodeOverlap,
}

/// When single-token decodes overlap their reads with compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeOverlap {
    /// Never: a decode reads each layer's experts, then computes the layer.
    Never,
    /// While other processes leave the run's cores idle ([`idle::IdleCores`]).
    WhenIdle,
    /// Always.
    Always,
}

/// How a layer's reads go out, chosen once per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Schedule {
    /// Read everything, then let the layer's products run.
    Serial,
    /// Hand the reads to the lanes and return: the kernel computes each expert as it lands.
    Overlapped,
    /// Beyond the cache and its staging: the reads share the staging window in the products'
    /// order, and the kernel gives each passing expert back once computed.
    Waves,
}

impl Streamer {
    /// How the planned layer's reads go out: in waves when the experts a batch passes through
    /// do not fit the staging, overlapped when the kernel computes the whole layer and overlap
    /// is on for this batch, else serially. (Passing experts that fit the staging every layer's
    /// reads have, as a single token's always do and those of a few clients' tokens decoded
    /// together mostly do, are read as loads are and given back at the next layer: waves would
    /// make their reads wait for the products a window at a time.)
    pub(super) fn schedule(&mut self, in_kernel: bool, tokens: i64) -> Schedule {
        let overlaps = |o: Overlap, idle: &mut Option<idle::IdleCores>| {
            tokens > 1
                || match o.decodes {
                    DecodeOverlap::Never => false,
                    DecodeOverlap::WhenIdle => idle.as_mut().is_some_and(idle::IdleCores::overlap),
                    DecodeOverlap::Always => true,
                }
        };
        let passing: u64 = self.passing.iter().map(|&(l, e)| self.index.expert_window_bytes(l, e)).sum();
        if tokens > 1 && passing > self.staging {
            Schedule::Waves
        } else if in_kernel && self.overlap.is_some_and(|o| overlaps(o, &mut self.idle)) {
            Schedule::Overlapped
        } else {
            Schedule::Serial
        }
    }

    /// Gives the streamer its context's compute threads: before it blocks on storage (a serial
    /// layer's reads, an overlapped batch's collection) it lets them sleep, so that their
    /// polling for the next graph (ggml's `poll`, up to 3.5 ms at the profiles' level 50) does
    /// not take the cores the lanes and the kernel's completions need. Where nothing is read
    /// they poll as before: the gaps between a decode's graph splits are short.
    pub fn set_compute_threads(&mut self, threads: Option<ggml_sys::ComputeThreads>) {
        self.compute_threads = threads;
    }

    /// Lets the compute threads sleep (see [`Streamer::set_compute_threads`]).
    pub(super) fn rest_compute_threads(&self) {
        if let Some(t) = &self.compute_threads {
            t.rest();
        }
    }

    /// Whether the evicted experts' memory may go back while the layer's reads are with the
    /// device (unmapping it, with its TLB shootdowns, was on the decode's path before the first
    /// read began): for a single token's batch of loads only (an expert read to pass through
    /// or ahead of its layer is not resident, so giving back an idle neighbour's pages could
    /// take its pages too), whose reads find free pool pages without the evicted ones.
    pub(super) fn release_while_reading(&self, schedule: Schedule, tokens: i64) -> bool {
        tokens == 1
            && schedule != Schedule::Waves
            && self.lookahead.is_none()
            && !self.jobs.is_empty()
            && self.plan.pass.is_empty()
            && self.memory.pool_holds(self.jobs.iter().map(|j| j.len as u64).sum())
    }

    /// Hands the layer's queued reads to the lanes as `schedule` says, giving back the evicted
    /// experts' memory once they are submitted when `release_later`
    /// ([`Streamer::release_while_reading`]); a serial batch is waited for and accounted here.
    pub(super) fn submit_layer(
        &mut self,
        schedule: Schedule,
        tokens: i64,
        release_later: bool,
    ) -> Result<(), StreamError> {
        let t0 = Instant::now();
        match schedule {
            Schedule::Waves => {
                self.source.lanes().submit_waves(&mut self.jobs, self.staging);
                self.in_flight = true;
            }
            Schedule::Overlapped => {
                self.stats.overlapped_layers += u64::from(tokens == 1);
                // The reads ahead go out after the layer's own, and are collected with them.
                self.jobs.append(&mut self.ahead_jobs);
                self.source.lanes().submit(&mut self.jobs);
                self.in_flight = true;
            }
            Schedule::Serial => {
                // Nothing computes before the whole batch has landed, so the lanes take it in
                // file order (the graph's use order only matters to an overlapped kernel).
                self.jobs.sort_unstable_by_key(|j| (j.shard, j.start));
                self.rest_compute_threads();
                self.source.lanes().submit(&mut self.jobs);
            }
        }
        if release_later {
            self.memory.release_evicted(&self.plan.evict);
        }
        // A batch handed to the lanes is accounted when it is collected; a serial one now.
        let landed = (schedule == Schedule::Serial).then(|| {
            let lanes = self.source.lanes();
            lanes.wait(&mut self.jobs, Some(lanes.bound()))
        });
        self.stats.io_wait += t0.elapsed();
        if let Some(result) = landed {
            self.account(result)?;
        }
        if !self.ahead_jobs.is_empty() {
            // Serial: the reads ahead go out once the layer's own have landed; they load nothing
            // into the cache.
            self.loading.clear();
            self.source.lanes().submit(&mut self.ahead_jobs);
            self.in_flight = true;
        }
        Ok(())
    }
}
