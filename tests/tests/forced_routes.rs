//! Recorded routes forced on a model (`--routes`): a run's own recorded routes replayed through
//! the engine make the same reads, hits and misses (and text) as the run that recorded them;
//! other routes are followed token by token, and `sluice replay` of the same file predicts the
//! live cache's hits; files of the wrong shape or damaged are refused before anything runs.

use std::sync::Arc;

use sluice::replay::formats::{self, ReadOptions};
use sluice::stream::routes::record::{write_route_csv, RouteCsvHeader};
use sluice::stream::routes::ForcedRoutes;
use sluice::stream::{
    load_streamed_model, CachePolicy, DensePolicy, ExpertIndex, RoutesEnd, StreamConfig, TokenRoutes,
};
use sluice_tests::{indexed_fixture, open_streamed, stream_config, stream_generate, Fixture, StreamRun};

const N: u32 = 12;

/// A streamed run of `config` (its routes recorded), and what it recorded.
fn run(files: &[std::path::PathBuf], index: &Arc<ExpertIndex>, config: &StreamConfig) -> (StreamRun, TokenRoutes) {
    let model = load_streamed_model(&files[0], index, config.dense, 0).unwrap();
    let mut session = open_streamed(&model, Arc::clone(index), config, N);
    let run = stream_generate(&mut session, &model, N);
    let routes = session.streamer().recorded_routes("fixture".into()).expect("recorded");
    (run, routes)
}

/// `routes` written as a route CSV at `path` and read back as `--routes` reads it.
fn through_file(path: &std::path::Path, routes: &TokenRoutes, index: &ExpertIndex, prompt: usize) -> ForcedRoutes {
    let layer_bytes: Vec<u64> = (0..index.n_layer).map(|l| index.expert_window_bytes(l, 0)).collect();
    let header =
        RouteCsvHeader { arch: &index.arch, n_expert_used: index.n_expert_used, layer_bytes: &layer_bytes, prompt };
    write_route_csv(path, routes, header).unwrap();
    let read = formats::read_tokens(path, None).unwrap();
    assert_eq!(&read, &TokenRoutes { model: read.model.clone(), ..routes.clone() }, "the file gives back the routes");
    ForcedRoutes { path: path.into(), routes: Arc::new(read), end: RoutesEnd::Stop }
}

/// The live cache's hits and misses against the replay of the route file at `path`.
fn assert_replay_predicts(path: &std::path::Path, index: &ExpertIndex, config: &StreamConfig, live: &StreamRun) {
    let mut trace = formats::read(path, None, ReadOptions { prompt: true }).unwrap();
    trace.staging = index.layer_token_demand();
    let replayed = sluice::replay::replay(&trace, config.cache_policy, config.cache_bytes).all;
    assert_eq!((replayed.hits, replayed.misses), (live.counters.hits, live.counters.misses), "replay and live differ");
}

#[test]
fn forced_routes_drive_the_reads_and_the_cache_as_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let config = StreamConfig {
        cache_policy: CachePolicy::Adaptive,
        record_routes: true,
        ..stream_config(index.all_expert_window_bytes() / 2, 2, true, DensePolicy::Anon)
    };
    let (own, recorded) = run(&files, &index, &config);
    let prompt = recorded.tokens.len() - (N as usize - 1);
    assert!(recorded.tokens.iter().all(|t| t.iter().all(|l| l.as_ref().is_none_or(|e| e.len() == 2))));

    // The run's own routes forced: the same reads, hits, misses and text.
    let file = dir.path().join("own.route.csv");
    let forced = through_file(&file, &recorded, &index, prompt);
    let forcer = Some(forced.forcer(&index, index.n_expert_used).unwrap());
    let (again, _) = run(&files, &index, &StreamConfig { force_routes: forcer, ..config.clone() });
    assert_eq!(again.tokens, own.tokens);
    assert_eq!(again.trace, own.trace, "the engine planned other routes");
    assert_eq!((again.counters, again.bytes_read), (own.counters, own.bytes_read));
    assert_replay_predicts(&file, &index, &config, &own);

    // Other routes (each expert id moved on by 3): followed token by token.
    let moved = TokenRoutes {
        tokens: recorded
            .tokens
            .iter()
            .map(|t| {
                t.iter().map(|l| l.as_ref().map(|e| e.iter().map(|&x| (x + 3) % index.n_expert).collect())).collect()
            })
            .collect(),
        ..recorded.clone()
    };
    let file = dir.path().join("moved.route.csv");
    let forced = through_file(&file, &moved, &index, prompt);
    let forcer = Some(forced.forcer(&index, index.n_expert_used).unwrap());
    let (other, followed) = run(&files, &index, &StreamConfig { force_routes: forcer, ..config.clone() });
    assert_eq!(followed.tokens, moved.tokens, "the routers did not take the forced routes");
    assert_ne!(other.trace, own.trace);
    assert_replay_predicts(&file, &index, &config, &other);
}

#[test]
fn routes_of_another_shape_or_a_damaged_file_are_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let (_, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let k = index.n_expert_used as usize;
    let token = |e: u32| vec![Some(vec![e; k]); index.n_layer as usize];
    let routes = |tokens| TokenRoutes { model: "m".into(), n_layer: index.n_layer, n_expert: index.n_expert, tokens };
    let refused = |r: TokenRoutes, used: u32| {
        let forced = ForcedRoutes { path: "r.csv".into(), routes: Arc::new(r), end: RoutesEnd::Stop };
        forced.forcer(&index, used).unwrap_err().to_string()
    };
    let e = refused(TokenRoutes { n_layer: index.n_layer + 1, ..routes(vec![token(0)]) }, index.n_expert_used);
    assert!(e.contains("r.csv") && e.contains(&format!("{} layers", index.n_layer + 1)), "{e}");
    let e = refused(routes(vec![token(0), token(index.n_expert)]), index.n_expert_used);
    assert!(e.contains(&format!("token 1 routes expert {}", index.n_expert)), "{e}");
    let e = refused(routes(vec![token(0)]), index.n_expert_used + 1);
    assert!(e.contains(&format!("--experts-used {k}")), "{e}");
    // Fewer experts per token than recorded (`--experts-used`) take the first ones.
    assert!(ForcedRoutes { path: "r.csv".into(), routes: Arc::new(routes(vec![token(1)])), end: RoutesEnd::Stop }
        .forcer(&index, 1)
        .is_ok());

    let path = dir.path().join("bad.route.csv");
    std::fs::write(
        &path,
        "# route_trace v1\n# model=m n_layer=2 n_expert=4\nturn,phase,step,layer,slot,expert\n0,1,0,0,0,x\n",
    )
    .unwrap();
    let e = formats::read_tokens(&path, None).unwrap_err().to_string();
    assert!(e.contains("bad.route.csv") && e.contains("line 4") && e.contains("expert"), "{e}");
}
