//! Errors of the llama.cpp wrappers.

use std::path::PathBuf;

/// What can go wrong when calling into llama.cpp or ggml.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A path could not be passed to C (it holds a NUL byte).
    #[error("path {0} contains a NUL byte")]
    PathNul(PathBuf),
    /// A string could not be passed to C (it holds a NUL byte).
    #[error("text contains a NUL byte at position {0}")]
    TextNul(usize),
    /// A metadata override's key cannot be passed to llama.cpp.
    #[error("metadata override key {0:?} is longer than 127 bytes or holds a NUL byte")]
    MetadataOverride(String),
    /// gguf could not parse the file.
    #[error(
        "{path}: not a readable GGUF file (ggml rejected its header or metadata; is it truncated or another format?)"
    )]
    GgufParse {
        /// The file.
        path: PathBuf,
    },
    /// Reading the file's header failed: the storage, not the format.
    #[error("{path}: reading its header failed at byte {offset}: {source} (the storage failed, not the file's format: check the disk, `dmesg`, or copy the model elsewhere)")]
    GgufRead {
        /// The file.
        path: PathBuf,
        /// The first byte whose read failed.
        offset: u64,
        /// The read's error.
        source: std::io::Error,
    },
    /// A tensor's data runs past the end of the file.
    #[error("{path}: truncated: tensor {tensor} ends at byte {end} but the file has {file_size} bytes (re-copy or re-download it)")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The first tensor that does not fit.
        tensor: String,
        /// Where its data ends.
        end: u64,
        /// The file size.
        file_size: u64,
    },
    /// llama.cpp refused to load the model.
    #[error("{path}: llama.cpp could not load the model (its reason is in the log above)")]
    ModelLoad {
        /// The file.
        path: PathBuf,
    },
    /// The vocabulary lacks a token llama.cpp's tokenizer adds (it would assert at the first
    /// tokenize).
    #[error("{path}: {message}; the file is malformed (re-download or re-convert it)")]
    Vocabulary {
        /// The file.
        path: PathBuf,
        /// What is missing.
        message: String,
    },
    /// No ggml RPC server answered at an endpoint.
    #[error("cannot use the RPC worker at {endpoint}: {reason}; is `sluice worker --listen {endpoint}` running there, and does its firewall let this board in?")]
    RpcConnect {
        /// The `host:port`.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// An RPC worker and this head did not admit each other: a missing or different key.
    #[error("the RPC worker at {endpoint} and this head refused each other: {reason}")]
    RpcRefused {
        /// The `host:port`.
        endpoint: String,
        /// Why (the key handshake's failure).
        reason: String,
    },
    /// The connection to an RPC worker was lost (it stopped, crashed or the link went down).
    #[error("lost the RPC worker at {endpoint}: it stopped answering (stopped, crashed, or the link went down); its layers are gone until it is back and the model is loaded again")]
    RpcLost {
        /// The `host:port`.
        endpoint: String,
    },
    /// An RPC split whose worker list and layer counts differ in length.
    #[error("an RPC split needs one layer count per worker, and at least one worker: {devices} worker(s), {counts} count(s)")]
    RpcSplit {
        /// Workers given.
        devices: usize,
        /// Layer counts given.
        counts: usize,
    },
    /// The RPC server could not start.
    #[error("cannot serve RPC at {endpoint}: the address is not this board's IPv4 address, or the port is taken (the reason is in the log above)")]
    RpcServe {
        /// The `ip:port`.
        endpoint: String,
    },
    /// llama.cpp could not create a context.
    #[error("llama.cpp could not create a context with n_ctx={n_ctx}, n_batch={n_batch} (out of memory, or sizes the model does not allow)")]
    ContextCreate {
        /// Requested context size.
        n_ctx: u32,
        /// Requested batch size.
        n_batch: u32,
    },
    /// llama.cpp could not create a context with these KV cache types.
    #[error("llama.cpp could not create a context with n_ctx={n_ctx}, n_batch={n_batch} and a KV cache of K type {k} and V type {v} (its log says why: out of memory, or a head size the type's blocks do not divide, or a model whose K and V must share one type); give --cache-type-k and --cache-type-v f16 or q8_0 if the types are the cause")]
    KvCacheTypes {
        /// Requested context size.
        n_ctx: u32,
        /// Requested batch size.
        n_batch: u32,
        /// The keys' type.
        k: &'static str,
        /// The values' type.
        v: &'static str,
    },
    /// `llama_decode` returned an error status.
    #[error("llama_decode failed with status {status} ({meaning})")]
    Decode {
        /// The status code.
        status: i32,
        /// What llama.cpp documents the status to mean.
        meaning: &'static str,
    },
    /// Tokenization failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// A tokenization was stopped by its cancel flag.
    #[error("tokenization cancelled")]
    TokenizeCancelled,
    /// A batch was filled past its capacity.
    #[error("batch is full ({capacity} tokens)")]
    BatchFull {
        /// The batch capacity.
        capacity: usize,
    },
    /// A context was asked for a sequence count it cannot keep.
    #[error(
        "a context of {n_ctx} positions cannot keep {n_seq} sequences (1 to 256, each with at least one position)"
    )]
    Sequences {
        /// Sequences asked for.
        n_seq: u32,
        /// Positions asked for.
        n_ctx: u32,
    },
    /// A sequence the context does not keep.
    #[error("sequence {seq} does not exist: the context keeps {n_seq}")]
    NoSequence {
        /// The sequence asked for.
        seq: u32,
        /// Sequences the context keeps.
        n_seq: u32,
    },
    /// A sequence's state could not be read or put back.
    #[error("sequence state: {0}")]
    SequenceState(&'static str),
    /// Logits were asked for a position that produced none.
    #[error("no logits for batch position {0}")]
    NoLogits(i32),
    /// `llama_model_quantize` failed.
    #[error("quantizing {input} to {output} failed (llama.cpp's reason is in the log above)")]
    Quantize {
        /// Source model.
        input: PathBuf,
        /// Destination model.
        output: PathBuf,
    },
    /// A CPU number beyond ggml's thread-pool mask.
    #[error("CPU {cpu} is beyond ggml's CPU mask (CPUs 0..{max}); pick cores that exist on this board")]
    CpuOutOfRange {
        /// The CPU.
        cpu: usize,
        /// The mask's size.
        max: usize,
    },
    /// ggml could not start its thread pool.
    #[error("ggml could not create a thread pool of {count} threads")]
    ThreadPool {
        /// Threads asked for.
        count: u32,
    },
    /// llama.cpp's chat layer refused a template, a request or a grammar (its message says
    /// what and where).
    #[error("{call}: {message}")]
    Chat {
        /// The llama.cpp common function.
        call: &'static str,
        /// Its message.
        message: String,
    },
    /// A token's grammar sampling ran past its time bound ([`crate::Sampler::set_guard`]): the
    /// grammar keeps too many alternatives open for this vocabulary.
    #[error("grammar sampling of one token took over {bound_ms} ms, its bound: the grammar (a JSON schema or tool list) keeps too many alternatives open; simplify it")]
    GrammarTooSlow {
        /// The bound.
        bound_ms: u64,
    },
    /// A decode was stopped by its abort flag.
    #[error("the decode was aborted")]
    Aborted,
    /// A weight was to be rebound while another context's decode ran over the same model.
    #[error("cannot rebind {tensor}: another context is decoding over the same model")]
    RebindWhileDecoding {
        /// The tensor.
        tensor: String,
    },
    /// llama.cpp threw a C++ exception (caught in the shim): the model is malformed.
    #[error("llama.cpp failed in {call}: {message} (the model file is probably malformed)")]
    Exception {
        /// The llama.cpp function.
        call: &'static str,
        /// The exception's message.
        message: String,
    },
    /// The eval callback panicked during a decode: its results cannot
    /// be trusted.
    #[error("the {0} panicked during the decode (see the log); the decode's results were discarded")]
    CallbackPanicked(&'static str),
    /// An operator-extension call was refused (a duplicate name, an invalid descriptor, inputs
    /// an operator rejects).
    #[error("{call}: {detail}")]
    Extension {
        /// The ggml-ext call.
        call: &'static str,
        /// What was refused, and why.
        detail: String,
    },
    /// A graph allocation or computation failed.
    #[error("{call} failed: {status}")]
    Graph {
        /// The ggml call.
        call: &'static str,
        /// ggml's status (`GGML_STATUS_*`), in words.
        status: &'static str,
    },
    /// A tensor's data was read or written before a scheduler or buffer allocated it.
    #[error("tensor {0} has no data: allocate its graph first")]
    NotAllocated(String),
}

impl Error {
    /// The RPC worker this error is about, when it is a worker that cannot be reached or was
    /// lost.
    pub fn lost_worker(&self) -> Option<&str> {
        match self {
            Error::RpcLost { endpoint } | Error::RpcConnect { endpoint, .. } | Error::RpcRefused { endpoint, .. } => {
                Some(endpoint)
            }
            _ => None,
        }
    }
}
