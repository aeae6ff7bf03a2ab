//! Pinning is real: during a streamed generation on a profile with separate compute and I/O
//! cores, every compute thread's affinity (from /proc/self/task/*/status) is within the
//! profile's compute cores and every I/O lane's equals its I/O cores. Its own test binary, so no
//! other test's threads run beside it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use sluice::board::{resolve, select, BoardChoice, BuildCaps, Overrides};
use sluice::stream::{load_streamed_model, ExpertIndex, StreamedSession};
use sluice_hal::probe::HardwareProbe;
use sluice_hal::root::SysRoot;
use sluice_tests::{Fixture, PROMPT};

/// `tid → (comm, Cpus_allowed_list)` of every thread of this process.
fn tasks() -> BTreeMap<u32, (String, Vec<usize>)> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| {
            let dir = e.ok()?.path();
            let tid = dir.file_name()?.to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?.trim().to_string();
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
            Some((tid, (comm, sluice_hal::cpulist::parse(list.trim()).ok()?)))
        })
        .collect()
}

#[test]
fn compute_threads_and_io_lanes_run_on_the_profile_cores() {
    let allowed = sluice_hal::cpu::allowed_cpus().unwrap();
    if allowed.len() < 2 {
        eprintln!("skipped: this process may run on one CPU only ({allowed:?}); separate cores need two");
        return;
    }
    let (compute, io) = (allowed[0], allowed[1]);
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("split.toml");
    std::fs::write(
        &profile,
        format!("name = \"split cores\"\n[cpu]\ncompute_cores = [{compute}]\nio_cores = [{io}]\nstrict_cpu = true\n[storage]\nlanes = 2\n"),
    )
    .unwrap();
    let files = Fixture::Q8_0.write(dir.path());
    let probe = HardwareProbe::run(&SysRoot::default(), Some(&files[0]));
    let selected = select(&BoardChoice::Path(profile), &probe.identity).unwrap();
    // Two threads on one core: ggml starts one worker beside the calling thread.
    let overrides = Overrides { threads: Some(2), ..Default::default() };
    let board = resolve(selected, &probe, &overrides, Some(&allowed), BuildCaps::of_this_build()).unwrap();
    assert_eq!((board.compute_cores.as_slice(), board.io_cores.as_slice()), (&[compute][..], &[io][..]));

    let index = Arc::new(ExpertIndex::open(&files[0]).unwrap());
    let mut config = sluice_tests::stream_config(0, 2, true, sluice::stream::DensePolicy::Anon);
    config.lanes = board.lanes();
    let model = load_streamed_model(&files[0], &index, config.dense, 0).unwrap();
    let before: BTreeSet<u32> = tasks().into_keys().collect();
    let n = 6;
    let prompt_len = sluice::generate::Session::prepare(&model, PROMPT, n).unwrap().len() as u32;
    let mut session = StreamedSession::open(
        &model,
        index,
        &config,
        sluice::generate::ContextShape::one(prompt_len + n),
        &board.threads(),
    )
    .unwrap();
    let mut seen = Vec::new();
    let tokens = model.tokenize(PROMPT, true).unwrap();
    session.generate(&tokens, n, |_, _| {}, |_| seen.push(tasks())).unwrap();
    assert!(!seen.is_empty());
    let me = std::fs::read_link("/proc/thread-self").unwrap();
    let me: u32 = me.file_name().unwrap().to_str().unwrap().parse().unwrap();
    for snapshot in &seen {
        let new: Vec<_> = snapshot.iter().filter(|(tid, _)| !before.contains(tid)).collect();
        let lanes: Vec<_> = new.iter().filter(|(_, (comm, _))| comm.starts_with("sluice-io")).collect();
        // The kernel's io_uring workers of the lanes' rings (`iou-wrk-*`) take their lane's cores.
        let lane_helpers: Vec<_> = new.iter().filter(|(_, (comm, _))| comm.starts_with("iou-")).collect();
        let workers: Vec<_> =
            new.iter().filter(|(_, (comm, _))| !comm.starts_with("sluice-io") && !comm.starts_with("iou-")).collect();
        assert_eq!(lanes.len(), 2, "{new:?}");
        assert!(!workers.is_empty(), "no ggml worker thread found: {new:?}");
        for (tid, (comm, cpus)) in lanes.into_iter().chain(lane_helpers) {
            assert_eq!(cpus, &vec![io], "I/O lane {tid} ({comm})");
        }
        for (tid, (comm, cpus)) in workers {
            assert_eq!(cpus, &vec![compute], "compute thread {tid} ({comm})");
        }
        // The calling thread computes as ggml's thread 0, pinned the same way.
        assert_eq!(snapshot[&me].1, vec![compute], "calling thread");
    }
}
