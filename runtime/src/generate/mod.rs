//! Text generation over a loaded model: tokenize, prefill, decode (greedy or sampled), timing.

mod kv_types;
mod run;
mod sampler;
mod session;

use std::path::Path;
use std::time::Duration;

use ggml_sys::{ContextParams, Model, ModelParams, Threads, Token};

pub use kv_types::{KvCacheType, KvTypes};
pub use run::{Callback, Client, Run};
pub use sampler::{to_end, Chosen, Sampler};
pub use session::{DecodeError, DecodeEvent, DecodeObserver, Session, SlotUse};

/// Prompt tokens decoded in one batch unless a plan chooses otherwise.
pub const DEFAULT_BATCH: u32 = 512;

/// What can go wrong before or during generation.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The model file cannot be used.
    #[error(transparent)]
    ModelFile(#[from] crate::metadata::ModelFileError),
    /// The prompt is empty.
    #[error("the prompt is empty: pass some text with --prompt")]
    EmptyPrompt,
    /// The prompt and the requested tokens do not fit the model's context.
    #[error("the prompt ({prompt} tokens) plus -n {n_predict} needs {need} positions, more than the model's context length {n_ctx_train}; shorten the prompt or lower -n")]
    ContextTooSmall {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens requested.
        n_predict: u32,
        /// Positions needed.
        need: usize,
        /// The model's context length.
        n_ctx_train: u32,
    },
    /// The caller stopped the generation (its abort flag was set).
    #[error("generation cancelled")]
    Cancelled,
    /// A lossy setting the model cannot take.
    #[error(transparent)]
    Lossy(crate::lossy::LossyError),
    /// Drafting was asked of a model whose memory cannot take rejected draft tokens back.
    #[error(
        "the model has recurrent layers, whose memory cannot forget rejected draft tokens; \
         turn drafting off (--draft off, or draft = \"off\" in the board profile)"
    )]
    DraftUnsupported,
    /// llama.cpp reported an error.
    #[error(transparent)]
    Llama(ggml_sys::Error),
    /// The model file failed a storage guarantee of the resident load (it cannot be read, or it
    /// changed while it was read).
    #[error("{0}")]
    Storage(String),
}

impl GenerateError {
    /// The RPC worker whose loss ended the generation, if that is what ended it.
    pub fn lost_worker(&self) -> Option<&str> {
        match self {
            GenerateError::Llama(e) => e.lost_worker(),
            _ => None,
        }
    }
}

impl From<ggml_sys::Error> for GenerateError {
    fn from(e: ggml_sys::Error) -> Self {
        match e {
            ggml_sys::Error::Aborted => GenerateError::Cancelled,
            e => GenerateError::Llama(e),
        }
    }
}

/// Opens a model: checks the file first (existence, GGUF header, every tensor inside the file)
/// so bad input gets a precise error, then loads it through llama.cpp.
pub fn load_model(path: &Path) -> Result<Model, GenerateError> {
    load_model_with(path, &ModelParams::default())
}

/// [`load_model`] with explicit llama.cpp model parameters.
pub fn load_model_with(path: &Path, params: &ModelParams) -> Result<Model, GenerateError> {
    crate::metadata::check_model_file(path)?;
    Ok(Model::load(path, params)?)
}

/// The context positions a run of `prompt` plus `n_predict` tokens needs, from a metadata-only
/// load of `path` (its vocabulary; no weight is read).
pub fn prompt_positions(path: &Path, prompt: &str, n_predict: u32) -> Result<u32, GenerateError> {
    crate::metadata::check_model_file(path)?;
    let model = Model::load(path, &ModelParams { metadata_only: true, ..Default::default() })?;
    Ok((Session::prepare(&model, prompt, n_predict)?.len() + n_predict as usize) as u32)
}

/// The model's training context length, from a metadata-only load of `path`.
pub fn context_length(path: &Path) -> Result<u32, GenerateError> {
    crate::metadata::check_model_file(path)?;
    Ok(Model::load(path, &ModelParams { metadata_only: true, ..Default::default() })?.n_ctx_train())
}

/// Generation settings.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Tokens to generate (at least 1).
    pub n_predict: u32,
    /// Compute threads: how many, on which cores.
    pub threads: Threads,
    /// N-gram drafting: the most tokens drafted per decode (`None`: off).
    pub draft: Option<usize>,
    /// The most prompt tokens one decode takes.
    pub batch: u32,
    /// The KV cache's element types.
    pub kv: KvTypes,
}

/// The most tokens `--draft ngram` drafts per decode (llama.cpp's lookup decoding drafts fewer
/// when its statistics are less sure).
pub const NGRAM_DRAFT_MAX: usize = 8;

/// The result of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The prompt's tokens (with BOS).
    pub prompt_tokens: Vec<Token>,
    /// The prompt's first tokens whose memory the slot already held (not computed again).
    pub reused: usize,
    /// The generated tokens.
    pub tokens: Vec<Token>,
    /// The generated bytes.
    pub bytes: Vec<u8>,
    /// Whether generation stopped at an end-of-generation token before `n_predict`.
    pub stopped_at_eog: bool,
    /// Time to decode the prompt.
    pub prefill: Duration,
    /// Time spent decoding generated tokens.
    pub decode: Duration,
    /// Tokens the decodes after the prompt produced (every token but the first, which the
    /// prompt's decode gives).
    pub decoded: u32,
    /// Tokens drafted from the context's n-grams.
    pub drafted: u32,
    /// Drafted tokens the model agreed with.
    pub accepted: u32,
}

impl Generation {
    /// Decode speed in tokens per second (0 when nothing was decoded).
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decoded as usize, self.decode)
    }

    /// Prompt speed in tokens per second (the tokens computed, not those reused).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens.len() - self.reused, self.prefill)
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// The shape of a session's context: its slots, the positions each holds, and the most prompt
/// tokens one decode takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextShape {
    /// Positions per slot (rounded up to a multiple of 256 in the context).
    pub positions: u32,
    /// Slots: sequences whose memory the context keeps apart.
    pub slots: u32,
    /// The most prompt tokens one decode takes (at most the positions).
    pub batch: u32,
    /// The KV cache's element types.
    pub kv: KvTypes,
}

impl ContextShape {
    /// One slot of `positions`, prompts in batches of [`DEFAULT_BATCH`], an f16 KV cache.
    pub fn one(positions: u32) -> ContextShape {
        ContextShape { positions, slots: 1, batch: DEFAULT_BATCH, kv: KvTypes::default() }
    }
}

/// The context a session creates for `shape`: each slot's positions rounded up to a multiple of
/// 256 (a KV cache of its own per slot), prompt batches of at most `shape.batch` tokens.
/// `sluice plan` sizes the same context.
pub fn context_params(shape: ContextShape, threads: &Threads) -> ContextParams {
    let per_slot = shape.positions.div_ceil(256).max(1) * 256;
    let n_batch = per_slot.min(shape.batch.max(1));
    ContextParams {
        n_ctx: per_slot.saturating_mul(shape.slots.max(1)),
        n_seq: shape.slots.max(1),
        n_batch,
        n_ubatch: n_batch,
        threads: threads.clone(),
        type_k: shape.kv.k.ggml(),
        type_v: shape.kv.v.ggml(),
    }
}

/// What a slot may keep of a later prompt that starts as its memory does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Reuse {
    /// The shared prefix in whole prompt batches ([`kept_prefix`]): the answer is the same text
    /// as from an empty slot.
    #[default]
    Exact,
    /// Any shared prefix, the answers decoded a token at a time included (llama-server's
    /// `cache_prompt`). LOSSY against a computation from nothing: llama.cpp's kernels depend on a
    /// batch's size, so kept memory may differ from a recomputation in the last bits and a
    /// greedy answer may then pick another token (a resident run given the same requests gives
    /// the same text). Computes only what is new.
    Any,
}

impl Reuse {
    /// The unit a slot keeps prompts in: whole batches of `batch` tokens, or any token.
    pub fn unit(self, batch: usize) -> usize {
        match self {
            Reuse::Exact => batch,
            Reuse::Any => 1,
        }
    }
}

/// How many of `prompt`'s first tokens memory holding `exact` (tokens computed in whole prompt
/// batches of `batch` from their start) keeps, its tokens still those of the prompt computed
/// from nothing. llama.cpp picks kernels by a batch's size (and by how many of its tokens each
/// expert takes), so memory matches that computation only where it came from the same batch: a
/// prompt runs in batches of `batch` from its start, and what is kept is the shared prefix in
/// whole such batches (never the prompt's last token, always computed for its logits).
pub fn kept_prefix(exact: &[Token], prompt: &[Token], batch: usize) -> usize {
    let shared = exact.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    let batch = batch.max(1);
    shared.min(prompt.len().saturating_sub(1)) / batch * batch
}

/// Resident generation in one call: tokenizes, sizes a context, and generates.
pub fn generate(
    model: &Model,
    prompt: &str,
    params: &GenerateParams,
    on_token: impl FnMut(Token, &[u8]),
) -> Result<Generation, GenerateError> {
    generate_observed(model, prompt, params, None, false, on_token)
}

/// [`generate`] with an eval callback on the context (forced routes, `--routes`); with
/// `ignore_eog` the run ends at `n_predict` only, an end-of-generation token included.
pub fn generate_observed<'m>(
    model: &'m Model,
    prompt: &str,
    params: &GenerateParams,
    callback: Option<ggml_sys::EvalCallback<'m>>,
    ignore_eog: bool,
    on_token: impl FnMut(Token, &[u8]),
) -> Result<Generation, GenerateError> {
    let tokens = Session::prepare(model, prompt, params.n_predict)?;
    let mut session = Session::new(
        model,
        ContextShape {
            positions: (tokens.len() + params.n_predict as usize) as u32,
            batch: params.batch,
            kv: params.kv,
            ..ContextShape::one(0)
        },
        &params.threads,
        callback,
    )?;
    session.set_ignore_eog(ignore_eog);
    session.set_draft(params.draft)?;
    session.generate(&tokens, params.n_predict, on_token, &mut |_| Ok(()))
}
