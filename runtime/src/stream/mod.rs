//! Streaming: routed experts read from storage on demand, byte-identical to resident.
//!
//! [`ExpertIndex`] finds the experts in the file(s); [`StreamedSession`] loads the model,
//! captures its weight tensors in a warm-up decode, rebinds the experts into page-congruent
//! anonymous memory, and from then on makes each layer's routed experts resident when the
//! router has picked them (see [`engine`]), through the [`io`] lanes and under the
//! [`cache`]'s byte budget.

pub mod cache;
pub mod capture;
pub mod checksums;
pub mod engine;
pub mod index;
pub mod io;
pub mod kernel;
pub mod load;
pub mod lookahead;
pub mod record;
pub mod residency;
pub mod resident;
pub mod routes;
pub mod routing;
pub mod session;
pub mod trace;

use crate::generate::GenerateError;
pub use cache::{CacheCounters, CachePolicy};
pub use engine::idle::CoresLoad;
pub use engine::{DecodeOverlap, Streamer};
pub use index::{ExpertIndex, IndexError};
pub use io::{FaultKind, IoLanes, LaneConfig, ReadFailure, ReadFault, SliceCheck, READ_BOUND};
pub use load::{lazy_pattern, load_configured, load_streamed_model, DensePolicy, ModelLoad, StreamConfig};
pub use record::{DecodeStats, TokenRow};
pub use residency::SlotUse;
pub use routes::{force::RouteForcer, RoutesEnd, RoutesError, TokenRoutes};
pub use routing::RouteRecord;
pub use session::{check_cache_budget, StreamedSession};
pub use trace::{RouteTrace, TraceError};

/// Errors of the streaming engine.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The model cannot be indexed for streaming.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// An expert tensor never appeared in the warm-up graph.
    #[error("expert tensor {tensor} is not used by llama.cpp's graph for '{arch}', so sluice cannot tell when it is needed; run the model with --resident")]
    NotCaptured {
        /// The tensor.
        tensor: String,
        /// The architecture.
        arch: String,
    },
    /// An expert tensor is used other than by its layer's routed matrix product.
    #[error("expert tensor {tensor} is used by graph node {node} ({op}), not by a routed product over {router}: llama.cpp builds '{arch}' in a way sluice cannot stream; run the model with --resident")]
    Unrouted {
        /// The tensor.
        tensor: String,
        /// The node that uses it.
        node: String,
        /// The node's operation.
        op: String,
        /// The router node the use should take its expert ids from.
        router: String,
        /// The architecture.
        arch: String,
    },
    /// The graph's tensor does not match the file's.
    #[error("expert tensor {tensor}: {detail}")]
    LayoutMismatch {
        /// The tensor.
        tensor: String,
        /// How they differ.
        detail: String,
    },
    /// Address space could not be reserved.
    #[error("cannot reserve memory for an expert tensor: {0}")]
    Reserve(std::io::Error),
    /// A read failed.
    #[error(transparent)]
    Read(#[from] ReadFailure),
    /// `--verify`: the checksums could not be loaded, or the model's headers do not match them.
    #[error(transparent)]
    Sums(#[from] crate::stream::checksums::SumsError),
    /// The lanes could not be started.
    #[error("cannot start the I/O lanes: {0}")]
    Lanes(std::io::Error),
    /// The routed-product kernel could not be registered.
    #[error("cannot register the streamed experts' kernel with ggml: {0}")]
    Kernel(String),
    /// The graph did not look as expected.
    #[error("unexpected graph: {0}")]
    Graph(String),
    /// The router produced an impossible expert id.
    #[error("layer {layer} routed to expert id {id}, outside 0..{n_expert}")]
    BadExpertId {
        /// Layer.
        layer: u32,
        /// The id.
        id: i32,
        /// Experts in the layer.
        n_expert: u32,
    },
    /// A run without `--routes-end wrap` needed more tokens than its recorded routes have.
    #[error("the recorded routes ended after their {tokens} tokens; give --routes-end wrap to start them again")]
    RoutesEnded {
        /// Tokens in the routes.
        tokens: u64,
    },
    /// The cache budget is below one token's demand.
    #[error("expert cache of {budget_mib:.1} MiB is below one token's routed demand of {min_mib:.1} MiB ({layers} MoE layers x their {k} largest experts); give at least --cache-mb {min_mb}, --cache-mb 0 for no cache, or --force-cache to accept a cache that cannot hold a token")]
    CacheTooSmall {
        /// Requested budget in MiB.
        budget_mib: f64,
        /// Minimum in MiB.
        min_mib: f64,
        /// The minimum rounded up to whole MiB.
        min_mb: u64,
        /// MoE layers.
        layers: usize,
        /// Experts per token (the most over the layers).
        k: u32,
    },
    /// Loading, tokenizing or decoding failed, or the generation was cancelled.
    #[error(transparent)]
    Generate(#[from] GenerateError),
}

impl From<ggml_sys::Error> for StreamError {
    fn from(e: ggml_sys::Error) -> Self {
        StreamError::Generate(e.into())
    }
}

impl StreamError {
    /// The RPC worker whose loss ended the run, if that is what ended it.
    pub fn lost_worker(&self) -> Option<&str> {
        match self {
            StreamError::Generate(e) => e.lost_worker(),
            _ => None,
        }
    }

    /// Whether the run was cancelled (its abort flag set, or a read it waited for given up for
    /// it) rather than failed.
    pub fn is_cancelled(&self) -> bool {
        match self {
            StreamError::Generate(e) => matches!(e, GenerateError::Cancelled),
            StreamError::Read(f) => f.cause.kind() == std::io::ErrorKind::Interrupted,
            _ => false,
        }
    }
}
