//! How a layer's reads go out: serially, overlapped with the layer's compute, or in waves; and
//! when single-token decodes overlap.

use std::time::Duration;

use super::{idle, Streamer};

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
}
