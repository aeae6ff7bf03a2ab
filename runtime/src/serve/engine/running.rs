//! The requests the engine generates at once, one per slot: each one's run in its slot and the
//! client it generates for (sampler, answer, events, cancel flag); admitting them into free
//! slots, one decode for all of them at a time, and ending each.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ggml_sys::Model;

use super::answer::Answer;
use super::{Engine, GRAMMAR_TOKEN_BOUND};
use crate::generate::{Chosen, Client, Generation, Run, Sampler};
use crate::serve::error::ApiError;
use crate::serve::job::{Admission, Event, EventSender, Job, Unsent, MAX_UNREAD_BYTES};
use crate::stream::StreamError;

/// A request being generated.
pub(super) struct Running<'m> {
    /// Its generation in its slot.
    pub run: Run,
    /// Who it generates for.
    pub requester: Requester<'m>,
    /// Its place among the admitted requests, given back when it ends.
    pub _admission: Admission,
}

/// What a request's tokens go to: its sampler, its answer and its client's events.
pub(super) struct Requester<'m> {
    pub model: &'m Model,
    pub sampler: Sampler,
    pub answer: Answer,
    pub events: EventSender,
    /// Set when the client goes away or the server stops.
    pub cancel: Arc<AtomicBool>,
    /// The log probabilities asked for.
    pub logprobs: Option<usize>,
}

impl Client for Requester<'_> {
    fn sampler(&mut self) -> &mut Sampler {
        &mut self.sampler
    }

    /// Sends the token's part of the answer; a client that left its answer unread (or went
    /// away) cancels the request, and a stop sequence ends it.
    fn on_token(&mut self, chosen: &Chosen<'_>) -> ControlFlow<()> {
        if let Some(event) = self.answer.take(self.model, chosen, self.logprobs) {
            if let Err(why) = self.events.send(event) {
                if why == Unsent::Unread {
                    log::warn!(
                        "a client left over {} KiB of its answer unread: cancelling its generation",
                        MAX_UNREAD_BYTES >> 10
                    );
                }
                self.cancel.store(true, Ordering::Relaxed);
                return ControlFlow::Break(());
            }
        }
        if self.answer.stopped() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }
}

impl Running<'_> {
    /// Whether its client went away or the server is stopping.
    pub fn cancelled(&self) -> bool {
        self.requester.cancel.load(Ordering::Relaxed)
    }
}

impl<'m> Engine<'m, '_> {
    /// Admits a request into a free slot (or answers why it cannot run).
    pub(super) fn start(&mut self, job: Job) {
        let Job { request, events, cancel, admission } = job;
        self.shared.dequeued();
        if request.unload_after {
            // Once it ends and no other request runs or waits.
            self.shared.ask_unload();
        }
        if cancel.load(Ordering::Relaxed) {
            self.shared.metrics.cancelled();
            return;
        }
        if self.shared.cancelling() {
            let _ = events.send(Event::Failed(ApiError::new(503, "server_error", "the server is shutting down")));
            return;
        }
        let (logprobs, cache_prompt, owner) = (request.logprobs, request.cache_prompt, request.owner.clone());
        let (tokens, max_tokens, mut sampler, answer) = match self.admit(request, &cancel) {
            Ok(admitted) => admitted,
            Err(e) => {
                let _ = events.send(Event::Failed(e));
                return;
            }
        };
        sampler.set_guard(Arc::clone(&cancel), GRAMMAR_TOKEN_BOUND);
        let _ = events.send(Event::Started { prompt_tokens: tokens.len() });
        let pick = self.slots.pick(&mut self.session, self.store.as_mut(), &tokens, cache_prompt, &owner);
        self.slots.start(pick.slot);
        self.publish_slots();
        self.shared.add_running(Arc::clone(&cancel));
        let model = self.session.model();
        let mut requester = Requester { model, sampler, answer, events, cancel, logprobs };
        match self.session.begin(pick, &tokens, max_tokens, &mut requester.sampler) {
            Ok(run) => self.running.push(Running { run, requester, _admission: admission }),
            Err(e) => {
                let failure = self.failure(&e, requester.answer.grammar_param());
                self.ended(pick.slot, tokens.len(), Err(failure), requester);
            }
        }
    }

    /// One decode for the running requests; ends those it finished or failed, and those whose
    /// client went away (between decodes: a decode that carries several requests is stopped only
    /// by the server stopping).
    pub(super) fn step(&mut self) {
        for r in std::mem::take(&mut self.running) {
            if r.cancelled() {
                self.end(r, None);
            } else {
                self.running.push(r);
            }
        }
        let flag = match self.running.as_slice() {
            [] => return,
            [alone] => Arc::clone(&alone.requester.cancel),
            _ => self.shared.stop_flag(),
        };
        self.session.set_abort_flag(Some(flag));
        let shared = self.shared;
        let mut runs: Vec<(&mut Run, &mut dyn Client)> =
            self.running.iter_mut().map(|r| (&mut r.run, &mut r.requester as &mut dyn Client)).collect();
        let result = self.session.step(&mut runs, |row| {
            shared.beat();
            shared.metrics.decode_row(row);
        });
        drop(runs);
        self.session.set_abort_flag(None);
        let failed = result.err();
        for r in std::mem::take(&mut self.running) {
            if r.run.is_over() {
                let failure = failed.as_ref().filter(|_| r.run.stepped());
                self.end(r, failure);
            } else {
                self.running.push(r);
            }
        }
    }

    /// Ends a request: its answer's end, or why it failed (`failure`: the decode that failed
    /// while carrying it).
    fn end(&mut self, r: Running<'m>, failure: Option<&StreamError>) {
        let slot = r.run.slot();
        let prompt = r.run.generation().prompt_tokens.len();
        let result = self.session.end(r.run);
        let result = match failure {
            Some(f) => Err(self.failure(f, r.requester.answer.grammar_param())),
            None => result.map_err(|e| self.failure(&e, r.requester.answer.grammar_param())),
        };
        self.ended(slot, prompt, result, r.requester);
    }

    /// Sends a request's end to its client and frees its slot.
    fn ended(&mut self, slot: u32, prompt: usize, result: Result<Generation, ApiError>, requester: Requester<'m>) {
        self.shared.remove_running(&requester.cancel);
        self.heat_dirty = true;
        self.publish_heat();
        let reused = result.as_ref().map_or(0, |g| g.reused);
        self.slots.finish(slot, reused, prompt - reused);
        self.publish_slots();
        match result {
            Ok(g) => self.finish(&requester.events, &requester.cancel, prompt, &g, requester.answer),
            Err(e) => {
                let _ = requester.events.send(Event::Failed(e));
            }
        }
    }

    /// Fails every running request: the model is about to be loaded again.
    pub(super) fn abandon_all(&mut self) {
        for r in std::mem::take(&mut self.running) {
            let error = ApiError::new(503, "server_error", "generation failed: an RPC worker was lost");
            let (slot, prompt) = (r.run.slot(), r.run.generation().prompt_tokens.len());
            let _ = self.session.end(r.run);
            self.ended(slot, prompt, Err(error), r.requester);
        }
    }
}
