//! The one crate of sluice that touches llama.cpp and ggml.
//!
//! `llama-cpp-sys-2` (pinned and patched through `vendor/`) builds llama.cpp and generates the raw
//! bindings; this crate wraps the part of them the runtime uses in safe types that own their
//! handles (RAII) and turn status codes into [`Error`]s. Every `unsafe` block of the workspace
//! lives here, each with a `// SAFETY:` comment.

mod backend;
mod batch;
mod chat;
mod context;
mod draft;
mod error;
pub mod ext;
mod gguf;
mod interruptible_read;
mod mapping_faults;
mod model;
mod pagecache;
mod pool;
mod quantize;
mod reservation;
mod rpc;
mod sampler;
mod services;
mod shim;
mod stdio;
mod tensor;
mod threadpool;
mod types;

pub use backend::{exit_now, init, system_info};
pub use batch::Batch;
pub use chat::{
    stop_template_work, ChatInputs, ChatParser, ChatPrompt, ChatTemplates, GrammarTrigger, ParsedMessage,
    ReasoningFormat, ToolCall, ToolChoice,
};
pub use context::{Context, ContextParams, EvalCallback, EvalPhase, MemorySizes, MAX_SEQUENCES};
pub use draft::NgramDraft;
pub use error::Error;
pub use gguf::{GgufFile, GgufTensor};
pub use mapping_faults::name_mapped_model;
pub use model::{Model, ModelParams, RpcSplit, Token};
pub use pagecache::cached_bytes;
pub use pool::{ExpertPool, SlotWrite};
pub use quantize::{quantize, QuantType};
pub use reservation::{page_size, Reservation};
pub use rpc::{
    serve as rpc_serve, set_client_options as rpc_client_options, ConnectHook, RpcDevice,
    ServeOptions as RpcServeOptions, MAX_RPC_SERVERS,
};
pub use sampler::{GrammarKind, Sampler, SamplerParams};
pub use services::{backends, extension_services, supports_gpu_offload, ServiceLookup, EXTENSION_SERVICES};
pub use stdio::stdout_was_closed;
pub use tensor::{TensorView, WeightTensor};
pub use threadpool::{ComputeThreads, SchedPriority, Threads};
pub use types::GgmlType;

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
