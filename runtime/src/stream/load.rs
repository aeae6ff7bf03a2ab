//! How a model is opened for streaming: where the dense weights live, the engine's
//! configuration, and llama.cpp's load with the streamed tensors left lazy.

use std::time::Duration;

use ggml_sys::Model;

use super::index::ExpertIndex;
use super::io::LaneConfig;
use crate::generate::GenerateError;

/// Where dense (non-expert) weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DensePolicy {
    /// Read once with the lanes into anonymous memory: the kernel cannot evict them.
    Anon,
    /// llama.cpp's own file mapping: the kernel may evict and re-read them under pressure.
    Mmap,
}

/// How to stream.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Expert cache budget in bytes (0: no cache).
    pub cache_bytes: u64,
    /// Accept a budget below one token's demand.
    pub force_cache: bool,
    /// Reader configuration.
    pub lanes: LaneConfig,
    /// Dense weights policy.
    pub dense: DensePolicy,
    /// Record every layer's routes (for tests and traces).
    pub trace_routes: bool,
    /// How the expert cache evicts.
    pub cache_policy: super::CachePolicy,
    /// Bytes of the pool expert reads land in ([`ggml_sys::ExpertPool`], committed at open;
    /// the ledger's expert cache and I/O staging lines, at most every expert); `None`: reads
    /// land in fresh pages that each eviction gives back.
    pub expert_pool: Option<u64>,
    /// Layers offloaded to a GPU (the `cuda` compute service; 0 on the CPU).
    pub gpu_layers: u32,
    /// Overlap expert reads with expert compute (the kernel computes each expert once its
    /// slices have landed), each wait for one expert bounded by this long; `None` reads each
    /// layer's experts before its products run.
    pub overlap: Option<Duration>,
    /// With `overlap`: when single-token decodes overlap (prompt batches always do); the others
    /// read each layer's experts before its products run.
    pub overlap_decodes: super::DecodeOverlap,
    /// Where [`super::DecodeOverlap::WhenIdle`] reads other processes' use of the cores
    /// (measured, but for tests of the choice).
    pub cores_load: super::engine::idle::CoresLoad,
    /// Opt-in lossy modes (default: exact).
    pub lossy: crate::lossy::Lossy,
    /// The layers RPC workers hold, resident there (`--rpc`); the index then keeps only this
    /// board's layers ([`ExpertIndex::keep_layers_below`]).
    pub rpc: Option<ggml_sys::RpcSplit>,
    /// Check every expert and dense read against the model's checksum sidecar
    /// ([`crate::stream::checksums`], `storage.verify`).
    pub verify: bool,
    /// Single-token decodes guess the next layer's experts and start their reads while the
    /// layer computes ([`super::lookahead`]).
    pub lookahead: bool,
    /// Recorded routes forced on the routers (`--routes`, [`super::routes`]).
    pub force_routes: Option<super::RouteForcer>,
    /// Record every computed token's routes (`--record-routes`).
    pub record_routes: bool,
}

/// A regular expression matching the routed expert tensors of `index`: of every layer, or with
/// `only_its_layers` of the layers it holds (the others are resident on RPC workers, and a lazy
/// tensor would stay in this board's memory).
fn expert_pattern(index: &ExpertIndex, only_its_layers: bool) -> String {
    let layers = if only_its_layers {
        format!("({})", index.moe_layers().map(|l| l.to_string()).collect::<Vec<_>>().join("|"))
    } else {
        "[0-9]+".to_string()
    };
    format!(r"^blk\.{layers}\.({})\.weight$", index.expert_kinds().join("|"))
}

/// The tensors a streamed open keeps out of llama.cpp's load-time prefetch: the routed experts
/// always (the engine reads them on demand), and with dense `anon` every tensor (the engine reads
/// the dense ones itself, once, with its own reader).
pub fn lazy_pattern(index: &ExpertIndex, dense: DensePolicy) -> String {
    match dense {
        DensePolicy::Anon => ".".to_string(),
        DensePolicy::Mmap => expert_pattern(index, false),
    }
}

/// Loads `path` for streaming: like [`crate::generate::load_model`], but without reading the
/// tensors that [`lazy_pattern`] names (vendor patch 0002). With `gpu_layers > 0` (the `cuda`
/// service) that many layers are offloaded, while the expert tensors stay in CPU buffers so they
/// still stream; the dense weights are then llama.cpp's (use [`DensePolicy::Mmap`]).
pub fn load_streamed_model(
    path: &std::path::Path,
    index: &ExpertIndex,
    dense: DensePolicy,
    gpu_layers: u32,
) -> Result<Model, GenerateError> {
    crate::generate::load_model_with(path, &streamed_params(index, dense, gpu_layers, None))
}

/// What a streamed load of the model needs to know: the part of a [`StreamConfig`] decided
/// before the model is loaded (the cache size is not).
#[derive(Debug, Clone, Copy)]
pub struct ModelLoad<'a> {
    /// Where the dense weights live.
    pub dense: DensePolicy,
    /// Layers offloaded to a GPU.
    pub gpu_layers: u32,
    /// The layers RPC workers hold.
    pub rpc: Option<&'a ggml_sys::RpcSplit>,
    /// Opt-in lossy modes (`--experts-used` changes the model's own count).
    pub lossy: crate::lossy::Lossy,
}

impl StreamConfig {
    /// How this configuration loads the model.
    pub fn model_load(&self) -> ModelLoad<'_> {
        ModelLoad { dense: self.dense, gpu_layers: self.gpu_layers, rpc: self.rpc.as_ref(), lossy: self.lossy }
    }
}

/// [`load_streamed_model`] as `load` says, its lossy `--experts-used` included (checked
/// against the model).
pub fn load_configured(
    path: &std::path::Path,
    index: &ExpertIndex,
    load: &ModelLoad<'_>,
) -> Result<Model, GenerateError> {
    load.lossy.check(index.n_expert_used).map_err(GenerateError::Lossy)?;
    let params = ggml_sys::ModelParams {
        int_overrides: load.lossy.model_overrides(&index.arch),
        ..streamed_params(index, load.dense, load.gpu_layers, load.rpc)
    };
    crate::generate::load_model_with(path, &params)
}

/// The model parameters of a streamed load (see [`load_streamed_model`]). With `rpc`, the
/// workers' layers and the output layer load resident onto them: nothing of theirs is lazy (a
/// lazy tensor stays in this board's memory). With dense `anon`, everything else is lazy, as on
/// one board, and llama.cpp reads the workers' tensors with O_DIRECT, so their pages do not
/// crowd this board's memory on their way to the workers.
fn streamed_params(
    index: &ExpertIndex,
    dense: DensePolicy,
    gpu_layers: u32,
    rpc: Option<&ggml_sys::RpcSplit>,
) -> ggml_sys::ModelParams {
    let (lazy, direct_io) = match (rpc, dense) {
        (None, _) => (lazy_pattern(index, dense), false),
        (Some(_), DensePolicy::Mmap) => (expert_pattern(index, true), false),
        (Some(split), DensePolicy::Anon) => {
            let first_remote = index.n_layer.saturating_sub(split.layers.iter().sum());
            let remote: Vec<String> = (first_remote..index.n_layer).map(|l| l.to_string()).collect();
            (format!(r"^(?!blk\.({})\.|output)", remote.join("|")), true)
        }
    };
    ggml_sys::ModelParams {
        lazy_tensor_pattern: Some(lazy),
        n_gpu_layers: gpu_layers.min(i32::MAX as u32) as i32,
        cpu_tensor_pattern: (gpu_layers > 0).then(|| expert_pattern(index, false)),
        metadata_only: false,
        int_overrides: Vec::new(),
        rpc: rpc.cloned(),
        direct_io,
    }
}
