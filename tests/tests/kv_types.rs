//! The KV cache's types (`--cache-type-k`, `--cache-type-v`): a quantized cache streamed gives the
//! resident run's tokens with the same cache, the context holds it at its real size (what the
//! ledger charges), and a type the model's heads cannot take is a clear error, not an abort.

use std::sync::Arc;

use ggml_sys::Threads;
use sluice::generate::{self, ContextShape, GenerateParams, KvCacheType, KvTypes, Session};
use sluice::stream::{load_streamed_model, DensePolicy, StreamedSession};
use sluice::synth::{self, SynthSpec};
use sluice_tests::{indexed_fixture, stream_config, Fixture, PROMPT};

const N: u32 = 12;
const Q8: KvTypes = KvTypes { k: KvCacheType::Q8_0, v: KvCacheType::Q8_0 };

fn resident(path: &std::path::Path, kv: KvTypes) -> Vec<ggml_sys::Token> {
    let model = generate::load_model(path).unwrap();
    let params =
        GenerateParams { n_predict: N, threads: Threads::unpinned(2), draft: None, batch: generate::DEFAULT_BATCH, kv };
    generate::generate(&model, PROMPT, &params, |_, _| {}).unwrap().tokens
}

#[test]
fn a_quantized_kv_cache_streams_as_it_runs_resident_in_its_real_size() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let model = load_streamed_model(&files[0], &index, DensePolicy::Anon, 0).unwrap();
    let prompt = Session::prepare(&model, PROMPT, N).unwrap();
    let shape = |kv| ContextShape { kv, ..ContextShape::one(prompt.len() as u32 + N) };
    let config = stream_config(index.one_token_demand(), 2, true, DensePolicy::Anon);
    let mut session =
        StreamedSession::open(&model, Arc::clone(&index), &config, shape(Q8), &Threads::unpinned(2)).unwrap();
    let (streamed, _) = session.generate(&prompt, N, |_, _| {}, |_| {}).unwrap();
    assert_eq!(streamed.tokens, resident(&files[0], Q8), "streamed with a q8_0 cache differs from resident");
    drop(session);

    let held = |kv| {
        let s = Session::new(&model, shape(kv), &Threads::unpinned(2), None).unwrap();
        s.memory_sizes().context
    };
    let (f16, q8, q4) =
        (held(KvTypes::default()), held(Q8), held(KvTypes { k: KvCacheType::Q4_0, v: KvCacheType::Q4_0 }));
    // q8_0 keeps 34 bytes per 32 values where f16 keeps 64; q4_0 18.
    assert_eq!((q8 * 64, q4 * 64), (f16 * 34, f16 * 18), "f16 {f16}, q8_0 {q8}, q4_0 {q4} bytes");
}

#[test]
fn a_kv_type_the_heads_cannot_take_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    // Heads of 16 values: q8_0's blocks of 32 do not divide them.
    let spec = SynthSpec { embd: 128, heads: 8, kv_heads: 2, ..SynthSpec::default() };
    let path = dir.path().join("narrow-heads.gguf");
    synth::synthesize(&spec, &path, 2).unwrap();
    let model = generate::load_model(&path).unwrap();
    let shape = ContextShape { kv: Q8, ..ContextShape::one(64) };
    let e = Session::new(&model, shape, &Threads::unpinned(2), None).err().expect("refused").to_string();
    assert!(e.contains("K type q8_0") && e.contains("--cache-type-k"), "{e}");
    assert!(Session::new(&model, ContextShape::one(64), &Threads::unpinned(2), None).is_ok());
}
