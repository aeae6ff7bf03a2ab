//! Generations that run together: each [`Run`] is one generation in a slot of a [`Session`],
//! and each [`Session::step`] is one llama.cpp decode that carries a token from every run that
//! is decoding (or a chunk of one run's prompt), so an expert routed by several runs is read
//! once for all of them.
//!
//! What a step carries: a whole prompt batch (`n_batch` tokens at a multiple of `n_batch`) runs
//! alone, exactly as a computation from nothing makes it, so the slot may keep it for a later
//! prompt; it alternates with steps carrying one token of every decoding run plus, where it fits,
//! the last (partial) chunk of one prompt. A run alone drafts (`--draft`); runs together do not.
//! llama.cpp's arithmetic depends on a batch's size and on how its tokens route, so a run's
//! tokens beside others may differ in the last bits from the same run alone: the same runs
//! started in the same order give the same tokens, resident or streamed.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use ggml_sys::{NgramDraft, Token};

use super::sampler::{Chosen, Sampler};
use super::session::{DecodeError, DecodeObserver, Session, SlotUse};
use super::{GenerateError, Generation};

/// Who a run generates for: its sampler, and what it does with each token as it is chosen.
pub trait Client {
    /// The sampler that chooses the run's tokens.
    fn sampler(&mut self) -> &mut Sampler;
    /// Takes a chosen token; [`ControlFlow::Break`] ends the run (a stop sequence, a client
    /// gone).
    fn on_token(&mut self, chosen: &Chosen<'_>) -> ControlFlow<()>;
}

/// A sampler and a token callback as a [`Client`].
pub struct Callback<'a, F> {
    /// The sampler.
    pub sampler: &'a mut Sampler,
    /// The token callback.
    pub on_token: F,
}

impl<F: FnMut(&Chosen<'_>) -> ControlFlow<()>> Client for Callback<'_, F> {
    fn sampler(&mut self) -> &mut Sampler {
        self.sampler
    }

    fn on_token(&mut self, chosen: &Chosen<'_>) -> ControlFlow<()> {
        (self.on_token)(chosen)
    }
}

/// One generation in progress in a slot ([`Session::begin`], [`Session::step`],
/// [`Session::end`]).
pub struct Run {
    slot: u32,
    n_predict: u32,
    /// The prompt's tokens in the slot's memory (kept or computed).
    fed: usize,
    /// The chosen token not yet decoded (when decoding).
    pending: Option<Token>,
    /// The next position.
    pos: i32,
    drafter: Option<(NgramDraft, usize)>,
    started: Instant,
    /// When the prompt's last token was decoded.
    decoding_since: Option<Instant>,
    /// Why the run is over: `Some(Ok)` finished, `Some(Err)` failed.
    over: Option<Result<(), GenerateError>>,
    /// Whether the latest step carried this run's tokens.
    stepped: bool,
    out: Generation,
}

impl Run {
    /// The slot the run generates in.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Whether the run has finished or failed ([`Session::end`] says which).
    pub fn is_over(&self) -> bool {
        self.over.is_some()
    }

    /// Whether the latest [`Session::step`] carried this run's tokens (a step that fails fails
    /// these runs).
    pub fn stepped(&self) -> bool {
        self.stepped
    }

    /// The generation so far.
    pub fn generation(&self) -> &Generation {
        &self.out
    }

    fn prompting(&self) -> bool {
        self.over.is_none() && self.fed < self.out.prompt_tokens.len()
    }

    fn decoding(&self) -> bool {
        self.over.is_none() && self.pending.is_some()
    }

    fn prompt_left(&self) -> usize {
        self.out.prompt_tokens.len() - self.fed
    }
}

/// What one run puts into a step.
enum Feed {
    /// The next `n` prompt tokens.
    Prompt(usize),
    /// The pending token, with drafts after it when `draft` (filled when the batch is made).
    Token { draft: bool, drafts: Vec<Token> },
}

impl<'m> Session<'m> {
    /// Generates up to `n_predict` tokens after `prompt` in the slot `at` names, chosen by
    /// `sampler`. `on_token` gets each token, its bytes and its logits as it is chosen and may end
    /// the generation early ([`ControlFlow::Break`], e.g. at a stop sequence); `observer` runs
    /// after every decode. With `at.reuse`, the prompt's first tokens that the slot already holds
    /// ([`Session::reusable`]) are not computed again; otherwise the slot starts empty. A
    /// generation that fails leaves its slot empty.
    pub fn generate_with<E: DecodeError>(
        &mut self,
        at: SlotUse,
        prompt: &[Token],
        n_predict: u32,
        sampler: &mut Sampler,
        on_token: impl FnMut(&Chosen<'_>) -> ControlFlow<()>,
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<Generation, E> {
        let mut run = self.begin(at, prompt, n_predict, sampler)?;
        let mut client = Callback { sampler, on_token };
        while !run.is_over() {
            if let Err(e) = self.step(&mut [(&mut run, &mut client as &mut dyn Client)], observer) {
                // The run failed with the decode: its slot is emptied, the decode's error said.
                let _ = self.end(run);
                return Err(e);
            }
        }
        Ok(self.end(run)?)
    }

    /// Starts a generation of up to `n_predict` tokens after `prompt` in the slot `at` names
    /// (keeping what it holds of the prompt with `at.reuse`, else emptied); `sampler` sees the
    /// prompt. Nothing is decoded until [`Session::step`].
    pub fn begin(
        &mut self,
        at: SlotUse,
        prompt: &[Token],
        n_predict: u32,
        sampler: &mut Sampler,
    ) -> Result<Run, GenerateError> {
        let (slot, reused) = self.enter(at, prompt)?;
        if let Err(e) = sampler.inner.accept_prompt(prompt) {
            self.forget(slot)?;
            return Err(e.into());
        }
        Ok(Run {
            slot,
            n_predict,
            fed: reused,
            pending: None,
            pos: reused as i32,
            drafter: self.drafter(prompt)?,
            started: Instant::now(),
            decoding_since: None,
            over: None,
            stepped: false,
            out: Generation {
                prompt_tokens: prompt.to_vec(),
                reused,
                tokens: Vec::new(),
                bytes: Vec::new(),
                stopped_at_eog: false,
                prefill: Duration::ZERO,
                decode: Duration::ZERO,
                decoded: 0,
                drafted: 0,
                accepted: 0,
            },
        })
    }

    /// Ends `run`: its generation, or why it failed. What its slot keeps of it is what a later
    /// prompt may reuse; a run that failed or was ended before it finished (a cancelled client)
    /// leaves its slot empty.
    pub fn end(&mut self, mut run: Run) -> Result<Generation, GenerateError> {
        let result = match run.over.take() {
            Some(Ok(())) => {
                run.out.decode = run.decoding_since.map_or(Duration::ZERO, |t| t.elapsed());
                // What a later prompt cannot keep (the answer's one-token decodes) need not stay.
                if self.model.memory_forgets_tail() && !self.all_keepable(run.slot) {
                    let exact = self.exact(run.slot);
                    self.keep_prefix(run.slot, exact)?;
                }
                return Ok(run.out);
            }
            Some(Err(e)) => e,
            None => GenerateError::Cancelled,
        };
        // What a failed or cancelled decode left in the slot is not known token by token.
        self.forget(run.slot)?;
        Err(result)
    }

    /// One decode for `runs` (those not over): a whole prompt batch alone, or a token of every
    /// decoding run with the last chunk of a prompt where it fits (see the module's doc); each
    /// run's next token is chosen by its client. A run whose sampler fails is over with that
    /// error; a failed decode fails every run it carried ([`Run::stepped`]) and is the error.
    pub fn step<E: DecodeError>(
        &mut self,
        runs: &mut [(&mut Run, &mut dyn Client)],
        observer: &mut DecodeObserver<'_, E>,
    ) -> Result<(), E> {
        let mut feeds = self.plan_step(runs);
        for (run, _) in runs.iter_mut() {
            run.stepped = false;
        }
        if feeds.is_empty() {
            return Ok(());
        }
        self.batch.clear();
        let mut firsts = Vec::with_capacity(feeds.len());
        let pushed = feeds.iter_mut().try_for_each(|(i, feed)| {
            firsts.push(self.batch.len() as i32);
            let run = &mut *runs[*i].0;
            run.stepped = true;
            self.push_feed(run, feed)
        });
        let prefill = feeds.iter().any(|(_, f)| matches!(f, Feed::Prompt(_)));
        self.prompt_turn = !prefill;
        let decoded = match pushed {
            Ok(()) => self.timed_decode(prefill, feeds.len(), observer),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = decoded {
            // Over, so that no later step carries them; the caller ends them with this error.
            for (run, _) in runs.iter_mut().filter(|(r, _)| r.stepped) {
                run.over = Some(Err(GenerateError::Cancelled));
            }
            return Err(e);
        }
        for ((i, feed), first) in feeds.into_iter().zip(firsts) {
            let (run, client) = &mut runs[i];
            if let Err(e) = self.after_decode(run, &mut **client, feed, first) {
                run.over = Some(Err(e));
            }
        }
        Ok(())
    }

    /// What each run puts into the next step.
    fn plan_step(&mut self, runs: &[(&mut Run, &mut dyn Client)]) -> Vec<(usize, Feed)> {
        let n_batch = self.batch_capacity();
        let decoding: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].0.decoding()).collect();
        let whole = (0..runs.len()).find(|&i| runs[i].0.prompting() && runs[i].0.prompt_left() >= n_batch);
        if let Some(i) = whole.filter(|_| decoding.is_empty() || self.prompt_turn) {
            return vec![(i, Feed::Prompt(n_batch))];
        }
        let live = runs.iter().filter(|(r, _)| !r.is_over()).count();
        let mut feeds: Vec<(usize, Feed)> = Vec::new();
        // More decoding runs than a batch takes (`--batch` under `--slots`): they take turns.
        let skip = if decoding.len() > n_batch { self.rotation % decoding.len() } else { 0 };
        self.rotation = self.rotation.wrapping_add(1);
        for &i in decoding.iter().cycle().skip(skip).take(decoding.len().min(n_batch)) {
            feeds.push((i, Feed::Token { draft: live == 1, drafts: Vec::new() }));
        }
        let room = n_batch - feeds.len();
        let partial =
            (0..runs.len()).find(|&i| runs[i].0.prompting() && runs[i].0.prompt_left() <= room.min(n_batch - 1));
        if let Some(i) = partial {
            feeds.push((i, Feed::Prompt(runs[i].0.prompt_left())));
        }
        feeds
    }

    /// Puts a run's tokens for this step into the batch (and its drafts into `feed`).
    fn push_feed(&mut self, run: &mut Run, feed: &mut Feed) -> Result<(), GenerateError> {
        match feed {
            Feed::Prompt(n) => {
                let total = run.out.prompt_tokens.len();
                for (i, &t) in run.out.prompt_tokens[run.fed..run.fed + *n].iter().enumerate() {
                    let last = run.fed + i + 1 == total;
                    self.batch.push_to(run.slot, t, run.pos + i as i32, last)?;
                }
            }
            Feed::Token { draft, drafts } => {
                let next = run.pending.expect("a decoding run has a pending token");
                if let Some((d, max)) = &mut run.drafter {
                    d.add(&[next])?;
                    if *draft {
                        let remaining = run.n_predict as usize - run.out.tokens.len();
                        *drafts = d.draft((*max).min(remaining - 1).min(self.batch.capacity() - 1))?;
                    }
                }
                self.batch.push_to(run.slot, next, run.pos, true)?;
                for (i, &t) in drafts.iter().enumerate() {
                    self.batch.push_to(run.slot, t, run.pos + 1 + i as i32, true)?;
                }
            }
        }
        Ok(())
    }

    /// Records what the decode did for one run and chooses its next token(s) from the outputs
    /// from batch index `first` on.
    fn after_decode(
        &mut self,
        run: &mut Run,
        client: &mut dyn Client,
        feed: Feed,
        first: i32,
    ) -> Result<(), GenerateError> {
        let n_batch = self.batch_capacity();
        match feed {
            Feed::Prompt(n) => {
                let chunk = run.fed..run.fed + n;
                let whole = n == n_batch && run.fed % n_batch == 0;
                let tokens = run.out.prompt_tokens[chunk.clone()].to_vec();
                self.hold(run.slot, &tokens, whole);
                run.fed += n;
                run.pos += n as i32;
                if run.fed < run.out.prompt_tokens.len() {
                    return Ok(());
                }
                run.out.prefill = run.started.elapsed();
                run.decoding_since = Some(Instant::now());
                let next = client.sampler().inner.sample(&self.ctx, first + n as i32 - 1)?;
                self.choose(run, client, next, first + n as i32 - 1)
            }
            Feed::Token { drafts, .. } => self.verify(run, client, &drafts, first),
        }
    }

    /// After a decode of a run's pending token and `drafts`: takes the model's choices while they
    /// agree with the drafts, forgets the rejected ones.
    fn verify(
        &mut self,
        run: &mut Run,
        client: &mut dyn Client,
        drafts: &[Token],
        first: i32,
    ) -> Result<(), GenerateError> {
        let next = run.pending.take().expect("a decoding run has a pending token");
        let decoded: Vec<Token> = std::iter::once(next).chain(drafts.iter().copied()).collect();
        self.hold(run.slot, &decoded, false);
        run.out.drafted += drafts.len() as u32;
        let mut at = 0;
        let mut chosen = client.sampler().inner.sample(&self.ctx, first)?;
        while at < drafts.len() && chosen == drafts[at] {
            run.out.accepted += 1;
            run.out.decoded += 1;
            self.choose(run, client, chosen, first + at as i32)?;
            if run.is_over() {
                break;
            }
            let agreed = run.pending.take().expect("a run that goes on has a pending token");
            if let Some((d, _)) = &mut run.drafter {
                d.add(&[agreed])?;
            }
            at += 1;
            chosen = client.sampler().inner.sample(&self.ctx, first + at as i32)?;
        }
        if at < drafts.len() {
            self.keep_prefix(run.slot, run.pos as usize + 1 + at)?;
        }
        run.pos += 1 + at as i32;
        if run.is_over() {
            return Ok(());
        }
        run.out.decoded += 1;
        self.choose(run, client, chosen, first + at as i32)
    }

    /// Takes a chosen token (its logits at batch output `at`): an end-of-generation token, or the
    /// client's break, or `n_predict` tokens end the run; otherwise it is the run's pending token.
    fn choose(&self, run: &mut Run, client: &mut dyn Client, token: Token, at: i32) -> Result<(), GenerateError> {
        if self.model.is_eog(token) && !self.ignore_eog {
            run.out.stopped_at_eog = true;
            run.over = Some(Ok(()));
            return Ok(());
        }
        let piece = client.sampler().piece(self.model, token);
        let flow = client.on_token(&Chosen { token, piece: &piece, logits: self.ctx.logits(at)? });
        run.out.tokens.push(token);
        run.out.bytes.extend_from_slice(&piece);
        if flow.is_break() || run.out.tokens.len() == run.n_predict as usize {
            run.over = Some(Ok(()));
        } else {
            run.pending = Some(token);
        }
        Ok(())
    }
}
