//! Lossy modes are opt-in: without them streaming is byte-identical to resident (the streaming
//! gates), and each changes what runs only when asked for.

use std::sync::Arc;

use sluice::lossy::Lossy;
use sluice::stream::{load_configured, DensePolicy, ExpertIndex, StreamConfig};
use sluice_tests::{resident_reference, stream_config, streamed, Fixture};

const N: u32 = 20;

fn run(files: &[std::path::PathBuf], index: &Arc<ExpertIndex>, config: &StreamConfig) -> sluice_tests::StreamRun {
    let model = load_configured(&files[0], index, &config.model_load()).unwrap();
    streamed(&model, Arc::clone(index), config, N)
}

fn with(lossy: Lossy, cache_bytes: u64) -> StreamConfig {
    StreamConfig { lossy, ..stream_config(cache_bytes, 2, true, DensePolicy::Anon) }
}

/// The f16 fixture in `dir`: its files, expert index and resident greedy tokens.
fn fixture(dir: &std::path::Path) -> (Vec<std::path::PathBuf>, Arc<ExpertIndex>, Vec<ggml_sys::Token>) {
    let files = Fixture::F16.write(dir);
    let index = Arc::new(ExpertIndex::open(&files[0]).unwrap());
    let reference = resident_reference(&files[0], N);
    (files, index, reference)
}

#[test]
fn fewer_experts_per_token_change_the_output_only_below_the_models_count() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index, reference) = fixture(dir.path());
    let k = index.n_expert_used;
    assert_eq!(k, 2, "the fixture routes each token to 2 experts");

    let own = run(&files, &index, &with(Lossy { experts_used: Some(k), substitute: None }, 0));
    assert_eq!(own.tokens, reference, "--experts-used at the model's own count is exact");

    let fewer = run(&files, &index, &with(Lossy { experts_used: Some(1), substitute: None }, 0));
    let single_token_routes: Vec<usize> =
        fewer.trace.iter().filter(|r| r.decode > 0).map(|r| r.experts.len()).collect();
    assert!(!single_token_routes.is_empty());
    assert!(single_token_routes.iter().all(|&n| n == 1), "one expert per token and layer: {single_token_routes:?}");
    assert_ne!(fewer.tokens, reference, "one expert instead of two changes the output");
    assert!(fewer.bytes_read < own.bytes_read, "{} vs {} bytes", fewer.bytes_read, own.bytes_read);

    let Err(err) =
        load_configured(&files[0], &index, &with(Lossy { experts_used: Some(3), substitute: None }, 0).model_load())
    else {
        panic!("more experts than the model's is refused");
    };
    assert!(err.to_string().contains("--experts-used 3"), "{err}");
}

#[test]
fn substitution_replaces_only_missed_experts_and_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index, reference) = fixture(dir.path());
    let everything = index.n_expert;

    // Without a cache nothing is ever cached, so nothing can be substituted: exact.
    let uncached = run(&files, &index, &with(Lossy { experts_used: None, substitute: Some(everything) }, 0));
    assert_eq!(uncached.tokens, reference);
    assert!(uncached.substituted.iter().all(|&s| s == 0), "{:?}", uncached.substituted);

    // A cache of a quarter of the experts: misses are swapped for cached experts.
    let quarter = index.all_expert_window_bytes() / 4;
    let exact = run(&files, &index, &with(Lossy::default(), quarter));
    assert_eq!(exact.tokens, reference, "the same cache without substitution is exact");
    assert!(exact.substituted.iter().all(|&s| s == 0));
    let lossy = run(&files, &index, &with(Lossy { experts_used: None, substitute: Some(everything) }, quarter));
    assert_eq!(lossy.substituted[0], 0, "the prompt batch is never substituted: {:?}", lossy.substituted);
    let total: u64 = lossy.substituted.iter().sum();
    assert!(total > 0, "misses were substituted: {:?}", lossy.substituted);
    assert!(lossy.bytes_read < exact.bytes_read, "{} vs {} bytes", lossy.bytes_read, exact.bytes_read);
    assert!(
        lossy.counters.misses < exact.counters.misses,
        "substitutes are hits: {} vs {} misses",
        lossy.counters.misses,
        exact.counters.misses
    );
}
