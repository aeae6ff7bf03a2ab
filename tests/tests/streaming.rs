//! Streaming gates: the streamed greedy output equals the resident one, token for token, on every
//! fixture and configuration; the bytes read are exactly what the routes demand; and the gates
//! themselves can fail (streaming from corrupted expert bytes changes the output).

use std::sync::Arc;
use std::time::Duration;

use ggml_sys::GgufFile;
use sluice::generate::GenerateError;
use sluice::stream::{
    kernel, load_streamed_model, CachePolicy, CoresLoad, DecodeOverlap, DensePolicy, ExpertIndex, FaultKind, ReadFault,
    RouteTrace, SlotUse, StreamConfig, StreamError, StreamedSession, READ_BOUND,
};
use sluice_hal::contention::SetLoad;
use sluice_tests::{
    gate_fixtures, indexed_fixture, open_streamed, resident_reference, stream_config, stream_generate, streamed,
    Fixture,
};

const N: u32 = 20;
const UNBOUNDED: u64 = u64::MAX;

#[test]
fn streamed_equals_resident_across_caches_lanes_direct_io_and_dense_policy() {
    let dir = tempfile::tempdir().unwrap();
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        let tiny = 1; // evicts everything but the current layer, every layer
                      // The expert pool as the ledger sizes it: the cache and one token's largest layer.
        let tight = |cache: u64| StreamConfig {
            expert_pool: Some(cache + index.layer_token_demand()),
            ..stream_config(cache, 2, true, DensePolicy::Anon)
        };
        let configs = [
            ("cache off, the ledger's pool", tight(0)),
            ("cache holds everything", stream_config(UNBOUNDED, 2, true, DensePolicy::Anon)),
            ("cache evicts every layer, the ledger's pool", tight(tiny)),
            (
                "frequency cache of one token, the ledger's pool",
                StreamConfig { cache_policy: CachePolicy::Frequency, ..tight(index.one_token_demand()) },
            ),
            (
                "fresh pages, evicting",
                StreamConfig { expert_pool: None, ..stream_config(tiny, 2, true, DensePolicy::Anon) },
            ),
            ("1 lane", stream_config(0, 1, true, DensePolicy::Anon)),
            ("4 lanes", stream_config(0, 4, true, DensePolicy::Anon)),
            ("buffered reads", stream_config(0, 2, false, DensePolicy::Anon)),
            ("dense mmap", stream_config(0, 2, true, DensePolicy::Mmap)),
            ("dense mmap, buffered, evicting", stream_config(tiny, 1, false, DensePolicy::Mmap)),
        ];
        for (what, config) in configs {
            if config.expert_pool.is_none() && sluice_tests::emulated() {
                continue; // fresh pages are the same code on every architecture: checked natively
            }
            // A fresh model per configuration: streaming rebinds the model's tensors.
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let run = streamed(&model, Arc::clone(&index), &config, N);
            assert_eq!(run.tokens, reference, "{f:?}, {what}: streamed output differs from resident");
            assert!(run.bytes_read > 0, "{f:?}, {what}: nothing was streamed");
            if config.expert_pool.is_some() {
                assert!(run.slots.bytes > 0, "{f:?}, {what}: no expert pool");
                // A prompt batch that ggml-cpu computes (its tiled K-quant path: 8 tokens or
                // more) keeps its whole layer, beyond the cache and staging the pool holds.
                let native_prompt = index.experts.iter().any(|t| !kernel::computes(t.ty, 8));
                if !native_prompt {
                    assert_eq!(run.slots.misses, 0, "{f:?}, {what}: a read found no free pool pages");
                }
            } else {
                assert_eq!(run.slots, SlotUse::default(), "{f:?}, {what}: a pool made when switched off");
            }
            assert_through_kernel(&run, &index, &format!("{f:?}, {what}"));
        }
    }
}

/// Checks that every single-token decode of `run` computed each of the model's routed products
/// (one per expert tensor) in the streamed-experts kernel.
fn assert_through_kernel(run: &sluice_tests::StreamRun, index: &ExpertIndex, what: &str) {
    assert!(!run.kernel_nodes.is_empty(), "{what}: no single-token decode");
    let all = index.experts.len() as u64;
    assert!(
        run.kernel_nodes.iter().all(|&n| n == all),
        "{what}: kernel products per decode {:?}, want {all}",
        run.kernel_nodes
    );
}

#[test]
fn the_kernel_takes_streamed_experts_only_a_resident_model_keeps_the_native_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let config = stream_config(0, 2, true, DensePolicy::Anon);
    let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
    let (mut session, tokens) = open_session(&model, &index, &config);
    let run = stream_generate(&mut session, &model, N);
    assert_through_kernel(&run, &index, "streamed");

    // The same file loaded resident while the streamed session lives: the same tensor names,
    // other tensors, and ggml's own kernel for every routed product.
    let resident = sluice::generate::load_model(&files[0]).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let callback: ggml_sys::EvalCallback<'_> = Box::new(move |t, phase| {
        if phase == ggml_sys::EvalPhase::Ask && t.op_name() == "MUL_MAT_ID" {
            let weights = t.src(0).map(|w| w.name().to_string()).unwrap_or_default();
            let kernel = ggml_sys::ext::selected_kernel(ggml_sys::ext::Device::cpu(), t);
            record.lock().unwrap().push((weights, kernel));
        }
        false
    });
    let mut plain = sluice::generate::Session::new(
        &resident,
        sluice::generate::ContextShape::one(64),
        &ggml_sys::Threads::unpinned(2),
        Some(callback),
    )
    .unwrap();
    plain.warm_up(tokens[0]).unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), index.experts.len(), "one routed product per expert tensor: {seen:?}");
    for (weights, kernel) in seen.iter() {
        assert!(index.expert_by_name(weights).is_some(), "{weights} is an expert tensor's name");
        assert_eq!(kernel, &None, "{weights} of the resident model");
    }
    drop(seen);
    // And the streamed session still computes through the kernel.
    assert_through_kernel(&stream_generate(&mut session, &model, N), &index, "streamed, after");
}

/// `config` with overlap on (each wait bounded by `bound`).
fn overlapped(mut config: sluice::stream::StreamConfig, bound: Duration) -> sluice::stream::StreamConfig {
    config.overlap = Some(bound);
    config
}

#[test]
fn overlapped_streaming_equals_resident_across_caches_lanes_and_direct_io() {
    let dir = tempfile::tempdir().unwrap();
    let bound = sluice::stream::READ_BOUND;
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        let configs = [
            ("cache off", stream_config(0, 2, true, DensePolicy::Anon)),
            ("cache evicts every layer", stream_config(1, 2, true, DensePolicy::Anon)),
            ("cache holds everything", stream_config(UNBOUNDED, 2, true, DensePolicy::Anon)),
            ("1 lane", stream_config(0, 1, true, DensePolicy::Anon)),
            ("4 lanes", stream_config(0, 4, true, DensePolicy::Anon)),
            ("buffered reads", stream_config(0, 2, false, DensePolicy::Anon)),
            ("buffered, evicting, dense mmap", stream_config(1, 1, false, DensePolicy::Mmap)),
            (
                "prompt batches only",
                StreamConfig { overlap_decodes: DecodeOverlap::Never, ..stream_config(1, 2, true, DensePolicy::Anon) },
            ),
        ];
        for (what, config) in configs {
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let run = streamed(&model, Arc::clone(&index), &overlapped(config, bound), N);
            assert_eq!(run.tokens, reference, "{f:?}, overlap, {what}: output differs from resident");
            assert!(run.bytes_read > 0, "{f:?}, overlap, {what}: nothing was streamed");
            assert_through_kernel(&run, &index, &format!("{f:?}, overlap, {what}"));
        }
    }
}

/// `overlap = "auto"`: while other processes keep the cores busy every decode reads serially,
/// and once they leave them idle decodes overlap; the tokens equal the resident run's either way.
/// The load is the test's ([`SetLoad`]), not the machine's: hal's contention test measures that.
#[test]
fn decodes_overlap_only_while_no_other_process_keeps_the_cores_busy() {
    if sluice_tests::emulated() {
        eprintln!("skipped: the choice is the same code on every architecture (runs natively)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = gate_fixtures()[0];
    let (files, index) = indexed_fixture(f, dir.path());
    let reference = resident_reference(&files[0], N);
    let load = SetLoad::new(Some(2.0));
    let config = StreamConfig {
        overlap_decodes: DecodeOverlap::WhenIdle,
        cores_load: CoresLoad::Set(load.clone()),
        ..overlapped(stream_config(0, 2, true, DensePolicy::Anon), sluice::stream::READ_BOUND)
    };
    let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();

    let mut session = open_streamed(&model, Arc::clone(&index), &config, N);
    let run = stream_generate(&mut session, &model, N);
    assert_eq!(run.tokens, reference, "{f:?}, busy cores: output differs from resident");
    assert_eq!(run.overlapped_layers, 0, "{f:?}: decodes overlapped while two other CPUs were busy");

    load.set(Some(0.0));
    let run = stream_generate(&mut session, &model, N);
    assert_eq!(run.tokens, reference, "{f:?}, idle: output differs from resident");
    assert!(run.overlapped_layers > 0, "{f:?}: no decode overlapped on idle cores");
    assert_through_kernel(&run, &index, &format!("{f:?}, auto overlap"));
}

#[test]
fn reads_ahead_on_the_next_layers_guess_change_no_token_and_no_cache_decision() {
    if sluice_tests::emulated() {
        eprintln!("skipped: the guess and the drops are the same code on every architecture (runs natively)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        // The expert pool as the ledger sizes it, and a cache of one token's experts or of half
        // of them: each guess then evicts what the cache ranks lowest.
        let ahead = |cache: u64, policy: CachePolicy| StreamConfig {
            lookahead: true,
            cache_policy: policy,
            expert_pool: Some(cache + index.layer_token_demand()),
            ..stream_config(cache, 2, true, DensePolicy::Anon)
        };
        let half = index.all_expert_window_bytes() / 2;
        let configs = [
            ("serial, a cache of one token", ahead(index.one_token_demand(), CachePolicy::Lru)),
            ("serial, frequency cache of half", ahead(half, CachePolicy::Frequency)),
            (
                "overlapped, a cache of one token",
                overlapped(ahead(index.one_token_demand(), CachePolicy::Lru), READ_BOUND),
            ),
            ("1 lane, buffered, fresh pages", StreamConfig { expert_pool: None, ..ahead(half, CachePolicy::Lru) }),
            // The adaptive cache lets experts pass through a single token's layer: read ahead
            // or not, their memory must stay until the layer has computed them.
            ("serial, adaptive cache of one token", ahead(index.one_token_demand(), CachePolicy::Adaptive)),
            ("overlapped, adaptive cache of half", overlapped(ahead(half, CachePolicy::Adaptive), READ_BOUND)),
        ];
        for (what, config) in configs {
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let run = streamed(&model, Arc::clone(&index), &config, N);
            assert_eq!(run.tokens, reference, "{f:?}, lookahead, {what}: output differs from resident");
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let without = streamed(&model, Arc::clone(&index), &StreamConfig { lookahead: false, ..config }, N);
            // The reads ahead land outside the cache: it routes, hits, misses and evicts as
            // without them.
            assert_eq!(run.trace, without.trace, "{f:?}, lookahead, {what}: other routes");
            assert_eq!(run.counters, without.counters, "{f:?}, lookahead, {what}: other cache decisions");
            if !index.experts.iter().any(|t| !kernel::computes(t.ty, 8)) {
                // The reads ahead fit the pool's staging (see the first gate for the exception).
                assert_eq!(run.slots.misses, 0, "{f:?}, lookahead, {what}: a read found no free pool pages");
            }
            let (reads, used) = run.lookahead;
            assert!(reads > 0, "{f:?}, lookahead, {what}: nothing was read ahead");
            assert!(used <= reads, "{f:?}, lookahead, {what}: {used} of {reads} reads ahead used");
            assert!(
                run.router_copies > 0 && run.router_copies <= index.router_copy_bytes(),
                "{f:?}, lookahead, {what}: router copies of {} bytes, the ledger's line {}",
                run.router_copies,
                index.router_copy_bytes()
            );
            assert_through_kernel(&run, &index, &format!("{f:?}, lookahead, {what}"));
        }
    }
}

/// A streamed session over `files` with `config`, and the prompt's tokens.
fn open_session<'m>(
    model: &'m ggml_sys::Model,
    index: &Arc<ExpertIndex>,
    config: &sluice::stream::StreamConfig,
) -> (StreamedSession<'m>, Vec<ggml_sys::Token>) {
    let tokens = model.tokenize(sluice_tests::PROMPT, true).unwrap();
    let session = StreamedSession::open(
        model,
        Arc::clone(index),
        config,
        sluice::generate::ContextShape::one(tokens.len() as u32 + N),
        &ggml_sys::Threads::unpinned(2),
    )
    .unwrap();
    (session, tokens)
}

/// The read injected faults strike: reads 1..=k come from the dense weights at open, so this
/// one falls well into the decodes.
fn fault_read(index: &ExpertIndex) -> u64 {
    index.dense.len() as u64 + 40
}

/// Two lanes, no cache, and the fault `kind` at [`fault_read`]; overlapped with each wait
/// bounded by `overlap`, or serial.
fn faulty_config(index: &ExpertIndex, kind: FaultKind, overlap: Option<Duration>) -> sluice::stream::StreamConfig {
    let mut config = stream_config(0, 2, true, DensePolicy::Anon);
    config.lanes.fault = Some(ReadFault { at: fault_read(index), kind });
    match overlap {
        Some(bound) => overlapped(config, bound),
        None => config,
    }
}

#[test]
fn a_failing_read_under_overlap_ends_the_generation_with_an_error_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    for overlap in [true, false] {
        // A one-second bound: even a lost wake-up could not hang the test.
        let config = faulty_config(&index, FaultKind::Eio, overlap.then_some(Duration::from_secs(1)));
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let (mut session, tokens) = open_session(&model, &index, &config);
        let err = session.generate(&tokens, N, |_, _| {}, |_| {}).expect_err("the injected read failure must surface");
        let msg = err.to_string();
        assert!(msg.contains("reading expert") && msg.contains("of layer"), "overlap {overlap}: {msg}");
        assert!(msg.contains("Input/output error"), "overlap {overlap}: the failure itself, not a timeout: {msg}");
        // The session survives: the next generation (no more injected failures) matches resident.
        let again = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap().0.tokens;
        assert_eq!(again, resident_reference(&files[0], N), "overlap {overlap}: a failure must not poison the cache");
    }
}

#[test]
fn a_reader_that_panics_fails_the_decode_and_the_session_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let reference = resident_reference(&files[0], N);
    for overlap in [false, true] {
        let config = faulty_config(&index, FaultKind::Panic, overlap.then_some(Duration::from_secs(5)));
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let (mut session, tokens) = open_session(&model, &index, &config);
        let err = session.generate(&tokens, N, |_, _| {}, |_| {}).expect_err("the panicking reader must surface");
        let msg = err.to_string();
        assert!(msg.contains("reader thread panicked") && msg.contains("of layer"), "overlap {overlap}: {msg}");
        let again = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap().0.tokens;
        assert_eq!(again, reference, "overlap {overlap}: the next generation after a reader panic");
    }
}

#[test]
fn a_read_that_never_returns_fails_within_the_bound_or_at_a_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let reference = resident_reference(&files[0], N);
    for (overlap, cancel) in [(false, false), (false, true), (true, false), (true, true)] {
        // Two lanes: one stays stuck in its read; the other serves what follows.
        let bound = if cancel { Duration::from_secs(600) } else { Duration::from_secs(1) };
        let mut config = faulty_config(&index, FaultKind::Hang, overlap.then_some(bound));
        config.lanes.bound = bound;
        let at = fault_read(&index);
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let (mut session, tokens) = open_session(&model, &index, &config);
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        session.set_abort_flag(Some(Arc::clone(&flag)));
        // Cancel once the hanging read has begun (however slow the machine or emulator).
        let canceller = cancel.then(|| {
            let (flag, lanes) = (Arc::clone(&flag), Arc::clone(session.streamer().lanes()));
            std::thread::spawn(move || {
                while lanes.reads_begun() < at {
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::thread::sleep(Duration::from_millis(300));
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            })
        });
        let err = session.generate(&tokens, N, |_, _| {}, |_| {}).expect_err("a stuck read must not hang the decode");
        if let Some(c) = canceller {
            c.join().unwrap();
            assert!(
                matches!(err, StreamError::Generate(GenerateError::Cancelled)),
                "overlap {overlap}: a cancel ends it: {err}"
            );
        } else {
            let msg = err.to_string();
            assert!(msg.contains("not read within 1.0 s") && msg.contains("of layer"), "overlap {overlap}: {msg}");
        }
        flag.store(false, std::sync::atomic::Ordering::Relaxed);
        let again = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap().0.tokens;
        assert_eq!(again, reference, "overlap {overlap}, cancel {cancel}: the next generation");
    }
}

#[test]
fn reads_that_land_after_their_batch_was_given_up_are_released_not_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let reference = resident_reference(&files[0], N);
    // mincore and madvise are the emulator's under qemu-user: the byte counts are checked natively.
    let count_bytes = !sluice_tests::emulated();
    for overlap in [false, true] {
        // One read lands only once its batch was given up at the bound: the engine has released
        // what the batch was loading by then, and that read writes its pages again.
        let bound = Duration::from_secs(1);
        let mut config = faulty_config(&index, FaultKind::Late, overlap.then_some(bound));
        config.lanes.bound = bound;
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let (mut session, tokens) = open_session(&model, &index, &config);
        let err = session.generate(&tokens, N, |_, _| {}, |_| {}).expect_err("the late read fails its batch");
        assert!(err.to_string().contains("not read within 1.0 s"), "overlap {overlap}: {err}");
        let lanes = Arc::clone(session.streamer().lanes());
        for _ in 0..6000 {
            if lanes.idle() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(lanes.idle(), "overlap {overlap}: the late read never finished");
        let mut s = session.streamer();
        if count_bytes {
            assert!(
                s.resident_expert_bytes() > s.cache_used(),
                "overlap {overlap}: the late read did not write released pages, so nothing here is tested"
            );
        }
        // What the server does while idle, and the engine before its next batch.
        s.release_stale();
        if count_bytes {
            assert!(
                s.resident_expert_bytes() <= s.cache_used(),
                "overlap {overlap}: {} bytes of experts in RAM, the cache accounts {}",
                s.resident_expert_bytes(),
                s.cache_used()
            );
        }
        drop(s);
        let again = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap().0.tokens;
        assert_eq!(again, reference, "overlap {overlap}: the next generation");
    }
}

#[test]
fn a_model_file_changed_under_a_session_fails_its_reads_and_never_gives_wrong_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let reference = resident_reference(&files[0], N);
    let original = std::fs::read(&files[0]).unwrap();
    type Change<'a> = (&'a str, &'a dyn Fn(&std::path::Path));
    let changes: [Change<'_>; 3] = [
        ("truncated", &|p| {
            std::fs::OpenOptions::new().write(true).open(p).unwrap().set_len(original.len() as u64 / 2).unwrap()
        }),
        ("modified", &|p| {
            std::thread::sleep(Duration::from_millis(20)); // a visibly later modification time
            std::fs::write(p, &original).unwrap()
        }),
        ("replaced", &|p| {
            let tmp = p.with_extension("new");
            std::fs::write(&tmp, &original).unwrap();
            std::fs::rename(&tmp, p).unwrap();
        }),
    ];
    for (what, change) in changes {
        std::fs::write(&files[0], &original).unwrap();
        let config = stream_config(0, 2, true, DensePolicy::Anon);
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let (mut session, tokens) = open_session(&model, &index, &config);
        assert_eq!(session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap().0.tokens, reference);
        change(&files[0]);
        let err = session.generate(&tokens, N, |_, _| {}, |_| {}).expect_err("a changed file must fail the reads");
        let msg = err.to_string();
        let name = files[0].display().to_string();
        assert!(msg.contains(&name) && msg.contains("of layer"), "{what}: {msg}");
        let why = if what == "truncated" { "truncated" } else { "changed since it was opened" };
        assert!(msg.contains(why), "{what}: {msg}");
    }
}

/// The bytes the lanes read for `experts` of `layer` in one batch, computed straight from the
/// GGUF headers (independently of the engine's index): each expert's page-aligned window of each
/// expert tensor, where windows of one tensor that follow each other in the file go as one
/// request of at most `max_request` bytes (a page two neighbours share read once), clipped to
/// the file's end.
fn read_bytes(files: &[std::path::PathBuf], layer: u32, experts: &[u32], max_request: u64) -> u64 {
    let page = ggml_sys::page_size();
    let mut sum = 0;
    for f in files {
        let g = GgufFile::open(f).unwrap();
        for t in g
            .tensors()
            .iter()
            .filter(|t| t.name.starts_with(&format!("blk.{layer}.")) && t.name.ends_with("_exps.weight"))
        {
            let stride = t.nb()[2];
            let mut windows: Vec<(u64, u64)> = experts
                .iter()
                .map(|&e| {
                    let start = (t.offset + u64::from(e) * stride) / page * page;
                    (start, (t.offset + u64::from(e + 1) * stride).div_ceil(page) * page)
                })
                .collect();
            windows.sort_unstable();
            let mut run: Option<(u64, u64)> = None;
            for (start, end) in windows {
                run = match run {
                    Some((s, e)) if start <= e && end.max(e) - s <= max_request => Some((s, end.max(e))),
                    Some((s, e)) => {
                        sum += e.min(g.file_size()) - s;
                        Some((start, end))
                    }
                    None => Some((start, end)),
                };
            }
            sum += run.map_or(0, |(s, e)| e.min(g.file_size()) - s);
        }
    }
    sum
}

#[test]
fn bytes_read_match_the_routes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        // No cache: every decode reads each layer's distinct routed experts once.
        let model = load_streamed_model(&files[0], &index, DensePolicy::Anon, 0).unwrap();
        let config = stream_config(0, 2, true, DensePolicy::Anon);
        let max_request = config.lanes.max_request as u64;
        let run = streamed(&model, Arc::clone(&index), &config, N);
        let staging = index.layer_token_demand();
        let expected: u64 = run
            .trace
            .iter()
            .map(|r| {
                let incoming: u64 = r.experts.iter().map(|&e| index.expert_window_bytes(r.layer, e)).sum();
                if r.staged && incoming > staging {
                    // Beyond the staging with no cache every expert passes through, each read
                    // alone (given back once computed).
                    r.experts.iter().map(|&e| read_bytes(&files, r.layer, &[e], max_request)).sum()
                } else {
                    read_bytes(&files, r.layer, &r.experts, max_request)
                }
            })
            .sum();
        assert_eq!(run.bytes_read, expected, "{f:?}: cache off");
        let routed: usize = run.trace.iter().map(|r| r.experts.len()).sum();
        assert_eq!(run.counters.misses as usize, routed, "{f:?}: with no cache every routed expert is a miss");
        // The routes vary across tokens: not every decode picks the same experts in the first
        // MoE layer.
        let first = index.moe_layers().next().unwrap();
        let routes: std::collections::BTreeSet<_> =
            run.trace.iter().filter(|r| r.layer == first).map(|r| r.experts.clone()).collect();
        assert!(routes.len() > 1, "{f:?}: routing never changes");

        // An unbounded cache reads every expert at most once.
        let model = load_streamed_model(&files[0], &index, DensePolicy::Anon, 0).unwrap();
        let run = streamed(&model, Arc::clone(&index), &stream_config(UNBOUNDED, 2, true, DensePolicy::Anon), N);
        let distinct: std::collections::BTreeSet<(u32, u32)> =
            run.trace.iter().flat_map(|r| r.experts.iter().map(move |&e| (r.layer, e))).collect();
        assert_eq!(run.counters.rereads, 0, "{f:?}");
        assert_eq!(run.counters.misses as usize, distinct.len(), "{f:?}");
        // Each batch reads the experts its layer had not routed before.
        let mut seen = std::collections::BTreeSet::new();
        let expected: u64 = run
            .trace
            .iter()
            .map(|r| {
                let new: Vec<u32> = r.experts.iter().copied().filter(|&e| seen.insert((r.layer, e))).collect();
                read_bytes(&files, r.layer, &new, max_request)
            })
            .sum();
        assert_eq!(run.bytes_read, expected, "{f:?}: unbounded cache");
    }
}

#[test]
fn a_warm_session_equals_cold_runs_and_survives_a_shrinking_budget() {
    let dir = tempfile::tempdir().unwrap();
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        let model = load_streamed_model(&files[0], &index, DensePolicy::Anon, 0).unwrap();
        let prompt_len = sluice::generate::Session::prepare(&model, sluice_tests::PROMPT, N).unwrap().len() as u32;
        let config = stream_config(UNBOUNDED, 2, true, DensePolicy::Anon);
        let mut session = StreamedSession::open(
            &model,
            Arc::clone(&index),
            &config,
            sluice::generate::ContextShape::one(prompt_len + N),
            &ggml_sys::Threads::unpinned(2),
        )
        .unwrap();
        let first = stream_generate(&mut session, &model, N);
        let second = stream_generate(&mut session, &model, N);
        assert_eq!(first.tokens, reference, "{f:?}: first generation");
        assert_eq!(second.tokens, reference, "{f:?}: second (warm) generation");
        assert!(second.counters.hits > first.counters.hits, "{f:?}: the warm generation hits the cache");
        assert_eq!(second.bytes_read, 0, "{f:?}: everything was already resident");
        // Shrink the budget to one token's demand: the next generation evicts down to it.
        let small = index.one_token_demand();
        session.streamer().set_cache_budget(small);
        let third = stream_generate(&mut session, &model, N);
        assert_eq!(third.tokens, reference, "{f:?}: after shrinking the budget");
        assert!(third.counters.evictions > 0, "{f:?}: shrinking evicts");
        assert!(
            session.streamer().cache_used() <= small.max(index.max_expert_window_bytes() * u64::from(index.n_expert)),
            "{f:?}: over budget"
        );
    }
}

#[test]
fn the_model_on_tmpfs_streams_the_same() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: no /dev/shm tmpfs on this machine");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    for f in gate_fixtures().into_iter().take(2) {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        let model = load_streamed_model(&files[0], &index, DensePolicy::Anon, 0).unwrap();
        // Direct I/O is asked for; where tmpfs rejects it the lanes fall back to buffered.
        let run = streamed(&model, Arc::clone(&index), &stream_config(0, 2, true, DensePolicy::Anon), N);
        assert_eq!(run.tokens, reference, "{f:?} on tmpfs (direct I/O: {})", run.direct);
    }
}

#[test]
fn each_layout_indexes_the_experts_llama_cpp_routes_and_lists_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (_files, ds) = indexed_fixture(Fixture::Deepseek2, dir.path());
    assert!(ds.verified);
    assert_eq!((ds.n_layer, ds.nextn_layers), (3, 1), "the NextN block is not a layer llama.cpp runs");
    assert_eq!(ds.moe_layers().collect::<Vec<_>>(), vec![1, 2], "layer 0 is dense");
    assert!(!ds.not_run.is_empty() && ds.not_run.iter().all(|t| t.name.starts_with("blk.3.")));
    assert!(ds.experts.iter().all(|t| t.layer == 1 || t.layer == 2));
    assert!(ds.dense.iter().any(|t| t.name == "blk.1.ffn_gate_shexp.weight"), "shared experts stay resident");
    assert_eq!(ds.resident_expert_tensors().count(), 0);
    let per_layer: u64 = (0..ds.n_expert).map(|e| ds.expert_window_bytes(1, e)).max().unwrap();
    assert_eq!(ds.one_token_demand(), 2 * 2 * per_layer, "2 MoE layers x top-2 equal experts");

    let (_files, fused) = indexed_fixture(Fixture::Deepseek2Fused, dir.path());
    assert_eq!(fused.expert_kinds(), vec!["ffn_down_exps", "ffn_gate_up_exps"]);

    let (_files, oss) = indexed_fixture(Fixture::GptOss, dir.path());
    assert!(oss.experts.iter().all(|t| t.ty == ggml_sys::GgmlType::MXFP4));
    let biases: Vec<&str> = oss.resident_expert_tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(biases.len(), 3 * 2, "{biases:?}");
    assert!(biases.iter().all(|n| n.ends_with("_exps.bias")), "per-expert biases stay resident: {biases:?}");
}

/// Opens a streamed session over `index` (a fixture's, altered) and returns its error.
fn open_error(files: &[std::path::PathBuf], index: ExpertIndex) -> String {
    let model = load_streamed_model(&files[0], &index, DensePolicy::Mmap, 0).unwrap();
    let config = stream_config(0, 2, true, DensePolicy::Mmap);
    let opened = StreamedSession::open(
        &model,
        Arc::new(index),
        &config,
        sluice::generate::ContextShape::one(64),
        &ggml_sys::Threads::unpinned(2),
    );
    match opened {
        Ok(_) => panic!("a session opened over an index the graph contradicts"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn experts_the_graph_does_not_route_as_indexed_fail_the_warm_up_with_the_tensor_named() {
    let dir = tempfile::tempdir().unwrap();
    let files = Fixture::F16.write(dir.path());
    // An expert tensor the index places in another layer than the router that selects it.
    let mut index = ExpertIndex::open(&files[0]).unwrap();
    let k = index.experts.iter().position(|t| t.layer == 0).unwrap();
    index.experts[k].layer = 1;
    let err = open_error(&files, index);
    assert!(err.contains("blk.0.ffn_") && err.contains("ffn_moe_topk-1") && err.contains("--resident"), "{err}");
    // An indexed expert tensor the graph never uses.
    let mut index = ExpertIndex::open(&files[0]).unwrap();
    let mut ghost = index.experts[0].clone();
    ghost.name = "blk.0.ffn_ghost_exps.weight".into();
    index.experts.push(ghost);
    let err = open_error(&files, index);
    assert!(err.contains("blk.0.ffn_ghost_exps.weight") && err.contains("--resident"), "{err}");
}

#[test]
fn streaming_from_corrupted_expert_bytes_changes_the_output() {
    // The gates above can fail: if the engine streams the wrong bytes, the tokens change.
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::F32, dir.path());
    let reference = resident_reference(&files[0], N);
    let mut bytes = std::fs::read(&files[0]).unwrap();
    for t in &index.experts {
        for b in &mut bytes[t.offset as usize..(t.offset + t.size) as usize] {
            *b = b.rotate_left(3);
        }
    }
    let corrupt = dir.path().join("corrupt.gguf");
    std::fs::write(&corrupt, &bytes).unwrap();
    let mut bad_index = ExpertIndex::open(&files[0]).unwrap();
    bad_index.shards = vec![corrupt];
    let model = load_streamed_model(&files[0], &bad_index, DensePolicy::Mmap, 0).unwrap();
    let run = streamed(&model, Arc::new(bad_index), &stream_config(0, 2, true, DensePolicy::Mmap), N);
    assert_ne!(run.tokens, reference, "streamed expert bytes do not reach the computation");
}

#[test]
fn models_that_cannot_stream_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, b"not a model").unwrap();
    assert!(ExpertIndex::open(&p).is_err());
    let (_files, index) = indexed_fixture(Fixture::F16, dir.path());
    let err = sluice::stream::check_cache_budget(&index, 1, false).unwrap_err().to_string();
    assert!(err.contains("below one token's routed demand") && err.contains("--cache-mb"), "{err}");
    assert!(sluice::stream::check_cache_budget(&index, 0, false).is_ok(), "0 means no cache");
    assert!(sluice::stream::check_cache_budget(&index, index.one_token_demand(), false).is_ok());
}

#[test]
fn a_panicking_eval_callback_fails_the_decode_instead_of_half_computing_it() {
    let dir = tempfile::tempdir().unwrap();
    let (files, _) = indexed_fixture(Fixture::F16, dir.path());
    let model = sluice::generate::load_model_with(&files[0], &ggml_sys::ModelParams::default()).unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let callback: ggml_sys::EvalCallback<'_> = Box::new(move |_, phase| {
        if phase == ggml_sys::EvalPhase::Computed && seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 3 {
            panic!("injected panic in the eval callback");
        }
        true
    });
    let mut session = sluice::generate::Session::new(
        &model,
        sluice::generate::ContextShape::one(64),
        &ggml_sys::Threads::unpinned(1),
        Some(callback),
    )
    .unwrap();
    let err = session.warm_up(1).expect_err("the decode must fail");
    assert!(err.to_string().contains("eval callback panicked during the decode"), "{err}");
    // The next decode runs the callback again and succeeds.
    calls.store(100, std::sync::atomic::Ordering::SeqCst);
    session.warm_up(1).unwrap();
}

#[test]
fn a_streamer_poisoned_by_a_panic_forgets_its_cache_and_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let (files, index) = indexed_fixture(Fixture::Q8_0, dir.path());
    let reference = resident_reference(&files[0], N);
    let config = stream_config(UNBOUNDED, 2, true, DensePolicy::Anon);
    let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
    let (mut session, tokens) = open_session(&model, &index, &config);
    assert_eq!(session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap().0.tokens, reference);
    assert!(session.streamer().cache_used() > 0);
    // A panic while the streamer is locked poisons it.
    let poisoned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _streamer = session.streamer();
        panic!("injected panic while the streamer is locked");
    }));
    assert!(poisoned.is_err());
    assert_eq!(session.streamer().cache_used(), 0, "a poisoned streamer's cache is not trusted");
    let (again, rows) = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap();
    assert_eq!(again.tokens, reference);
    assert!(rows.iter().map(|r| r.bytes_read).sum::<u64>() > 0, "the experts were read again");
}

#[test]
fn evicted_experts_leave_no_memory_the_cache_does_not_account() {
    if sluice_tests::emulated() {
        eprintln!("skipped: qemu-user may ignore MADV_DONTNEED, so released pages stay in its memory");
        return;
    }
    // Quantized experts do not start on page boundaries: neighbouring experts share a page.
    let dir = tempfile::tempdir().unwrap();
    for f in [Fixture::Q8_0, Fixture::OddQ8_0] {
        let (files, index) = indexed_fixture(f, dir.path());
        let budget = index.one_token_demand();
        let config = stream_config(budget, 2, true, DensePolicy::Anon);
        let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
        let (mut session, tokens) = open_session(&model, &index, &config);
        for _ in 0..3 {
            session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap();
            let s = session.streamer();
            assert!(s.cache_counters().evictions > 0, "{f:?}: the budget must make the cache evict");
            let (resident, accounted) = (s.resident_expert_bytes(), s.cache_used());
            assert!(resident <= accounted, "{f:?}: {resident} bytes of experts in RAM, {accounted} accounted");
        }
    }
}

#[test]
fn a_prompt_batch_beyond_the_cache_passes_through_in_waves_within_the_staging() {
    let emulated = sluice_tests::emulated();
    let dir = tempfile::tempdir().unwrap();
    for f in [Fixture::Q8_0, Fixture::OddQ8_0, Fixture::GptOss] {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        for (what, cache, overlap) in
            [("no cache", 0, None), ("one token's cache, overlapped", index.one_token_demand(), Some(READ_BOUND))]
        {
            let config = StreamConfig { overlap, ..stream_config(cache, 2, true, DensePolicy::Anon) };
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let (mut session, tokens) = open_session(&model, &index, &config);
            // Sample each expert tensor's bytes really in RAM while the decodes run.
            let probe = session.streamer().expert_memory_probe();
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let sampler = {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut peak = probe();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        peak.iter_mut().zip(probe()).for_each(|(p, now)| *p = (*p).max(now));
                        std::thread::yield_now();
                    }
                    peak
                })
            };
            let (generation, rows) = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let peaks = sampler.join().unwrap();
            assert_eq!(generation.tokens, reference, "{f:?}, {what}: waves changed the output");
            assert!(rows[0].prefill && rows[0].passed > 0, "{f:?}, {what}: the prompt batch passed nothing through");
            assert!(rows[1..].iter().all(|r| r.passed == 0), "{f:?}, {what}: a single token never needs waves");
            if emulated {
                continue; // qemu-user may ignore MADV_DONTNEED: released pages stay in its memory
            }
            let s = session.streamer();
            assert!(s.resident_expert_bytes() <= s.cache_used(), "{f:?}, {what}: what passed through was given back");
            if cache > 0 {
                continue;
            }
            // Without a cache, no expert tensor ever held more than the wave window, one more
            // slice (a sample is not one instant), and the two edge pages of each expert's slice
            // (given back when the layer is collected); without waves it would hold all of a
            // prompt's routed experts.
            let page = ggml_sys::page_size();
            for (t, peak) in index.experts.iter().zip(&peaks) {
                let slice = t.stride.div_ceil(page) * page + page;
                let bound = index.layer_token_demand() + slice + 2 * page * u64::from(index.n_expert);
                assert!(peak <= &bound, "{f:?}: {} held {peak} bytes at once, bound {bound}", t.name);
            }
        }
    }
}

#[test]
fn the_live_cache_hits_what_the_replay_of_its_trace_counts() {
    if sluice_tests::emulated() {
        eprintln!("skipped: the cache's bookkeeping is the same on every architecture (runs natively)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut hits, mut evictions) = (0, 0);
    for f in [Fixture::Q8_0, Fixture::GptOss] {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        for policy in CachePolicy::ALL {
            for cache in [index.one_token_demand(), index.all_expert_window_bytes() / 2] {
                let what = format!("{f:?}, {policy}, a cache of {cache} bytes");
                let config = StreamConfig { cache_policy: policy, ..stream_config(cache, 2, true, DensePolicy::Anon) };
                let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
                let (mut session, tokens) = open_session(&model, &index, &config);
                let (generation, _) = session.generate(&tokens, N, |_, _| {}, |_| {}).unwrap();
                assert_eq!(generation.tokens, reference, "{what}: streamed output differs from resident");
                let s = session.streamer();
                let path = dir.path().join("routes.sluice-trace");
                s.route_trace(f.file_name()).save(&path).unwrap();
                let trace = RouteTrace::load(&path).unwrap();
                assert_eq!((trace.budget, trace.policy), (cache, policy), "{what}");
                let live = s.cache_counters();
                let replayed = sluice::replay::replay(&trace, policy, cache).all;
                assert_eq!(
                    (replayed.hits, replayed.misses),
                    (live.hits, live.misses),
                    "{what}: replay and live differ"
                );
                assert!(sluice::replay::belady(&trace, cache).all.hits >= live.hits, "{what}: MIN was beaten");
                (hits, evictions) = (hits + live.hits, evictions + live.evictions);
            }
        }
    }
    assert!(hits > 0 && evictions > 0, "the runs must both hit and evict ({hits} hits, {evictions} evictions)");
}

#[test]
fn ngram_drafting_gives_the_greedy_tokens_resident_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut drafted, mut accepted) = (0, 0);
    for f in gate_fixtures() {
        let (files, index) = indexed_fixture(f, dir.path());
        let reference = resident_reference(&files[0], N);
        let model = sluice::generate::load_model(&files[0]).unwrap();
        let params = sluice::generate::GenerateParams {
            n_predict: N,
            threads: ggml_sys::Threads::unpinned(2),
            draft: Some(sluice::generate::NGRAM_DRAFT_MAX),
            batch: sluice::generate::DEFAULT_BATCH,
            kv: Default::default(),
        };
        let g = sluice::generate::generate(&model, sluice_tests::PROMPT, &params, |_, _| {}).unwrap();
        assert_eq!(g.tokens, reference, "{f:?}: resident with drafting differs from plain greedy");
        (drafted, accepted) = (drafted + g.drafted, accepted + g.accepted);
        drop(model);
        for (what, cache) in [("cache off", 0), ("cache holds everything", UNBOUNDED)] {
            let config = stream_config(cache, 2, true, DensePolicy::Anon);
            let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
            let prompt = sluice::generate::Session::prepare(&model, sluice_tests::PROMPT, N).unwrap();
            let mut session = StreamedSession::open(
                &model,
                Arc::clone(&index),
                &config,
                sluice::generate::ContextShape::one(prompt.len() as u32 + N),
                &ggml_sys::Threads::unpinned(2),
            )
            .unwrap();
            session.set_draft(Some(sluice::generate::NGRAM_DRAFT_MAX)).unwrap();
            let (g, _) = session.generate(&prompt, N, |_, _| {}, |_| {}).unwrap();
            assert_eq!(g.tokens, reference, "{f:?}, {what}: streamed with drafting differs from plain greedy");
            (drafted, accepted) = (drafted + g.drafted, accepted + g.accepted);
        }
    }
    assert!(
        drafted > 0 && accepted > 0,
        "the fixtures' repetitive text is drafted and accepted ({accepted} of {drafted})"
    );
    eprintln!("drafted {drafted}, accepted {accepted}");
}
