//! A streamed session: the warm-up capture, then the streamer, behind llama.cpp's eval
//! callback, around a generation session.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use ggml_sys::{EvalPhase, Model, TensorView, Token};
use sluice_hal::usage::Usage;

use super::capture::Capture;
use super::checksums::ReadSums;
use super::engine::{Overlap, Streamer, StreamerSettings};
use super::index::ExpertIndex;
use super::io::IoLanes;
use super::load::{DensePolicy, StreamConfig};
use super::record::TokenRow;
use super::{kernel, StreamError};
use crate::generate::{
    to_end, Chosen, Client, ContextShape, DecodeEvent, DecodeObserver, GenerateError, Generation, Run, Sampler,
    Session, SlotUse,
};
use crate::units::mib;

/// Checks `budget` against one token's routed demand.
pub fn check_cache_budget(index: &ExpertIndex, budget: u64, force: bool) -> Result<(), StreamError> {
    let min = index.one_token_demand();
    if budget == 0 || budget >= min || force {
        return Ok(());
    }
    Err(StreamError::CacheTooSmall {
        budget_mib: mib(budget),
        min_mib: mib(min),
        min_mb: min.div_ceil(1 << 20),
        layers: index.moe_layers().count(),
        k: index.n_expert_used,
    })
}

/// The checksums every read of `index`'s model is checked against (`--verify`); the model's
/// headers are checked now. With dense `mmap` llama.cpp's mapping reads the dense weights,
/// unchecked: said once.
fn open_sums(index: &ExpertIndex, dense: DensePolicy) -> Result<ReadSums, StreamError> {
    let sums = ReadSums::load(index)?;
    if dense == DensePolicy::Mmap {
        log::warn!(
            "--verify checks the routed experts' reads; with dense mmap (the cuda service) llama.cpp's mapping reads the dense weights unchecked: `sluice verify --check --model MODEL` checks those"
        );
    }
    Ok(sums)
}

/// What the eval callback drives: the warm-up capture, then the streamer the capture's bound
/// weights are handed to.
struct Stages<'m> {
    capture: Mutex<Option<Capture<'m>>>,
    streamer: OnceLock<Arc<Mutex<Streamer>>>,
}

impl Stages<'_> {
    fn on_eval(&self, t: TensorView<'_>, phase: EvalPhase) -> bool {
        if let Some(streamer) = self.streamer.get() {
            return lock(streamer).on_eval(t, phase);
        }
        // No streamer yet: the warm-up. (Between the capture's end and the streamer's start no
        // graph runs; were one to, it would ask for nothing and stop at its first node.)
        self.capture.lock().unwrap_or_else(PoisonError::into_inner).as_mut().is_some_and(|c| c.on_eval(t, phase))
    }
}

/// A session that streams routed experts.
pub struct StreamedSession<'m> {
    // The context first, then the kernel's claim on its expert tensors.
    session: Session<'m>,
    _claims: kernel::Claims,
    streamer: Arc<Mutex<Streamer>>,
    /// Dense bytes read at open (dense `anon`).
    pub dense_bytes_read: u64,
}

impl<'m> StreamedSession<'m> {
    /// Sets up streaming over `model` (loaded from `index`'s files): starts the lanes, creates a
    /// context of `shape`, captures the weights in a warm-up decode, and rebinds them.
    pub fn open(
        model: &'m Model,
        index: Arc<ExpertIndex>,
        config: &StreamConfig,
        shape: ContextShape,
        threads: &ggml_sys::Threads,
    ) -> Result<Self, StreamError> {
        check_cache_budget(&index, config.cache_bytes, config.force_cache)?;
        if !index.verified {
            log::warn!(
                "architecture '{}' is not verified by a sluice gate: its experts ({}) stream by the generic rule, checked at warm-up; compare with --resident once",
                index.arch,
                index.expert_kinds().join(", ")
            );
        }
        let sums = if config.verify { Some(Arc::new(open_sums(&index, config.dense)?)) } else { None };
        let lanes = Arc::new(IoLanes::new(&index.shards, &config.lanes).map_err(StreamError::Lanes)?);
        let bound = config.overlap.unwrap_or(config.lanes.bound);
        let source = Arc::new(kernel::ExpertSource::new(Arc::clone(&lanes), bound, threads.count));
        let capture = Capture::new(model, Arc::clone(&index), lanes, sums.clone(), config.dense == DensePolicy::Anon);
        let stages = Arc::new(Stages { capture: Mutex::new(Some(capture)), streamer: OnceLock::new() });
        let on_eval = Arc::clone(&stages);
        let callback: ggml_sys::EvalCallback<'m> = Box::new(move |t, phase| on_eval.on_eval(t, phase));
        let (session, claim) = kernel::claiming(&index, || Session::new(model, shape, threads, Some(callback)))?;
        let mut session = session?;
        let claims = kernel::Claims::register(&index, &claim, &source);
        let warmed = session.warm_up(model.tokenize("", true)?.first().copied().unwrap_or(0));
        // A capture failure (a failed read stops the warm-up) says more than the decode's status.
        let capture = stages.capture.lock().unwrap_or_else(PoisonError::into_inner).take();
        let bound = capture.ok_or_else(|| StreamError::Graph("the warm-up capture ended twice".into()))?.finish()?;
        warmed?;
        let dense_bytes_read = bound.dense_bytes_read;
        let settings = StreamerSettings {
            cache_budget: config.cache_bytes,
            gpu: config.gpu_layers > 0,
            overlap: config.overlap.map(|bound| Overlap { bound, decodes: config.overlap_decodes }),
            substitute: config.lossy.substitute,
            trace: config.trace_routes,
            cache_policy: config.cache_policy,
            expert_pool: config.expert_pool,
            lookahead: config.lookahead,
            force_routes: config.force_routes.clone(),
            record_routes: config.record_routes,
            // Unpinned compute threads may run anywhere: then every CPU is watched.
            cores: if threads.cpus.is_empty() {
                Vec::new()
            } else {
                threads.cpus.iter().chain(&config.lanes.cpus).copied().collect()
            },
            cores_load: config.cores_load.clone(),
        };
        session.set_ignore_eog(config.force_routes.is_some());
        let mut streamer = Streamer::new(index, source, bound, claims.taken(), sums, settings);
        streamer.set_compute_threads(session.compute_threads());
        let streamer = Arc::new(Mutex::new(streamer));
        // Set once, before any decode that streams.
        let _ = stages.streamer.set(Arc::clone(&streamer));
        Ok(StreamedSession { session, _claims: claims, streamer, dense_bytes_read })
    }

    /// The streamer's state (counters, trace, budget).
    pub fn streamer(&self) -> MutexGuard<'_, Streamer> {
        lock(&self.streamer)
    }

    /// The model this session runs.
    pub fn model(&self) -> &'m Model {
        self.session.model()
    }

    /// The generation session inside: its slots and what they hold.
    pub fn session(&self) -> &Session<'m> {
        &self.session
    }

    /// Empties slot `slot` ([`Session::forget`]).
    pub fn forget(&mut self, slot: u32) -> Result<(), StreamError> {
        Ok(self.session.forget(slot)?)
    }

    /// Puts a saved slot back ([`Session::restore_slot`]); no decode runs.
    pub fn restore_slot(&mut self, slot: u32, tokens: &[Token], state: &[u8]) -> Result<(), StreamError> {
        Ok(self.session.restore_slot(slot, tokens, state)?)
    }

    /// Generates like [`Session::generate`], returning per-decode telemetry rows too.
    pub fn generate(
        &mut self,
        prompt: &[Token],
        n_predict: u32,
        on_token: impl FnMut(Token, &[u8]),
        on_row: impl FnMut(&TokenRow),
    ) -> Result<(Generation, Vec<TokenRow>), StreamError> {
        let mut sampler = Sampler::greedy(self.session.model())?;
        self.generate_with(SlotUse::FRESH, prompt, n_predict, &mut sampler, to_end(on_token), on_row)
    }

    /// Generates like [`Session::generate_with`], returning per-decode telemetry rows too.
    pub fn generate_with(
        &mut self,
        at: SlotUse,
        prompt: &[Token],
        n_predict: u32,
        sampler: &mut Sampler,
        on_token: impl FnMut(&Chosen<'_>) -> ControlFlow<()>,
        on_row: impl FnMut(&TokenRow),
    ) -> Result<(Generation, Vec<TokenRow>), StreamError> {
        self.observed(on_row, |session, observer| {
            session.generate_with(at, prompt, n_predict, sampler, on_token, observer)
        })
    }

    /// Starts a generation in a slot ([`Session::begin`]); [`StreamedSession::step`] runs it.
    pub fn begin(
        &mut self,
        at: SlotUse,
        prompt: &[Token],
        n_predict: u32,
        sampler: &mut Sampler,
    ) -> Result<Run, StreamError> {
        Ok(self.session.begin(at, prompt, n_predict, sampler)?)
    }

    /// One decode for `runs` ([`Session::step`]), streamed; `on_row` gets its telemetry row.
    pub fn step(
        &mut self,
        runs: &mut [(&mut Run, &mut dyn Client)],
        on_row: impl FnMut(&TokenRow),
    ) -> Result<(), StreamError> {
        self.observed(on_row, |session, observer| session.step(runs, observer)).map(|((), _)| ())
    }

    /// Ends a run ([`Session::end`]): its generation, or why it failed.
    pub fn end(&mut self, run: Run) -> Result<Generation, StreamError> {
        Ok(self.session.end(run)?)
    }

    /// Teacher forcing like [`Session::score_continuation`], streamed.
    pub fn score_continuation(
        &mut self,
        prompt: &[Token],
        continuation: &[Token],
        on_logits: impl FnMut(usize, &[f32]),
    ) -> Result<Vec<TokenRow>, StreamError> {
        let ((), rows) = self.observed(
            |_| {},
            |session, observer| session.score_continuation(prompt, continuation, on_logits, observer),
        )?;
        Ok(rows)
    }

    /// A perplexity window like [`Session::evaluate_window`], streamed.
    pub fn evaluate_window(
        &mut self,
        tokens: &[Token],
        on_logits: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<Vec<TokenRow>, StreamError> {
        let ((), rows) =
            self.observed(|_| {}, |session, observer| session.evaluate_window(tokens, on_logits, observer))?;
        Ok(rows)
    }

    /// Runs `decode` on the session with an observer that ends each decode in the streamer
    /// (its failure becomes the error) and records a telemetry row, passed to `on_row` too.
    fn observed<R>(
        &mut self,
        mut on_row: impl FnMut(&TokenRow),
        decode: impl FnOnce(&mut Session<'m>, &mut DecodeObserver<'_, StreamError>) -> Result<R, StreamError>,
    ) -> Result<(R, Vec<TokenRow>), StreamError> {
        let streamer = Arc::clone(&self.streamer);
        let mut rows = Vec::new();
        let mut usage = Usage::sample();
        let mut observer = |event: DecodeEvent| -> Result<(), StreamError> {
            let mut s = lock(&streamer);
            s.end_decode();
            if let Some(e) = s.take_failure() {
                // A read given up for the abort flag: the generation was cancelled.
                return Err(if e.is_cancelled() { GenerateError::Cancelled.into() } else { e });
            }
            let stats = s.take_stats();
            let now = Usage::sample();
            let row = TokenRow::new(rows.len(), event, stats, &usage, &now, s.cache_counters());
            usage = now;
            drop(s);
            on_row(&row);
            rows.push(row);
            Ok(())
        };
        let result = decode(&mut self.session, &mut observer)?;
        Ok((result, rows))
    }

    /// What a slot keeps of a later prompt ([`Session::set_reuse`]).
    pub fn set_reuse(&mut self, reuse: crate::generate::Reuse) {
        self.session.set_reuse(reuse);
    }

    /// Drafts up to `max` tokens per decode from the context's n-grams ([`Session::set_draft`]).
    pub fn set_draft(&mut self, max: Option<usize>) -> Result<(), StreamError> {
        Ok(self.session.set_draft(max)?)
    }

    /// Makes every later decode stop as soon as `flag` is set: the generation then ends with
    /// [`GenerateError::Cancelled`] (in [`StreamError::Generate`]) and the session stays usable.
    /// A read the decode waits for is given up as soon as the flag is set, too.
    pub fn set_abort_flag(&mut self, flag: Option<Arc<std::sync::atomic::AtomicBool>>) {
        lock(&self.streamer).lanes().set_cancel_flag(flag.clone());
        self.session.set_abort_flag(flag);
    }
}

/// The streamer, locked. A lock poisoned by a panic mid-decode is not trusted: the streamer's
/// cache is reset first (its residency may not match the memory).
fn lock(s: &Mutex<Streamer>) -> MutexGuard<'_, Streamer> {
    match s.lock() {
        Ok(guard) => guard,
        Err(poisoned) => {
            let mut guard = poisoned.into_inner();
            log::error!("the streaming engine panicked during a decode: forgetting its expert cache");
            guard.reset_after_panic();
            s.clear_poison();
            guard
        }
    }
}
