//! Several generations at once (issue: conversations): runs started together, or joining while
//! others decode, share each decode; every run's greedy tokens are the same resident and
//! streamed under the same schedule, on every gate fixture; a run ended mid-way (a client gone)
//! leaves the others' tokens as they were. How often a run beside others gives the tokens it
//! gives alone is printed: llama.cpp's arithmetic depends on a batch's size and routing, so the
//! two may differ in the last bits, and that is reported, not hidden.

use std::sync::Arc;

use ggml_sys::{Model, Token};
use sluice::generate::{
    Callback, Client, ContextShape, DecodeEvent, DecodeObserver, Generation, Run, Sampler, Session, SlotUse,
};
use sluice::stream::{
    load_streamed_model, CachePolicy, DensePolicy, ExpertIndex, StreamConfig, StreamedSession, READ_BOUND,
};
use sluice_tests::{gate_fixtures, indexed_fixture, stream_config, PROMPT};

const N: u32 = 8;
/// Four slots, prompts in batches of 8: the longer prompts have whole batches, which run alone,
/// between steps that carry a token of every decoding run.
const SHAPE: ContextShape = ContextShape {
    positions: 256,
    slots: 4,
    batch: 8,
    kv: sluice::generate::KvTypes { k: sluice::generate::KvCacheType::F16, v: sluice::generate::KvCacheType::F16 },
};

/// The clients' prompts, of different lengths.
const PROMPTS: [&str; 4] = [
    PROMPT,
    "Once upon a time",
    "A long list of things to remember before the trip: the map, the tickets, the keys and the food.",
    "Why is the sky blue?",
];

/// When each client starts and, if it goes away, at which step.
#[derive(Clone, Copy)]
struct Arrival {
    starts_at: usize,
    leaves_at: Option<usize>,
}

/// A session that runs generations step by step: resident or streamed.
trait Stepping {
    fn model(&self) -> &Model;
    fn begin(&mut self, slot: u32, prompt: &[Token], sampler: &mut Sampler) -> Run;
    /// One step; the decode's event.
    fn step(&mut self, runs: &mut [(&mut Run, &mut dyn Client)]) -> Vec<DecodeEvent>;
    fn end(&mut self, run: Run) -> Option<Generation>;
    fn alone(&mut self, prompt: &[Token]) -> Vec<Token>;
}

impl Stepping for Session<'_> {
    fn model(&self) -> &Model {
        Session::model(self)
    }
    fn begin(&mut self, slot: u32, prompt: &[Token], sampler: &mut Sampler) -> Run {
        Session::begin(self, SlotUse { slot, reuse: false }, prompt, N, sampler).unwrap()
    }
    fn step(&mut self, runs: &mut [(&mut Run, &mut dyn Client)]) -> Vec<DecodeEvent> {
        let mut events = Vec::new();
        let observer: &mut DecodeObserver<'_> = &mut |e| {
            events.push(e);
            Ok(())
        };
        Session::step(self, runs, observer).unwrap();
        events
    }
    fn end(&mut self, run: Run) -> Option<Generation> {
        Session::end(self, run).ok()
    }
    fn alone(&mut self, prompt: &[Token]) -> Vec<Token> {
        let mut sampler = Sampler::greedy(Session::model(self)).unwrap();
        let observer: &mut DecodeObserver<'_> = &mut |_| Ok(());
        let at = SlotUse { slot: 0, reuse: false };
        self.generate_with(at, prompt, N, &mut sampler, |_| std::ops::ControlFlow::Continue(()), observer)
            .unwrap()
            .tokens
    }
}

impl Stepping for StreamedSession<'_> {
    fn model(&self) -> &Model {
        StreamedSession::model(self)
    }
    fn begin(&mut self, slot: u32, prompt: &[Token], sampler: &mut Sampler) -> Run {
        StreamedSession::begin(self, SlotUse { slot, reuse: false }, prompt, N, sampler).unwrap()
    }
    fn step(&mut self, runs: &mut [(&mut Run, &mut dyn Client)]) -> Vec<DecodeEvent> {
        let mut events = Vec::new();
        StreamedSession::step(self, runs, |row| {
            events.push(DecodeEvent { n_tokens: row.n_tokens, prefill: row.prefill, runs: row.runs, wall: row.wall })
        })
        .unwrap();
        events
    }
    fn end(&mut self, run: Run) -> Option<Generation> {
        StreamedSession::end(self, run).ok()
    }
    fn alone(&mut self, prompt: &[Token]) -> Vec<Token> {
        let mut sampler = Sampler::greedy(StreamedSession::model(self)).unwrap();
        let at = SlotUse { slot: 0, reuse: false };
        let keep = |_: &sluice::generate::Chosen<'_>| std::ops::ControlFlow::Continue(());
        self.generate_with(at, prompt, N, &mut sampler, keep, |_| {}).unwrap().0.tokens
    }
}

/// What a schedule gave: each client's tokens (`None`: it left), and how many decodes carried
/// tokens of several decoding runs.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<Option<Vec<Token>>>,
    shared_decodes: usize,
}

/// Runs `clients` (client `i` in slot `i` with prompt `i`) step by step until all are over.
fn run_schedule(s: &mut impl Stepping, clients: &[Arrival]) -> Outcome {
    let prompts: Vec<Vec<Token>> = PROMPTS.iter().map(|p| s.model().tokenize(p, true).unwrap()).collect();
    let mut samplers: Vec<Sampler> = clients.iter().map(|_| Sampler::greedy(s.model()).unwrap()).collect();
    let mut runs: Vec<Option<Run>> = clients.iter().map(|_| None).collect();
    let mut tokens = vec![None; clients.len()];
    let mut shared_decodes = 0;
    let mut step = 0;
    while step == 0 || runs.iter().any(Option::is_some) {
        for (i, c) in clients.iter().enumerate() {
            if c.starts_at == step {
                runs[i] = Some(s.begin(i as u32, &prompts[i], &mut samplers[i]));
            }
            if c.leaves_at == Some(step) {
                let run = runs[i].take().expect("a client leaves while it runs");
                assert!(s.end(run).is_none(), "a run ended before it finished is not a generation");
            }
        }
        let mut callbacks: Vec<Callback<'_, _>> = samplers
            .iter_mut()
            .map(|sampler| Callback {
                sampler,
                on_token: |_: &sluice::generate::Chosen<'_>| std::ops::ControlFlow::Continue(()),
            })
            .collect();
        let mut stepping: Vec<(&mut Run, &mut dyn Client)> = runs
            .iter_mut()
            .zip(callbacks.iter_mut())
            .filter_map(|(r, c)| r.as_mut().map(|r| (r, c as &mut dyn Client)))
            .collect();
        for e in s.step(&mut stepping) {
            shared_decodes += usize::from(e.runs > 1);
        }
        drop(stepping);
        for (i, r) in runs.iter_mut().enumerate() {
            if r.as_ref().is_some_and(Run::is_over) {
                let g = s.end(r.take().unwrap()).expect("a finished run");
                tokens[i] = Some(g.tokens);
            }
        }
        step += 1;
    }
    Outcome { tokens, shared_decodes }
}

/// The schedules: 2 and 4 clients started together, 4 joining two steps apart (under an
/// emulator, the last alone: it has runs joining, whole prompt batches and shared decodes).
fn schedules() -> Vec<(&'static str, Vec<Arrival>)> {
    let together = |n: usize| vec![Arrival { starts_at: 0, leaves_at: None }; n];
    let staggered = (0..4).map(|i| Arrival { starts_at: 2 * i, leaves_at: None }).collect();
    if sluice_tests::emulated() {
        return vec![("4 staggered", staggered)];
    }
    vec![("2 together", together(2)), ("4 together", together(4)), ("4 staggered", staggered)]
}

/// The streamed configurations of the shared decodes: no cache, and the adaptive cache of one
/// token's experts, serial and overlapped (under an emulator, that cache serial only). With that
/// cache a decode carrying several runs lets experts pass through: within the staging they are
/// read as loads and given back at the next layer, beyond it they go in waves.
fn stream_configs(index: &ExpertIndex) -> Vec<(&'static str, StreamConfig)> {
    let one_token = index.one_token_demand();
    let adaptive = StreamConfig {
        cache_policy: CachePolicy::Adaptive,
        expert_pool: Some(one_token + index.layer_token_demand()),
        ..stream_config(one_token, 2, true, DensePolicy::Anon)
    };
    let overlapped = StreamConfig { overlap: Some(READ_BOUND), ..adaptive.clone() };
    if sluice_tests::emulated() {
        return vec![("adaptive cache of one token", adaptive)];
    }
    vec![
        ("no cache", stream_config(0, 2, true, DensePolicy::Anon)),
        ("adaptive cache of one token", adaptive),
        ("adaptive cache of one token, overlapped", overlapped),
    ]
}

#[test]
fn runs_together_give_the_same_tokens_resident_and_streamed_and_share_decodes() {
    let dir = tempfile::tempdir().unwrap();
    let (mut same_as_alone, mut runs) = (0, 0);
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let threads = ggml_sys::Threads::unpinned(2);
        let model = sluice::generate::load_model(&files[0]).unwrap();
        let mut resident = Session::new(&model, SHAPE, &threads, None).unwrap();
        let prompts: Vec<Vec<Token>> = PROMPTS.iter().map(|p| model.tokenize(p, true).unwrap()).collect();
        // Under an emulator the comparison with each run alone is left to the native run.
        let emulated = sluice_tests::emulated();
        let alone: Vec<Vec<Token>> =
            if emulated { Vec::new() } else { prompts.iter().map(|p| resident.alone(p)).collect() };
        let expected: Vec<Outcome> = schedules().iter().map(|(_, c)| run_schedule(&mut resident, c)).collect();
        drop(resident);
        drop(model);
        for (cache, config) in stream_configs(&index) {
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let mut streamed = StreamedSession::open(&model, Arc::clone(&index), &config, SHAPE, &threads).unwrap();
            for ((what, clients), want) in schedules().iter().zip(&expected) {
                let got = run_schedule(&mut streamed, clients);
                let what = format!("{f:?}, {cache}, {what}");
                assert_eq!(got, *want, "{what}: streamed differs from resident under the same schedule");
                assert!(got.shared_decodes > 0, "{what}: no decode carried several runs");
                for (i, t) in got.tokens.iter().enumerate() {
                    let t = t.as_ref().expect("every client finishes");
                    assert_eq!(t.len(), N as usize, "{what}: client {i} made {} tokens", t.len());
                    if let Some(a) = alone.get(i) {
                        runs += 1;
                        same_as_alone += usize::from(t == a);
                    }
                }
            }
        }
    }
    println!("runs beside others that gave the tokens they give alone: {same_as_alone} of {runs}");
}

#[test]
fn a_client_that_leaves_mid_batch_leaves_the_others_tokens_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let sample = if sluice_tests::emulated() { 1 } else { usize::MAX };
    for f in gate_fixtures().into_iter().take(sample) {
        let (files, _) = indexed_fixture(f, dir.path());
        let model = sluice::generate::load_model(&files[0]).unwrap();
        let mut s = Session::new(&model, SHAPE, &ggml_sys::Threads::unpinned(2), None).unwrap();
        let stay = Arrival { starts_at: 0, leaves_at: None };
        let all = run_schedule(&mut s, &[stay; 3]);
        let leaves = Arrival { starts_at: 0, leaves_at: Some(4) };
        let one_left = run_schedule(&mut s, &[stay, leaves, stay]);
        assert_eq!(one_left.tokens[1], None);
        assert!(s.held(1).is_empty(), "{f:?}: the slot of a client that left is emptied");
        for i in [0, 2] {
            assert_eq!(one_left.tokens[i], all.tokens[i], "{f:?}: client {i}'s tokens changed when client 1 left");
        }
    }
}
