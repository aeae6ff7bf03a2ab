//! A generation session: a model and a context sized for one prompt and its continuation,
//! decoding the prompt in batches and then one token (with its drafts) at a time, each decode
//! reported to an observer.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use ggml_sys::{Batch, Context, EvalCallback, Model, NgramDraft, Threads, Token};

use super::sampler::{to_end, Chosen, Sampler};
use super::{context_params, GenerateError, Generation, MAX_BATCH};

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
    /// same text either way. A recurrent or hybrid model, whose memory cannot drop rejected
    /// drafts, is refused here, before anything is generated.
    pub fn set_draft(&mut self, max: Option<usize>) -> Result<(), GenerateError> {
        let max = max.filter(|&m| m > 0);
        if max.is_some() && !self.model.memory_forgets_tail() {
            return Err(GenerateError::DraftUnsupported);
        }
        self.draft = max;
        Ok(())
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
