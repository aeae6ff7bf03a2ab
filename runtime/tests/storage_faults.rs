//! A failing disk under `sluice run`: reads of the model's header, of a dense tensor or of an
//! expert fail with EIO or stall, in every streaming mode (serial, overlapped, waves, no cache,
//! page-cache reads) and resident, through an LD_PRELOAD fault injector (`faults/inject.c`,
//! built here with the C compiler). Each run must end with exit status 1 and an error naming the file within the
//! read bound: never a signal, a panic or a wait without end. A same-size rewrite of the file in
//! place with its modification time restored is caught too.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
mod fuzzing;
use common::{run_within, sluice_command};
use fuzzing::Gguf;

/// The read bound of the lanes and of the header (`stream::READ_BOUND`) and some slack.
const BOUND: Duration = Duration::from_secs(30 + 20);

/// The injector, built with the machine's C compiler; `None` (with the reason) where it cannot
/// be used: an emulated run (the preload would load into the emulator) or no compiler.
fn injector(dir: &Path) -> Result<PathBuf, String> {
    if common::emulated() {
        return Err("an emulated run: the preloaded injector would load into the emulator".into());
    }
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/faults/inject.c");
    let so = dir.join("inject.so");
    let o = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o", so.to_str().unwrap(), src, "-ldl"])
        .output()
        .map_err(|e| format!("no C compiler: {e}"))?;
    if !o.status.success() {
        return Err(format!("the injector does not build: {}", String::from_utf8_lossy(&o.stderr)));
    }
    Ok(so)
}

/// One faulty run: the command's output and how long it took.
fn faulty_run(so: &Path, model: &Path, range: (u64, u64), kind: &str, mode: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let o = sluice_command()
        .args(["run", "-m", model.to_str().unwrap(), "-n", "4"])
        .args(mode)
        .env("LD_PRELOAD", so)
        .env("SLUICE_FAULT_FILE", model)
        .env("SLUICE_FAULT_FROM", range.0.to_string())
        .env("SLUICE_FAULT_TO", range.1.to_string())
        .env("SLUICE_FAULT_KIND", kind)
        .output()
        .unwrap();
    (o, t0.elapsed())
}

/// A prompt long enough that a layer routes to nearly all its experts (waves, with a small cache).
fn long_prompt() -> String {
    "the quick brown fox jumps over the lazy dog and ".repeat(12)
}

/// The injector, a fixture model (its canonical path, as the injector matches it) and its
/// layout; `None` (saying why) where the injector cannot be used.
fn setup(dir: &Path) -> Option<(PathBuf, PathBuf, Gguf)> {
    let so = match injector(dir) {
        Ok(so) => so,
        Err(why) => {
            println!("storage-fault test skipped: {why}");
            return None;
        }
    };
    let model = dir.join("m.gguf");
    let o = sluice_command().args(["synth", "--out", model.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let model = model.canonicalize().unwrap();
    let g = Gguf::parse(&std::fs::read(&model).unwrap());
    Some((so, model, g))
}

#[test]
fn failed_and_stalled_reads_are_errors_within_the_bound_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let Some((so, model, g)) = setup(dir.path()) else { return };
    let span = |name: &str| {
        let t = g.tensors.iter().find(|t| t.name == name).unwrap();
        (t.at, t.at + t.data.len() as u64)
    };
    let targets = [
        ("header", (24, 64)),
        ("dense tensor", span("blk.0.attn_q.weight")),
        ("expert", span("blk.1.ffn_up_exps.weight")),
    ];
    let prompt = long_prompt();
    let modes: [(&str, Vec<&str>); 6] = [
        ("serial", vec!["-p", "hi", "--no-overlap"]),
        ("overlapped", vec!["-p", "hi", "--overlap"]),
        ("waves", vec!["-p", &prompt, "--cache-mb", "1", "--force-cache", "--overlap-prompt"]),
        ("no cache", vec!["-p", "hi", "--cache-mb", "0"]),
        ("page-cache reads", vec!["-p", "hi", "--no-direct-io"]),
        // llama.cpp's own load of every weight, read (not mapped) under a watchdog
        ("resident", vec!["-p", "hi", "--resident"]),
    ];
    // EIO in every mode; a stall in the serial and the resident modes (each waits out the
    // bound). All at once.
    let mut cases = Vec::new();
    for (target, range) in targets {
        for (mode, args) in &modes {
            cases.push((target, range, "eio", *mode, args.clone()));
        }
        cases.push((target, range, "stall", "serial", modes[0].1.clone()));
        cases.push((target, range, "stall", "resident", modes[5].1.clone()));
    }
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|(target, range, kind, mode, args)| {
                let (so, model) = (&so, &model);
                s.spawn(move || (target, kind, mode, faulty_run(so, model, *range, kind, args)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut bad = Vec::new();
    for (target, kind, mode, (o, took)) in &results {
        let err = String::from_utf8_lossy(&o.stderr);
        let last = err.lines().rev().find(|l| l.starts_with("error:")).unwrap_or("(no error line)");
        println!(
            "{kind} on the {target}, {mode}: exit {:?} after {:.1} s: {last}",
            o.status.code(),
            took.as_secs_f64()
        );
        let named = last.contains(model.file_name().unwrap().to_str().unwrap());
        // A failing read of the header is named as one (with the byte), not as a bad format.
        if **target == "header" && **kind == "eio" && !(last.contains("Input/output error") && last.contains("at byte"))
        {
            bad.push(format!("EIO on the header, {mode}, reported as {last}"));
        }
        if o.status.code() != Some(1) || !named || *took > BOUND || err.contains("panicked") {
            bad.push(format!("{kind} on the {target}, {mode}: {:?}, {took:?}:\n{err}", o.status));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

#[test]
fn a_same_size_rewrite_with_the_modification_time_restored_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let Some((so, model, g)) = setup(dir.path()) else { return };
    let t = g.tensors.iter().find(|t| t.name == "blk.1.ffn_down_exps.weight").unwrap();
    let before = std::fs::metadata(&model).unwrap().modified().unwrap();
    // The first read of the expert rewrites one of its bytes in place, then restores the time.
    let (o, _) = faulty_run(&so, &model, (t.at, t.at + t.data.len() as u64), "rewrite", &["-p", "hi"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(std::fs::metadata(&model).unwrap().modified().unwrap(), before, "the injector restores the time");
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("changed since it was opened"), "{err}");
    // The resident load too: the file changed while it was read.
    let (o, _) = faulty_run(&so, &model, (t.at, t.at + t.data.len() as u64), "rewrite", &["-p", "hi", "--resident"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("changed while it was loaded"), "{err}");
}

#[test]
fn a_read_the_kernel_holds_back_ends_the_run_within_the_bound() {
    use sluice_hal::cgroup::{MemoryCgroup, ReadThrottle};
    use sluice_hal::{root::SysRoot, storage::StorageProbe};
    if common::emulated() {
        println!("skipped: under an emulator");
        return;
    }
    // A real stall, where the injector's is in user space: the model's disk throttled to 2 kB/s,
    // so an O_DIRECT read of a tensor waits in the kernel for a minute. A pread waits there
    // uninterruptibly and held the exit until the read returned (70 s); through io_uring the
    // process leaves it behind.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = dir.path().join("m.gguf");
    let o = sluice_command().args(["synth", "--out", model.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let Some(disk) = StorageProbe::disk_of_file(&SysRoot::default(), &model) else {
        println!("skipped: {} is on no block device", model.display());
        return;
    };
    let cg = match MemoryCgroup::create(&format!("sluice-test-held-read-{}", std::process::id()), 1 << 30) {
        Ok(cg) => cg,
        Err(e) => return println!("skipped: {e}"),
    };
    let throttle = match ReadThrottle::create(&cg, disk, 2048) {
        Ok(t) => t,
        Err(e) => return println!("skipped: {e}"),
    };
    // The binary and the model's mapped parts come from the page cache, not through the throttle.
    let bin = env!("CARGO_BIN_EXE_sluice");
    for f in [Path::new(bin), &model] {
        std::io::copy(&mut std::fs::File::open(f).unwrap(), &mut std::io::sink()).unwrap();
    }
    let mut dirs = vec![cg.dir().to_path_buf()];
    if throttle.dir() != cg.dir() {
        dirs.push(throttle.dir().to_path_buf());
    }
    let joins: String = dirs.iter().map(|d| format!("echo $$ > '{}/cgroup.procs' && ", d.display())).collect();
    let script = format!("{joins}exec '{bin}' run -m '{}' -n 4 -p hi --no-overlap", model.display());
    let (status, err, took) =
        run_within(Command::new("sh").arg("-c").arg(&script).env_remove("RUST_LOG"), Duration::from_secs(150));
    let status = status.unwrap_or_else(|| panic!("the run did not end:\n{err}"));
    println!("a held read: exit {:?} after {:.1} s", status.code(), took.as_secs_f64());
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("not read within") && err.contains("m.gguf"), "{err}");
    assert!(took < BOUND, "the exit waited for the held read: {took:?}\n{err}");
}
