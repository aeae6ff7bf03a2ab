//! Text generation over a loaded model: tokenize, prefill, decode (greedy or sampled), timing.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

use std::collections::HashSet;

use ggml_sys::{
    Batch, Context, ContextParams, EvalCallback, Model, ModelParams, NgramDraft, SamplerParams, Threads, Token,
};

/// Largest number of prompt tokens decoded in one batch.
const MAX_BATCH: u32 = 512;

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
    /// llama.cpp reported an error.
    #[error(transparent)]
    Llama(ggml_sys::Error),
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

/// Chooses tokens with llama.cpp's sampler ([`SamplerParams`]: greedy, or penalties, top-k,
/// top-p, min-p, temperature and a seeded draw, under an optional grammar), and renders them
/// as text.
pub struct Sampler {
    inner: ggml_sys::Sampler,
    /// Special tokens whose text is kept in the output (a chat format's markers).
    shown: HashSet<Token>,
}

impl Sampler {
    /// A sampler over `model`'s vocabulary. A grammar llama.cpp cannot parse is an error.
    pub fn new(model: &Model, params: &SamplerParams) -> Result<Sampler, GenerateError> {
        Ok(Sampler { inner: ggml_sys::Sampler::new(model, params)?, shown: HashSet::new() })
    }

    /// The highest logit every time (lowest id on ties): the same text as a resident run.
    pub fn greedy(model: &Model) -> Result<Sampler, GenerateError> {
        Sampler::new(model, &SamplerParams::greedy())
    }

    /// Bounds each token's grammar work: cancelled with `cancel`, and an error past `bound`
    /// ([`ggml_sys::Sampler::set_guard`]).
    pub fn set_guard(&mut self, cancel: std::sync::Arc<std::sync::atomic::AtomicBool>, bound: std::time::Duration) {
        self.inner.set_guard(cancel, bound);
    }

    /// Keeps the text of these special tokens in the output (they are dropped otherwise).
    pub fn show_special(&mut self, tokens: impl IntoIterator<Item = Token>) {
        self.shown.extend(tokens);
    }

    fn piece(&self, model: &Model, token: Token) -> Vec<u8> {
        model.token_piece_with(token, self.shown.contains(&token))
    }
}

/// A token as it is chosen.
#[derive(Debug, Clone, Copy)]
pub struct Chosen<'a> {
    /// The token.
    pub token: Token,
    /// Its text.
    pub piece: &'a [u8],
    /// The model's logits it was chosen from (before any sampling step).
    pub logits: &'a [f32],
}

/// A token callback that never stops the generation, from one that only watches.
pub fn to_end(mut on_token: impl FnMut(Token, &[u8])) -> impl FnMut(&Chosen<'_>) -> ControlFlow<()> {
    move |c| {
        on_token(c.token, c.piece);
        ControlFlow::Continue(())
    }
}

/// One `llama_decode` call, as reported to a [`DecodeObserver`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeEvent {
    /// Tokens in the batch (the prompt chunk, or 1).
    pub n_tokens: usize,
    /// Whether this decode was part of the prompt.
    pub prefill: bool,
    /// Wall time of the decode.
    pub wall: Duration,
}

/// Called after every decode; an error stops the generation. `E` is the error of the layer that
/// observes (the streaming engine's carries a generation error, so its failures end the
/// generation with its own error).
pub type DecodeObserver<'a, E = GenerateError> = dyn FnMut(DecodeEvent) -> Result<(), E> + 'a;

/// An error a generation may end with: a generation error, or an observer's error that can
/// carry one.
pub trait DecodeError: From<GenerateError> + From<ggml_sys::Error> {}

impl<E: From<GenerateError> + From<ggml_sys::Error>> DecodeError for E {}

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
}

/// The most tokens `--draft ngram` drafts per decode (llama.cpp's lookup decoding drafts fewer
/// when its statistics are less sure).
pub const NGRAM_DRAFT_MAX: usize = 8;

/// The result of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The prompt's tokens (with BOS).
    pub prompt_tokens: Vec<Token>,
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

    /// Prompt speed in tokens per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens.len(), self.prefill)
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// The context a session creates for `positions` positions: the context rounded up to a
/// multiple of 256, prompt batches of at most 512 tokens. `sluice plan` sizes the same shape.
pub fn context_params(positions: u32, threads: &Threads) -> ContextParams {
    let n_ctx = positions.div_ceil(256).max(1) * 256;
    let n_batch = n_ctx.min(MAX_BATCH);
    ContextParams { n_ctx, n_batch, n_ubatch: n_batch, threads: threads.clone() }
}

/// A model plus a context sized for one prompt and continuation.
pub struct Session<'m> {
    model: &'m Model,
    ctx: Context<'m>,
    batch: Batch,
    /// N-gram drafting: the most tokens drafted per decode (`None`: off).
    draft: Option<usize>,
}

impl<'m> Session<'m> {
    /// Creates a context with room for `n_ctx` positions, with an optional eval callback.
    pub fn new(
        model: &'m Model,
        n_ctx: u32,
        threads: &Threads,
        callback: Option<EvalCallback<'m>>,
    ) -> Result<Session<'m>, GenerateError> {
        let params = context_params(n_ctx, threads);
        let ctx = Context::new(model, &params, callback)?;
        Ok(Session { model, ctx, batch: Batch::new(params.n_batch as usize), draft: None })
    }

    /// Tokenizes `prompt` and checks it fits with `n_predict` more tokens.
    pub fn prepare(model: &Model, prompt: &str, n_predict: u32) -> Result<Vec<Token>, GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let tokens = model.tokenize(prompt, true)?;
        let need = tokens.len() + n_predict as usize;
        if need > model.n_ctx_train() as usize {
            return Err(GenerateError::ContextTooSmall {
                prompt: tokens.len(),
                n_predict,
                need,
                n_ctx_train: model.n_ctx_train(),
            });
        }
        Ok(tokens)
    }

    /// Decodes one token (`token`, at position 0) and forgets it: a warm-up that runs the whole
    /// graph once (the streaming engine captures its weights during it).
    pub fn warm_up(&mut self, token: Token) -> Result<(), GenerateError> {
        self.batch.clear();
        self.batch.push(token, 0, true)?;
        let result = self.ctx.decode(&self.batch);
        self.ctx.clear_memory();
        Ok(result?)
    }

    fn timed_decode<E: DecodeError>(&mut self, prefill: bool, observer: &mut DecodeObserver<'_, E>) -> Result<(), E> {
        let t = Instant::now();
        let result = self.ctx.decode(&self.batch);
        let event = DecodeEvent { n_tokens: self.batch.len(), prefill, wall: t.elapsed() };
        // The observer runs even when the decode failed: it reports the streaming engine's error,
        // which says more than llama.cpp's status.
        observer(event)?;
        Ok(result?)
    }

    /// Generates up to `n_predict` tokens greedily after `prompt`, calling `on_token` with each
    /// token and its bytes as it is chosen and `observer` after every decode. Starts from an
    /// empty context every time.
    pub fn generate(
        &mut self,
        prompt: &[Token],
        n_predict: u32,
        on_token: impl FnMut(Token, &[u8]),
        observer: &mut DecodeObserver<'_>,
    ) -> Result<Generation, GenerateError> {
        let mut sampler = Sampler::greedy(self.model)?;
        self.generate_with(prompt, n_predict, &mut sampler, to_end(on_token), observer)
    }

    /// The model this session runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Drafts up to `max` tokens per decode from the context's n-grams (llama.cpp's lookup
    /// decoding) and verifies them in the same batch; `None` turns it off. Greedy output is the
    /// same text either way.
    pub fn set_draft(&mut self, max: Option<usize>) {
        self.draft = max.filter(|&m| m > 0);
    }

    /// Makes every later decode of this session stop as soon as `flag` is set (between graph
    /// nodes): the generation then ends with [`GenerateError::Cancelled`].
    pub fn set_abort_flag(&mut self, flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
        self.ctx.set_abort_flag(flag);
    }

    /// Generates up to `n_predict` tokens after `prompt`, chosen by `sampler`. `on_token` gets
    /// each token, its bytes and its logits as it is chosen and may end the generation early
    /// ([`ControlFlow::Break`], e.g. at a stop sequence); `observer` runs after every decode.
    /// Starts from an empty context every time.
    pub fn generate_with<E: DecodeError>(
        &mut self,
        prompt: &[Token],
        n_predict: u32,
        sampler: &mut Sampler,
        mut on_token: impl FnMut(&Chosen<'_>) -> ControlFlow<()>,
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<Generation, E> {
        self.ctx.clear_memory();
        sampler.inner.accept_prompt(prompt)?;
        let t0 = Instant::now();
        let mut pos = self.prefill(prompt, observer)?;
        let prefill = t0.elapsed();
        let t1 = Instant::now();
        // The draft state and the most tokens a decode drafts.
        let mut drafter = match self.draft {
            Some(max) => {
                let mut d = NgramDraft::new()?;
                d.add(prompt)?;
                Some((d, max))
            }
            None => None,
        };
        let mut next = sampler.inner.sample(&self.ctx, -1)?;
        let mut next_at = -1;
        let mut out = Generation {
            prompt_tokens: prompt.to_vec(),
            tokens: Vec::new(),
            bytes: Vec::new(),
            stopped_at_eog: false,
            prefill,
            decode: Duration::ZERO,
            decoded: 0,
            drafted: 0,
            accepted: 0,
        };
        'generate: loop {
            if self.take(next, next_at, sampler, &mut on_token, &mut out, n_predict)?.is_break() {
                break;
            }
            let remaining = n_predict as usize - out.tokens.len();
            let drafts = match &mut drafter {
                Some((d, max)) => {
                    d.add(&[next])?;
                    d.draft((*max).min(remaining - 1).min(self.batch_capacity() - 1))?
                }
                None => Vec::new(),
            };
            self.batch.clear();
            self.batch.push(next, pos, true)?;
            for (i, &t) in drafts.iter().enumerate() {
                self.batch.push(t, pos + 1 + i as i32, true)?;
            }
            self.timed_decode(false, observer)?;
            out.drafted += drafts.len() as u32;
            // The model's choice after `next`, then after each draft token it agreed with.
            let mut at = 0;
            next = sampler.inner.sample(&self.ctx, 0)?;
            while at < drafts.len() && next == drafts[at] {
                out.accepted += 1;
                out.decoded += 1;
                if self.take(next, at as i32, sampler, &mut on_token, &mut out, n_predict)?.is_break() {
                    break 'generate;
                }
                if let Some((d, _)) = &mut drafter {
                    d.add(&[next])?;
                }
                at += 1;
                next = sampler.inner.sample(&self.ctx, at as i32)?;
            }
            out.decoded += 1;
            next_at = at as i32;
            if at < drafts.len() {
                self.ctx.forget_from(pos + 1 + at as i32)?;
            }
            pos += 1 + at as i32;
        }
        out.decode = t1.elapsed();
        Ok(out)
    }

    /// Decodes `prompt` into the (empty) context in batches, the last token's logits kept;
    /// returns the next position.
    fn prefill<E: DecodeError>(&mut self, prompt: &[Token], observer: &mut DecodeObserver<'_, E>) -> Result<i32, E> {
        let n_batch = self.batch_capacity();
        let mut pos = 0i32;
        for chunk in prompt.chunks(n_batch) {
            self.batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                let last = pos as usize + i + 1 == prompt.len();
                self.batch.push(t, pos + i as i32, last)?;
            }
            self.timed_decode(true, observer)?;
            pos += chunk.len() as i32;
        }
        Ok(pos)
    }

    /// Teacher forcing: decodes `prompt`, then `continuation` one token at a time, and passes
    /// `on_logits(i, logits)` the model's next-token logits before `continuation[i]`: what the
    /// model predicts at each step of a given text (to compare two configurations on the same
    /// text). Starts from an empty context.
    pub fn score_continuation<E: DecodeError>(
        &mut self,
        prompt: &[Token],
        continuation: &[Token],
        mut on_logits: impl FnMut(usize, &[f32]),
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<(), E> {
        self.ctx.clear_memory();
        let start = self.prefill(prompt, observer)?;
        for (i, (&t, pos)) in continuation.iter().zip(start..).enumerate() {
            on_logits(i, self.ctx.logits(-1)?);
            if i + 1 == continuation.len() {
                break;
            }
            self.batch.clear();
            self.batch.push(t, pos, true)?;
            self.timed_decode(false, observer)?;
        }
        Ok(())
    }

    /// Takes a chosen token (its logits at batch output `at`): ends the generation at an
    /// end-of-generation token, else passes it to `on_token` and records it; `Break` when the
    /// generation is over.
    fn take(
        &self,
        token: Token,
        at: i32,
        sampler: &Sampler,
        on_token: &mut impl FnMut(&Chosen<'_>) -> ControlFlow<()>,
        out: &mut Generation,
        n_predict: u32,
    ) -> Result<ControlFlow<()>, GenerateError> {
        if self.model.is_eog(token) {
            out.stopped_at_eog = true;
            return Ok(ControlFlow::Break(()));
        }
        let piece = sampler.piece(self.model, token);
        let flow = on_token(&Chosen { token, piece: &piece, logits: self.ctx.logits(at)? });
        out.tokens.push(token);
        out.bytes.extend_from_slice(&piece);
        if flow.is_break() || out.tokens.len() == n_predict as usize {
            return Ok(ControlFlow::Break(()));
        }
        Ok(ControlFlow::Continue(()))
    }

    fn batch_capacity(&self) -> usize {
        (self.ctx.n_ctx().min(MAX_BATCH)) as usize
    }
}

/// Resident generation in one call: tokenizes, sizes a context, and generates.
pub fn generate(
    model: &Model,
    prompt: &str,
    params: &GenerateParams,
    on_token: impl FnMut(Token, &[u8]),
) -> Result<Generation, GenerateError> {
    let tokens = Session::prepare(model, prompt, params.n_predict)?;
    let mut session = Session::new(model, (tokens.len() + params.n_predict as usize) as u32, &params.threads, None)?;
    session.set_draft(params.draft);
    session.generate(&tokens, params.n_predict, on_token, &mut |_| Ok(()))
}
