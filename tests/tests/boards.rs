//! Board gates: auto-detection and the probe on fake board trees (tests/boards/), every profile in
//! boards/ parses, each bad-profile case gets an error naming the file, the field and the fix,
//! and the storage probe on this machine's real disk and on tmpfs.

use std::path::{Path, PathBuf};

use sluice::board::{
    resolve, select, BoardChoice, BoardError, BoardProfile, BuildCaps, Overlap, Overrides, ResolvedBoard, BUILTIN,
};
use sluice_hal::probe::HardwareProbe;
use sluice_hal::root::SysRoot;
use sluice_hal::storage::{measure_direct_read, Medium, StorageProbe};

fn tree(name: &str) -> SysRoot {
    SysRoot::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("boards").join(name))
}

fn resolve_on(root: &SysRoot, choice: &BoardChoice, gpu: bool) -> Result<(HardwareProbe, ResolvedBoard), BoardError> {
    let probe = HardwareProbe::run(root, None);
    let selected = select(choice, &probe.identity)?;
    let resolved = resolve(
        selected,
        &probe,
        &Overrides::default(),
        None,
        BuildCaps { gpu, cpu_parallel: true, cuda_ordinal: gpu.then_some(0) },
    )?;
    Ok((probe, resolved))
}

struct Expect {
    tree: &'static str,
    profile: &'static str,
    clusters: &'static [&'static [usize]],
    medium: Medium,
    disk: &'static str,
    logical: u64,
    physical: u64,
    max_request_kib: u64,
}

const EXPECT: [Expect; 5] = [
    Expect {
        tree: "rpi4-4gb",
        profile: "rpi4-4gb",
        clusters: &[&[0, 1, 2, 3]],
        medium: Medium::Sd,
        disk: "mmcblk0",
        logical: 512,
        physical: 512,
        max_request_kib: 2048,
    },
    Expect {
        tree: "rpi5-8gb",
        profile: "rpi5-8gb",
        clusters: &[&[0, 1, 2, 3]],
        medium: Medium::Sd,
        disk: "mmcblk0",
        logical: 512,
        physical: 512,
        max_request_kib: 1024,
    },
    Expect {
        tree: "orin-nano-8gb-4core",
        profile: "orin-nano-8gb",
        clusters: &[&[0, 1, 2, 3]],
        medium: Medium::Nvme,
        disk: "nvme0n1",
        logical: 512,
        physical: 512,
        max_request_kib: 512,
    },
    Expect {
        tree: "agx-orin-64gb",
        profile: "agx-orin-64gb",
        clusters: &[&[0, 1, 2, 3], &[4, 5, 6, 7], &[8, 9, 10, 11]],
        medium: Medium::Emmc,
        disk: "mmcblk0",
        logical: 512,
        physical: 512,
        max_request_kib: 512,
    },
    Expect {
        tree: "x86-vm",
        profile: "generic",
        clusters: &[&[0, 1]],
        medium: Medium::Virtio,
        disk: "vda",
        logical: 512,
        physical: 4096,
        max_request_kib: 4096,
    },
];

#[test]
fn fake_boards_are_detected_and_probed() {
    for e in &EXPECT {
        let (probe, r) =
            resolve_on(&tree(e.tree), &BoardChoice::Auto, false).unwrap_or_else(|err| panic!("{}: {err}", e.tree));
        assert_eq!(r.selected.id, e.profile, "{}: {}", e.tree, r.selected.reason);
        let clusters: Vec<Vec<usize>> = probe.cpu.clusters().into_iter().map(|k| k.cpus).collect();
        assert_eq!(clusters, e.clusters.iter().map(|c| c.to_vec()).collect::<Vec<_>>(), "{}", e.tree);
        let s = probe.storage.as_ref().unwrap_or_else(|| panic!("{}: no storage", e.tree));
        assert_eq!(
            (s.medium, s.disk.as_deref(), s.logical_block, s.physical_block, s.max_request),
            (e.medium, Some(e.disk), Some(e.logical), Some(e.physical), Some(e.max_request_kib << 10)),
            "{}",
            e.tree
        );
        // The read size is the device's request limit unless the profile sets one.
        assert_eq!(r.read_bytes.value, e.max_request_kib << 10, "{}", e.tree);
        assert!(r.budget.value > 0 && r.budget.value <= probe.memory.total.unwrap(), "{}", e.tree);
    }
}

#[test]
fn the_probe_reads_identity_memory_thermal_and_cgroup_limits() {
    let (probe, r) = resolve_on(&tree("rpi5-8gb"), &BoardChoice::Auto, false).unwrap();
    assert_eq!(probe.identity.model.as_deref(), Some("Raspberry Pi 5 Model B Rev 1.0"));
    assert_eq!(probe.identity.compatible, ["raspberrypi,5-model-b", "brcm,bcm2712"]);
    assert_eq!(probe.thermal.zones[0].kind, "cpu-thermal");
    assert!((probe.thermal.zones[0].celsius - 48.55).abs() < 1e-9);
    assert_eq!(probe.thermal.throttled.map(|t| t.0), Some(0));
    // The service's cgroup (MemoryMax=6G) caps the budget below MemTotal − reserve.
    assert_eq!(probe.memory.cgroup.as_ref().and_then(|c| c.limit), Some(6 << 30));
    assert_eq!(r.budget.value, 6 << 30);
    assert!(r.budget.source.contains("cgroup"), "{}", r.budget.source);
    assert_eq!((r.compute_cores.as_slice(), r.io_cores.as_slice(), r.lanes.value), (&[0, 1, 2, 3][..], &[3][..], 1));

    let (pi4, _) = resolve_on(&tree("rpi4-4gb"), &BoardChoice::Auto, false).unwrap();
    assert_eq!(pi4.thermal.throttled.unwrap().conditions().len(), 4);
    let (orin, _) = resolve_on(&tree("agx-orin-64gb"), &BoardChoice::Auto, false).unwrap();
    assert!(orin.identity.tegra_release.as_deref().unwrap().starts_with("R36 (release), REVISION: 4.3"));
}

#[test]
fn a_jetson_power_mode_with_cores_offline_keeps_the_online_ones() {
    let (probe, r) = resolve_on(&tree("orin-nano-8gb-4core"), &BoardChoice::Auto, false).unwrap();
    assert_eq!((probe.cpu.possible.len(), probe.cpu.online.len()), (6, 4));
    assert_eq!(r.compute_cores, [0, 1, 2, 3]);
    assert_eq!(r.io_cores, [3], "the profile's I/O core 5 is offline: the lanes share the last compute core");
    assert_eq!(r.threads.value, 4);
    assert!(r.notes.iter().any(|n| n.contains("CPU 4-5 offline")), "{:?}", r.notes);
    // No CUDA in this build: the profile allows the cpu fallback, and says so.
    assert_eq!(r.compute, sluice::board::ComputeService::Cpu);
    assert!(r.notes.iter().any(|n| n.contains("cpu_fallback")), "{:?}", r.notes);
    assert!(r.compute_via.contains("ggml_ext_cpu_parallel_v1"), "{}", r.compute_via);
    // With a GPU build it would offload, on the device the CUDA device service names.
    let (_, gpu) = resolve_on(&tree("orin-nano-8gb-4core"), &BoardChoice::Auto, true).unwrap();
    assert!(matches!(gpu.compute, sluice::board::ComputeService::Cuda { n_gpu_layers: 999 }));
    assert!(gpu.compute_via.contains("CUDA device 0 (ggml_ext_cuda_device_v1)"), "{}", gpu.compute_via);
    // A CUDA build whose ggml lacks the services is refused.
    let root = tree("orin-nano-8gb-4core");
    let probe = HardwareProbe::run(&root, None);
    let selected = select(&BoardChoice::Auto, &probe.identity).unwrap();
    let caps = BuildCaps { gpu: true, cpu_parallel: true, cuda_ordinal: None };
    let err = resolve(selected, &probe, &Overrides::default(), None, caps).unwrap_err().to_string();
    assert!(err.contains("ggml_ext_cuda_device_v1"), "{err}");
}

#[test]
fn more_threads_than_usable_cpus_are_capped_with_a_note() {
    let root = tree("rpi5-8gb");
    let probe = HardwareProbe::run(&root, None);
    let selected = select(&BoardChoice::Auto, &probe.identity).unwrap();
    let overrides = Overrides { threads: Some(64), ..Overrides::default() };
    let r =
        resolve(selected, &probe, &overrides, None, BuildCaps { gpu: false, cpu_parallel: true, cuda_ordinal: None })
            .unwrap();
    assert_eq!(r.threads.value, 4);
    assert!(r.notes.iter().any(|n| n.contains("--threads 64: more than the 4 CPUs")), "{:?}", r.notes);
}

#[test]
fn expert_slots_are_on_unless_the_profile_or_the_command_line_turns_them_off() {
    assert!(rpi5_with(&Overrides::default()).expert_slots, "the built-in profile keeps the default");
    assert!(!rpi5_with(&Overrides { no_expert_slots: true, ..Overrides::default() }).expert_slots);
    let root = tree("rpi5-8gb");
    let probe = HardwareProbe::run(&root, None);
    let caps = BuildCaps { gpu: false, cpu_parallel: true, cuda_ordinal: None };
    let mut selected = select(&BoardChoice::Auto, &probe.identity).unwrap();
    selected.profile.memory.expert_slots = false;
    assert!(!resolve(selected, &probe, &Overrides::default(), None, caps).unwrap().expert_slots);
}

/// The built-in rpi5-8gb profile on its probed tree, resolved with `overrides`.
fn rpi5_with(overrides: &Overrides) -> ResolvedBoard {
    let root = tree("rpi5-8gb");
    let probe = HardwareProbe::run(&root, None);
    let caps = BuildCaps { gpu: false, cpu_parallel: true, cuda_ordinal: None };
    let selected = select(&BoardChoice::Auto, &probe.identity).unwrap();
    resolve(selected, &probe, overrides, None, caps).unwrap()
}

#[test]
fn lookahead_is_off_unless_the_profile_or_the_command_line_turns_it_on() {
    let caps = BuildCaps { gpu: false, cpu_parallel: true, cuda_ordinal: None };
    // An SD card and an NVMe drive alike: on a board model's shape it lost at every speed.
    for board in ["rpi5-8gb", "orin-nano-8gb-4core"] {
        let probe = HardwareProbe::run(&tree(board), None);
        let with = |on: Option<bool>, overrides: &Overrides| {
            let mut selected = select(&BoardChoice::Auto, &probe.identity).unwrap();
            selected.profile.storage.lookahead = on;
            resolve(selected, &probe, overrides, None, caps).unwrap().lookahead
        };
        assert!(!with(None, &Overrides::default()), "{board}: off by default");
        assert!(with(Some(false), &Overrides { lookahead: Some(true), ..Overrides::default() }), "--lookahead");
        assert!(with(Some(true), &Overrides::default()), "storage.lookahead = true");
        assert!(!with(None, &Overrides { lookahead: Some(false), ..Overrides::default() }), "--no-lookahead");
        assert!(!with(Some(false), &Overrides::default()), "storage.lookahead = false");
    }
}

#[test]
fn reads_are_paced_only_when_the_command_line_asks() {
    let plain = rpi5_with(&Overrides::default());
    assert_eq!((plain.pace_mbps, plain.lanes().pace), (None, None), "unpaced by default");
    let paced = rpi5_with(&Overrides { pace_mbps: Some(400), ..Overrides::default() });
    assert_eq!((paced.pace_mbps, paced.lanes().pace), (Some(400), Some(400_000_000)), "--pace-mbps 400");
}

#[test]
fn overlapped_the_io_cores_compute_no_more() {
    let root = tree("rpi5-8gb");
    let probe = HardwareProbe::run(&root, None);
    let caps = BuildCaps { gpu: false, cpu_parallel: true, cuda_ordinal: None };
    let with = |overlap| {
        let selected = select(&BoardChoice::Auto, &probe.identity).unwrap();
        resolve(selected, &probe, &Overrides { overlap: Some(overlap), ..Overrides::default() }, None, caps).unwrap()
    };
    let every_core = (vec![0, 1, 2, 3], vec![3], 4);
    let serial = with(Overlap::Off);
    assert_eq!((serial.compute_cores.clone(), serial.io_cores.clone(), serial.threads.value), every_core);
    let prompt = with(Overlap::Prompt);
    assert_eq!(
        (prompt.compute_cores.clone(), prompt.io_cores.clone(), prompt.threads.value),
        every_core,
        "overlapping prompts only keeps every compute core"
    );
    assert_eq!(prompt.overlap.source, "--overlap-prompt");
    let auto = with(Overlap::Auto);
    assert_eq!(
        (auto.compute_cores.clone(), auto.io_cores.clone(), auto.threads.value),
        every_core,
        "overlapping decodes only while the cores are idle keeps every compute core"
    );
    let overlapped = with(Overlap::On);
    assert_eq!(
        (overlapped.compute_cores.clone(), overlapped.threads.value),
        (vec![0, 1, 2], 3),
        "{:?}",
        overlapped.notes
    );
    assert_eq!(overlapped.io_cores, vec![3]);
    assert!(overlapped.notes.iter().any(|n| n.contains("compute no more")), "{:?}", overlapped.notes);
}

#[test]
fn storage_overlap_takes_a_boolean_or_a_mode_and_names_a_bad_one() {
    let parse = |v: &str| {
        let text = format!("name = \"t\"\n[storage]\noverlap = {v}\n");
        BoardProfile::parse(&text, "t.toml").map(|p| p.storage.overlap)
    };
    assert_eq!(parse("true").unwrap(), Some(Overlap::On));
    assert_eq!(parse("false").unwrap(), Some(Overlap::Off));
    assert_eq!(parse("\"prompt\"").unwrap(), Some(Overlap::Prompt));
    assert_eq!(parse("\"auto\"").unwrap(), Some(Overlap::Auto));
    let err = parse("\"sometimes\"").unwrap_err().to_string();
    assert!(err.contains("sometimes") && err.contains("prompt"), "{err}");
}

#[test]
fn every_profile_in_boards_parses_and_is_built_in() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../boards");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert_eq!(files.len(), BUILTIN.len(), "every boards/*.toml must be listed in the built-in table");
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        BoardProfile::parse(&text, &f.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
        let id = f.file_stem().unwrap().to_str().unwrap();
        assert!(BUILTIN.iter().any(|(i, t)| *i == id && *t == text), "{id} differs from its built-in copy");
    }
}

/// Writes `text` as a profile and resolves it on the fake Pi 5.
fn bad_profile(text: &str, gpu: bool) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("myboard.toml");
    std::fs::write(&path, text).unwrap();
    match resolve_on(&tree("rpi5-8gb"), &BoardChoice::Path(path), gpu) {
        Ok(_) => panic!("profile accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

fn assert_names(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
}

#[test]
fn bad_profiles_name_the_file_the_field_and_the_fix() {
    let base = "name = \"mine\"\n";
    assert_names(
        &bad_profile(&format!("{base}[cpu]\ncompute_core = [0]\n"), false),
        &["myboard.toml", "unknown field `compute_core`", "compute_cores", "boards/README.md"],
    );
    assert_names(
        &bad_profile(&format!("{base}[cpu]\npoll = \"high\"\n"), false),
        &["myboard.toml", "poll", "invalid type"],
    );
    assert_names(
        &bad_profile(&format!("{base}[cpu]\ncompute_cores = [0, 7]\n"), false),
        &["myboard.toml", "cpu.compute_cores", "CPU 7", "possible CPUs: 0-3"],
    );
    assert_names(
        &bad_profile(&format!("{base}[memory]\nbudget_mib = 16384\n"), false),
        &["myboard.toml", "memory.budget_mib = 16384", "more than this machine's RAM (8052 MiB)", "lower it"],
    );
    assert_names(
        &bad_profile(&format!("{base}[compute]\nservice = \"cuda\"\nn_gpu_layers = 99\n"), false),
        &["myboard.toml", "compute.service = \"cuda\"", "--features cuda", "cpu_fallback"],
    );
    assert_names(
        &bad_profile(&format!("{base}[storage]\nread_kib = 3\n"), false),
        &["myboard.toml", "storage.read_kib", "multiple of 4"],
    );
    assert_names(
        &bad_profile(&format!("{base}[compute]\nservice = \"tpu\"\n"), false),
        &["myboard.toml", "unknown variant `tpu`"],
    );
    assert_names(
        &bad_profile(&format!("{base}[memory]\ncache_policy = \"mru\"\n"), false),
        &["myboard.toml", "cache_policy", "unknown variant `mru`", "lru", "frequency"],
    );
    assert_names(
        &bad_profile(&format!("{base}[memory]\ncache_type_k = \"q9_0\"\n"), false),
        &["myboard.toml", "cache_type_k", "unknown variant `q9_0`", "q8_0", "q4_0"],
    );
    assert_names(
        &bad_profile(&format!("{base}[memory]\nexpert_slots = \"yes\"\n"), false),
        &["myboard.toml", "expert_slots", "expected a boolean"],
    );
    assert_names(
        &bad_profile(&format!("{base}[storage]\nlookahead = 1\n"), false),
        &["myboard.toml", "lookahead", "expected a boolean"],
    );
    assert_names(&bad_profile("[cpu]\npoll = 1\n", false), &["myboard.toml", "missing field `name`"]);
    assert_names(
        &bad_profile(&format!("{base}[cpu]\ncompute_cores = [0, 1, 1]\n"), false),
        &["myboard.toml", "cpu.compute_cores", "CPU 1 is listed twice"],
    );
    assert_names(
        &bad_profile(&format!("{base}[cpu]\nio_cores = [3, 3]\n"), false),
        &["myboard.toml", "cpu.io_cores", "CPU 3 is listed twice"],
    );
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.toml");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    for path in [fifo, "/dev/zero".into(), dir.path().to_path_buf()] {
        let e = resolve_on(&tree("rpi5-8gb"), &BoardChoice::Path(path.clone()), false).err().unwrap().to_string();
        assert_names(&e, &[&path.display().to_string(), "not a regular file"]);
    }
    let missing = resolve_on(&tree("rpi5-8gb"), &BoardChoice::Path("/nonexistent/b.toml".into()), false)
        .err()
        .unwrap()
        .to_string();
    assert_names(&missing, &["/nonexistent/b.toml", "sluice boards"]);
    let unknown = resolve_on(&tree("rpi5-8gb"), &BoardChoice::Id("rpi6".into()), false).err().unwrap().to_string();
    assert_names(&unknown, &["\"rpi6\"", "rpi5-8gb", "generic"]);
}

#[test]
fn storage_probe_of_a_real_disk_and_of_tmpfs() {
    // The test binary lives on this machine's real disk.
    let exe = std::env::current_exe().unwrap();
    let disk = StorageProbe::for_file(&SysRoot::default(), &exe).unwrap();
    if let Some(name) = &disk.disk {
        let logical = disk.logical_block.unwrap();
        assert!(logical >= 512 && logical.is_power_of_two(), "{disk:?}");
        assert!(disk.physical_block.unwrap() >= logical, "{disk:?}");
        let max = disk.max_request.unwrap();
        assert!(max >= 4096 && max % 512 == 0, "{name}: {disk:?}");
        let align = disk.direct_alignment();
        assert!(align.is_power_of_two() && align >= 512, "{disk:?}");
        let t = measure_direct_read(&exe, 256 << 10, 2, align as usize, 4 << 20).unwrap();
        assert!(t.direct, "ext4 on a block device takes O_DIRECT");
        let len = std::fs::metadata(&exe).unwrap().len().min(4 << 20);
        assert_eq!(t.bytes, len / align * align);
    } else {
        eprintln!("skipped the block-device half: {} is not on a block device here", exe.display());
    }
    if Path::new("/dev/shm").is_dir() {
        let f = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        std::fs::write(f.path(), vec![3u8; 1 << 20]).unwrap();
        let shm = StorageProbe::for_file(&SysRoot::default(), f.path()).unwrap();
        assert_eq!((shm.disk.as_deref(), shm.medium, shm.max_request), (None, Medium::Other, None));
        // tmpfs takes O_DIRECT from Linux 6.6 on; before that the measurement reads buffered.
        let t = measure_direct_read(f.path(), 64 << 10, 2, shm.direct_alignment() as usize, u64::MAX).unwrap();
        assert_eq!(t.bytes, 1 << 20);
    }
}
