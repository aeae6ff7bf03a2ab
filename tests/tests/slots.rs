//! Slots (issue: conversations): a prompt that starts as a slot's memory does computes only the
//! rest, and its greedy tokens equal the same prompt computed from an empty slot, resident and
//! streamed, on every gate fixture; a slot saved and put back (into another slot) goes on as if
//! it had stayed; a state that does not match is refused and leaves the slot empty; with
//! `Reuse::Any` a slot keeps all it holds, the answers too, streamed as resident.

use std::sync::Arc;

use ggml_sys::{Model, Token};
use sluice::generate::{to_end, ContextShape, DecodeObserver, Generation, Reuse, Sampler, Session, SlotUse};
use sluice::stream::{load_streamed_model, DensePolicy, StreamedSession};
use sluice_tests::{gate_fixtures, indexed_fixture, stream_config, PROMPT};

const N: u32 = 8;
/// Two slots, prompts in batches of 8 tokens: what a slot keeps is whole batches, so the short
/// test prompts keep some.
const SHAPE: ContextShape = ContextShape {
    positions: 256,
    slots: 2,
    batch: 8,
    kv: sluice::generate::KvTypes { k: sluice::generate::KvCacheType::F16, v: sluice::generate::KvCacheType::F16 },
};

/// The turns of a conversation: the prompt, then each turn's prompt is the last one, its answer
/// and this text.
const MORE: [&str; 2] = [" Then the dog woke up and ran after the fox.", " The end of the story came soon."];

/// Something that generates in a slot: a resident or a streamed session.
trait Slotted {
    fn run(&mut self, at: SlotUse, prompt: &[Token]) -> Generation;
    fn held_in(&self, slot: u32) -> usize;
    fn keep(&mut self, reuse: Reuse);
}

impl Slotted for Session<'_> {
    fn run(&mut self, at: SlotUse, prompt: &[Token]) -> Generation {
        let mut sampler = Sampler::greedy(self.model()).unwrap();
        let observer: &mut DecodeObserver<'_> = &mut |_| Ok(());
        self.generate_with(at, prompt, N, &mut sampler, to_end(|_, _| {}), observer).unwrap()
    }
    fn held_in(&self, slot: u32) -> usize {
        self.held(slot).len()
    }
    fn keep(&mut self, reuse: Reuse) {
        self.set_reuse(reuse);
    }
}

impl Slotted for StreamedSession<'_> {
    fn run(&mut self, at: SlotUse, prompt: &[Token]) -> Generation {
        let mut sampler = Sampler::greedy(self.model()).unwrap();
        self.generate_with(at, prompt, N, &mut sampler, to_end(|_, _| {}), |_| {}).unwrap().0
    }
    fn held_in(&self, slot: u32) -> usize {
        self.session().held(slot).len()
    }
    fn keep(&mut self, reuse: Reuse) {
        self.set_reuse(reuse);
    }
}

/// A conversation on a slotted session: every turn's tokens.
type Talk = fn(&mut dyn Slotted, &Model, &str) -> Vec<Vec<Token>>;

/// On every gate fixture, `talk` in a resident session and in a streamed one (no cache), both
/// keeping what `reuse` says; the streamed turns must equal the resident ones.
fn streamed_talks_as_resident(reuse: Reuse, talk: Talk) {
    let dir = tempfile::tempdir().unwrap();
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let model = sluice::generate::load_model(&files[0]).unwrap();
        let threads = ggml_sys::Threads::unpinned(2);
        let resident = {
            let mut s = Session::new(&model, SHAPE, &threads, None).unwrap();
            s.keep(reuse);
            talk(&mut s, &model, &format!("{f:?} resident"))
        };
        drop(model);
        let config = stream_config(0, 2, true, DensePolicy::Anon);
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let mut s = StreamedSession::open(&model, Arc::clone(&index), &config, SHAPE, &threads).unwrap();
        s.keep(reuse);
        let streamed = talk(&mut s, &model, &format!("{f:?} streamed"));
        assert_eq!(streamed, resident, "{f:?}: streamed turns differ from resident ones");
    }
}

/// The next turn's prompt: `prompt`, the answer `g` and `more`.
fn next_turn(model: &Model, prompt: &[Token], g: &Generation, more: &str) -> Vec<Token> {
    let mut next = prompt.to_vec();
    next.extend(&g.tokens);
    next.extend(model.tokenize(more, false).unwrap());
    next
}

/// Runs the conversation in slot 0 with reuse, each turn checked against the same prompt in an
/// emptied slot 1; returns every turn's tokens.
fn conversation(s: &mut dyn Slotted, model: &Model, what: &str) -> Vec<Vec<Token>> {
    let mut prompt = model.tokenize(PROMPT, true).unwrap();
    let mut turns = Vec::new();
    // What the slot keeps of the next prompt: the last prompt's whole batches (the answer,
    // decoded a token at a time, and the rest of the prompt are computed again).
    let mut keeps = 0;
    for turn in 0..=MORE.len() {
        let kept = s.run(SlotUse { slot: 0, reuse: true }, &prompt);
        let fresh = s.run(SlotUse { slot: 1, reuse: false }, &prompt);
        assert_eq!(fresh.reused, 0, "{what}: an emptied slot reuses nothing");
        assert_eq!(kept.tokens, fresh.tokens, "{what}, turn {turn}: the reused prefix changed the answer");
        assert_eq!(kept.reused, keeps, "{what}, turn {turn}: reused of {} tokens", prompt.len());
        turns.push(kept.tokens.clone());
        if let Some(more) = MORE.get(turn) {
            keeps = prompt.len() / SHAPE.batch as usize * SHAPE.batch as usize;
            prompt = next_turn(model, &prompt, &kept, more);
        }
    }
    turns
}

#[test]
fn a_conversation_reuses_its_slot_and_answers_as_if_computed_afresh_resident_and_streamed() {
    streamed_talks_as_resident(Reuse::Exact, conversation);
}

#[test]
fn a_saved_slot_put_back_goes_on_as_if_it_had_stayed_and_a_wrong_state_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for f in gate_fixtures() {
        let (files, _) = indexed_fixture(f, dir.path());
        let model = sluice::generate::load_model(&files[0]).unwrap();
        let mut s = Session::new(&model, SHAPE, &ggml_sys::Threads::unpinned(2), None).unwrap();
        let prompt = model.tokenize(PROMPT, true).unwrap();
        let first = s.run(SlotUse { slot: 0, reuse: true }, &prompt);
        let second = next_turn(&model, &prompt, &first, MORE[0]);
        let stayed = s.run(SlotUse { slot: 0, reuse: true }, &second);

        let first = s.run(SlotUse { slot: 0, reuse: false }, &prompt);
        let (tokens, state) = s.save_slot(0).unwrap();
        assert_eq!(tokens, s.held(0));
        s.forget(0).unwrap();
        assert!(s.held(0).is_empty());
        s.restore_slot(1, &tokens, &state).unwrap();
        assert_eq!(s.held(1), &tokens[..]);
        let put_back = s.run(SlotUse { slot: 1, reuse: true }, &second);
        assert_eq!(put_back.tokens, stayed.tokens, "{f:?}: a slot put back answers differently");
        assert_eq!(put_back.reused, stayed.reused, "{f:?}: a slot put back reuses as much as one that stayed");
        assert!(put_back.reused > 0 && first.reused == 0);

        let e = s.restore_slot(0, &tokens, &state[..state.len() / 2]).unwrap_err();
        assert!(e.to_string().contains("refused the saved sequence state"), "{f:?}: {e}");
        assert!(s.held(0).is_empty(), "a refused state leaves the slot empty");
        let e = s.restore_slot(0, &tokens[1..], &state).unwrap_err();
        assert!(e.to_string().contains("another number of positions"), "{f:?}: {e}");
        assert!(s.held(0).is_empty());
        assert!(s.restore_slot(2, &tokens, &state).is_err(), "no slot 2");
    }
}

/// Runs the conversation in slot 0 with any shared prefix kept ([`Reuse::Any`]): each turn keeps
/// all the slot held (the last prompt and the answer's decoded tokens); returns every turn's
/// tokens.
fn conversation_keeping_any(s: &mut dyn Slotted, model: &Model, what: &str) -> Vec<Vec<Token>> {
    let mut prompt = model.tokenize(PROMPT, true).unwrap();
    let mut turns = Vec::new();
    for turn in 0..=MORE.len() {
        let held = s.held_in(0);
        let g = s.run(SlotUse { slot: 0, reuse: true }, &prompt);
        assert_eq!(g.reused, held, "{what}, turn {turn}: all the slot held is kept");
        turns.push(g.tokens.clone());
        if let Some(more) = MORE.get(turn) {
            prompt = next_turn(model, &prompt, &g, more);
        }
    }
    turns
}

#[test]
fn reuse_any_keeps_the_answers_too_and_streamed_equals_resident() {
    streamed_talks_as_resident(Reuse::Any, conversation_keeping_any);
}
