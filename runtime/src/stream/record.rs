//! A streamed decode's record: the streaming work the engine counted ([`DecodeStats`]), and
//! what one `llama_decode` cost in time, reads, routing, cache and memory ([`TokenRow`]).

use std::time::Duration;

use sluice_hal::usage::Usage;

use super::CacheCounters;
use crate::generate::DecodeEvent;

/// Streaming work done since the last [`super::Streamer::take_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeStats {
    /// Time spent waiting for expert reads at the top-k node (serial), or submitting and
    /// collecting them (overlap).
    pub io_wait: Duration,
    /// Time compute threads spent blocked in the kernel waiting for an expert's slices,
    /// averaged over the threads (overlap).
    pub stall: Duration,
    /// Routed products (`MUL_MAT_ID` nodes) the extension kernel computed.
    pub kernel_nodes: u64,
    /// Expert bytes read.
    pub bytes_read: u64,
    /// Of which through `O_DIRECT`.
    pub direct_bytes: u64,
    /// Distinct routed experts, summed over layers.
    pub experts_routed: u64,
    /// Cache hits among them.
    pub hits: u64,
    /// Cache misses among them.
    pub misses: u64,
    /// Experts evicted.
    pub evictions: u64,
    /// Chosen experts replaced by a cached one (lossy `--substitute`).
    pub substituted: u64,
    /// Routed experts read in waves and given back once computed (not kept by the cache).
    pub passed: u64,
    /// Experts read ahead of their layer on the lookahead's guess (`--lookahead`).
    pub lookahead_reads: u64,
    /// Of which the layer's router then chose.
    pub lookahead_used: u64,
    /// Single-token decodes' layers whose reads overlapped compute.
    pub overlapped_layers: u64,
}

/// One decode's telemetry.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenRow {
    /// Decode number.
    pub index: usize,
    /// Whether it was a prompt batch.
    pub prefill: bool,
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// Generations the batch carried tokens of.
    pub runs: usize,
    /// Wall time.
    pub wall: Duration,
    /// Time waiting for expert reads (serial), or submitting and collecting them (overlap).
    pub io_wait: Duration,
    /// Overlap: time compute threads were blocked waiting for an expert, averaged over them.
    pub stall: Duration,
    /// Routed products the streamed-experts kernel computed.
    pub kernel_nodes: u64,
    /// Expert bytes read.
    pub bytes_read: u64,
    /// Distinct routed experts summed over layers.
    pub experts_routed: u64,
    /// Cache hits.
    pub hits: u64,
    /// Cache misses.
    pub misses: u64,
    /// Chosen experts replaced by cached ones (lossy `--substitute`).
    pub substituted: u64,
    /// Routed experts read in waves and given back once computed (a prompt batch beyond the
    /// cache and its staging).
    pub passed: u64,
    /// Experts read ahead on the lookahead's guess.
    pub lookahead_reads: u64,
    /// Of which the router then chose.
    pub lookahead_used: u64,
    /// Layers of a single-token decode whose reads overlapped compute.
    pub overlapped_layers: u64,
    /// Cumulative hit rate.
    pub hit_rate: f64,
    /// Major faults during the decode.
    pub major_faults: u64,
    /// RSS (anonymous) after the decode.
    pub rss_anon: u64,
    /// RSS (file-backed) after the decode.
    pub rss_file: u64,
    /// RSS (shared: the expert pool where it is mapped) after the decode.
    pub rss_shmem: u64,
}

impl TokenRow {
    /// Builds a row from a decode's event, its streaming stats, and usage before and after.
    pub fn new(
        index: usize,
        event: DecodeEvent,
        stats: DecodeStats,
        before: &Usage,
        after: &Usage,
        cache: CacheCounters,
    ) -> TokenRow {
        TokenRow {
            index,
            prefill: event.prefill,
            n_tokens: event.n_tokens,
            runs: event.runs,
            wall: event.wall,
            io_wait: stats.io_wait,
            stall: stats.stall,
            kernel_nodes: stats.kernel_nodes,
            bytes_read: stats.bytes_read,
            experts_routed: stats.experts_routed,
            hits: stats.hits,
            misses: stats.misses,
            substituted: stats.substituted,
            passed: stats.passed,
            lookahead_reads: stats.lookahead_reads,
            lookahead_used: stats.lookahead_used,
            overlapped_layers: stats.overlapped_layers,
            hit_rate: cache.hit_rate(),
            major_faults: after.major_faults.saturating_sub(before.major_faults),
            rss_anon: after.rss_anon,
            rss_file: after.rss_file,
            rss_shmem: after.rss_shmem,
        }
    }

    /// The resident size after the decode: anonymous, file-backed and shared memory.
    pub fn rss(&self) -> u64 {
        self.rss_anon + self.rss_file + self.rss_shmem
    }

    /// Compute time: wall minus I/O wait and stall.
    pub fn compute(&self) -> Duration {
        self.wall.saturating_sub(self.io_wait + self.stall)
    }
}

/// What a warm start read ahead of the first request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefill {
    /// Experts made resident.
    pub experts: u64,
    /// Bytes read.
    pub bytes: u64,
}
