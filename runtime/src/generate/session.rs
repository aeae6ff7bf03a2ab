//! A generation session: a model and a context of one or more slots (llama.cpp sequences, each
//! with positions of its own), decoding a prompt in batches and then one token (with its drafts)
//! at a time, each decode reported to an observer. A slot remembers the tokens its memory holds,
//! so a prompt that starts the same way computes only what is new.

use std::time::{Duration, Instant};

use ggml_sys::{Batch, Context, EvalCallback, Model, NgramDraft, Threads, Token};

use super::sampler::{to_end, Sampler};
use super::{context_params, kept_prefix, ContextShape, GenerateError, Generation, Reuse};

/// One `llama_decode` call, as reported to a [`DecodeObserver`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeEvent {
    /// Tokens in the batch (the prompt chunk, or 1).
    pub n_tokens: usize,
    /// Whether this decode carried prompt tokens.
    pub prefill: bool,
    /// How many generations the decode carried tokens of.
    pub runs: usize,
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

/// Which slot a generation runs in, and whether it may keep what the slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotUse {
    /// The slot (0 to the session's slots - 1).
    pub slot: u32,
    /// Keep the memory of the prompt's first tokens where the slot holds the same tokens;
    /// `false` starts the slot empty.
    pub reuse: bool,
}

impl SlotUse {
    /// Slot 0, started empty: a one-shot generation.
    pub const FRESH: SlotUse = SlotUse { slot: 0, reuse: false };
}

/// A model plus a context of one or more slots.
pub struct Session<'m> {
    pub(super) model: &'m Model,
    pub(super) ctx: Context<'m>,
    pub(super) batch: Batch,
    /// N-gram drafting: the most tokens drafted per decode (`None`: off).
    draft: Option<usize>,
    /// Each slot's tokens, in the order of its positions: what its memory holds.
    held: Vec<Vec<Token>>,
    /// How many of each slot's first tokens were computed in whole prompt batches: the only ones
    /// a later prompt may keep (see [`Session::reusable`]).
    exact: Vec<usize>,
    /// Whether a waiting whole prompt batch goes before the decoding runs in the next step (it
    /// alternates with them; see [`Session::step`]).
    pub(super) prompt_turn: bool,
    /// Steps taken: which decoding runs go first when a batch cannot take them all.
    pub(super) rotation: usize,
    /// What a slot may keep of a later prompt.
    reuse: Reuse,
    /// An end-of-generation token is a token like any other: the run ends at `n_predict`
    /// (forced routes, whose run is as long as the routes).
    pub(super) ignore_eog: bool,
}

impl<'m> Session<'m> {
    /// A handle on the context's compute threads (when the board pins them: ggml then runs its
    /// own pool), for a streamer to let them sleep while it waits for storage.
    pub fn compute_threads(&self) -> Option<ggml_sys::ComputeThreads> {
        self.ctx.compute_threads()
    }

    /// Creates a context of `shape`, with an optional eval callback.
    pub fn new(
        model: &'m Model,
        shape: ContextShape,
        threads: &Threads,
        callback: Option<EvalCallback<'m>>,
    ) -> Result<Session<'m>, GenerateError> {
        let params = context_params(shape, threads);
        let ctx = Context::new(model, &params, callback)?;
        let held = vec![Vec::new(); params.n_seq as usize];
        let exact = vec![0; params.n_seq as usize];
        let batch = Batch::new(params.n_batch as usize);
        Ok(Session {
            model,
            ctx,
            batch,
            draft: None,
            held,
            exact,
            prompt_turn: false,
            rotation: 0,
            reuse: Reuse::Exact,
            ignore_eog: false,
        })
    }

    /// The bytes the context holds, as llama.cpp accounts them (its KV cache and compute
    /// buffers).
    pub fn memory_sizes(&self) -> ggml_sys::MemorySizes {
        self.ctx.memory_sizes()
    }

    /// With `on`, an end-of-generation token no longer ends a run: it ends at its `n_predict`
    /// (a run under forced routes measures as many tokens as it was given).
    pub fn set_ignore_eog(&mut self, on: bool) {
        self.ignore_eog = on;
    }

    /// The tokens slot `slot`'s memory holds (empty for a slot that does not exist).
    pub fn held(&self, slot: u32) -> &[Token] {
        self.held.get(slot as usize).map_or(&[], Vec::as_slice)
    }

    /// How many slots the session has.
    pub fn slots(&self) -> u32 {
        self.held.len() as u32
    }

    /// How many of `prompt`'s first tokens a generation in `slot` would keep ([`kept_prefix`]
    /// of what the slot computed in whole batches, or of all it holds with [`Reuse::Any`]);
    /// nothing where the memory cannot drop the rest of the slot (recurrent layers keep one state
    /// for the sequence).
    pub fn reusable(&self, slot: u32, prompt: &[Token]) -> usize {
        let held = self.held(slot);
        let keepable = if self.reuse == Reuse::Any { held.len() } else { self.exact(slot).min(held.len()) };
        let keep = kept_prefix(&held[..keepable], prompt, self.reuse_unit());
        if keep < held.len() && !self.model.memory_forgets_tail() {
            return 0;
        }
        keep
    }

    /// What a slot may keep of a later prompt: whole prompt batches (the default), or any shared
    /// prefix ([`Reuse::Any`], lossy).
    pub fn set_reuse(&mut self, reuse: Reuse) {
        self.reuse = reuse;
    }

    /// The unit a slot keeps prompts in ([`Reuse::unit`] of the batch).
    pub fn reuse_unit(&self) -> usize {
        self.reuse.unit(self.batch_capacity())
    }

    /// Whether a later prompt may keep all that slot `slot` holds (what a saved slot must be).
    pub fn all_keepable(&self, slot: u32) -> bool {
        self.reuse == Reuse::Any || self.exact(slot) == self.held(slot).len()
    }

    /// How many of slot `slot`'s first tokens were computed in whole prompt batches.
    pub fn exact(&self, slot: u32) -> usize {
        self.exact.get(slot as usize).copied().unwrap_or(0)
    }

    /// Empties slot `slot`.
    pub fn forget(&mut self, slot: u32) -> Result<(), GenerateError> {
        self.ctx.forget_sequence(slot)?;
        self.held[slot as usize].clear();
        self.exact[slot as usize] = 0;
        Ok(())
    }

    /// Slot `slot`'s memory as llama.cpp serializes it, and its tokens.
    pub fn save_slot(&self, slot: u32) -> Result<(Vec<Token>, Vec<u8>), GenerateError> {
        let state = self.ctx.sequence_state(slot)?;
        Ok((self.held(slot).to_vec(), state))
    }

    /// Puts a saved slot (all of it [`Session::exact`]) back into `slot`: `tokens` are what
    /// `state` holds. A state llama.cpp refuses, or of another count of positions, empties it.
    pub fn restore_slot(&mut self, slot: u32, tokens: &[Token], state: &[u8]) -> Result<(), GenerateError> {
        if let Some(h) = self.held.get_mut(slot as usize) {
            h.clear();
        }
        let held = self.ctx.set_sequence_state(slot, state).and_then(|()| self.ctx.positions_held(slot))?;
        if held as usize != tokens.len() {
            self.forget(slot)?;
            return Err(ggml_sys::Error::SequenceState(
                "the saved state holds another number of positions than tokens",
            )
            .into());
        }
        self.held[slot as usize] = tokens.to_vec();
        self.exact[slot as usize] = tokens.len();
        Ok(())
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
        self.held.iter_mut().for_each(Vec::clear);
        self.exact.iter_mut().for_each(|e| *e = 0);
        Ok(result?)
    }

    pub(super) fn timed_decode<E: DecodeError>(
        &mut self,
        prefill: bool,
        runs: usize,
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<(), E> {
        let t = Instant::now();
        let result = self.ctx.decode(&self.batch);
        let event = DecodeEvent { n_tokens: self.batch.len(), prefill, runs, wall: t.elapsed() };
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
        self.generate_with(SlotUse::FRESH, prompt, n_predict, &mut sampler, to_end(on_token), observer)
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

    /// Empties what slot `at.slot` holds but the part of `prompt` it keeps; returns the slot and
    /// how many tokens it kept.
    pub(super) fn enter(&mut self, at: SlotUse, prompt: &[Token]) -> Result<(u32, usize), GenerateError> {
        if at.slot >= self.slots() {
            return Err(ggml_sys::Error::NoSequence { seq: at.slot, n_seq: self.slots() }.into());
        }
        let reused = if at.reuse { self.reusable(at.slot, prompt) } else { 0 };
        self.keep_prefix(at.slot, reused)?;
        Ok((at.slot, reused))
    }

    /// The draft state over `prompt` and the most tokens a decode drafts, when drafting.
    pub(super) fn drafter(&self, prompt: &[Token]) -> Result<Option<(NgramDraft, usize)>, GenerateError> {
        let Some(max) = self.draft else { return Ok(None) };
        let mut d = NgramDraft::new()?;
        d.add(prompt)?;
        Ok(Some((d, max)))
    }

    /// Keeps the slot's first `keep` tokens and forgets the rest.
    pub(super) fn keep_prefix(&mut self, slot: u32, keep: usize) -> Result<(), GenerateError> {
        if keep == 0 {
            return self.forget(slot);
        }
        self.ctx.forget_from(slot, keep as i32)?;
        self.held[slot as usize].truncate(keep);
        self.exact[slot as usize] = self.exact[slot as usize].min(keep);
        Ok(())
    }

    /// Records that the last decode put `tokens` into `slot`'s memory; `whole` when they were a
    /// whole prompt batch at a multiple of `n_batch` (what a later prompt may keep).
    pub(super) fn hold(&mut self, slot: u32, tokens: &[Token], whole: bool) {
        let s = slot as usize;
        if whole && self.exact[s] == self.held[s].len() {
            self.exact[s] += tokens.len();
        }
        self.held[s].extend_from_slice(tokens);
    }

    /// Decodes `prompt` from token `from` (a multiple of the batch size) on into `slot` (which
    /// holds the tokens before it) in batches, the last token's logits kept; returns the next
    /// position.
    fn prefill<E: DecodeError>(
        &mut self,
        slot: u32,
        prompt: &[Token],
        from: usize,
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<i32, E> {
        let n_batch = self.batch_capacity();
        let mut pos = from as i32;
        // `from` is a multiple of n_batch (what a slot keeps is whole batches), so the batches are
        // those of a computation from nothing.
        for chunk in prompt[from..].chunks(n_batch) {
            self.batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                let last = pos as usize + i + 1 == prompt.len();
                self.batch.push_to(slot, t, pos + i as i32, last)?;
            }
            self.timed_decode(true, 1, observer)?;
            self.hold(slot, chunk, chunk.len() == n_batch && pos as usize % n_batch == 0);
            pos += chunk.len() as i32;
        }
        Ok(pos)
    }

    /// Teacher forcing: decodes `prompt`, then `continuation` one token at a time, and passes
    /// `on_logits(i, logits)` the model's next-token logits before `continuation[i]`: what the
    /// model predicts at each step of a given text (to compare two configurations on the same
    /// text). Runs in slot 0, started empty.
    pub fn score_continuation<E: DecodeError>(
        &mut self,
        prompt: &[Token],
        continuation: &[Token],
        mut on_logits: impl FnMut(usize, &[f32]),
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<(), E> {
        self.forget(0)?;
        let start = self.prefill(0, prompt, 0, observer)?;
        for (i, (&t, pos)) in continuation.iter().zip(start..).enumerate() {
            on_logits(i, self.ctx.logits(-1)?);
            if i + 1 == continuation.len() {
                break;
            }
            self.batch.clear();
            self.batch.push(t, pos, true)?;
            self.timed_decode(false, 1, observer)?;
            self.hold(0, &[t], false);
        }
        Ok(())
    }

    /// Decodes `tokens` into slot 0, started empty, in prompt batches with every position's
    /// logits kept, and passes `on_logits(pos, logits)` the model's next-token logits after
    /// `tokens[pos]`: a perplexity window ([`crate::perplexity`]), computed as a prompt is.
    pub fn evaluate_window<E: DecodeError>(
        &mut self,
        tokens: &[Token],
        on_logits: &mut dyn FnMut(usize, &[f32]),
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<(), E> {
        self.forget(0)?;
        let n_batch = self.batch_capacity();
        for (c, chunk) in tokens.chunks(n_batch).enumerate() {
            let from = c * n_batch;
            self.batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                self.batch.push_to(0, t, (from + i) as i32, true)?;
            }
            self.timed_decode(true, 1, observer)?;
            self.hold(0, chunk, false);
            for i in 0..chunk.len() {
                on_logits(from + i, self.ctx.logits(i as i32)?);
            }
        }
        Ok(())
    }

    /// The most prompt tokens one decode takes.
    pub fn batch_capacity(&self) -> usize {
        self.batch.capacity()
    }
}
