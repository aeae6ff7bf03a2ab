//! The trainer (trainer/train.py) is deterministic for a seed: two runs write the same GGUF
//! bytes, and the exported model loads and generates through `sluice run --resident`. Needs the
//! trainer's Python (`SLUICE_TRAINER_PYTHON`; `make test` sets it), else it says so and skips.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::sluice_command;

/// Trains the small preset for a few steps into `out`; returns the f32 model's path.
fn train(python: &Path, seed: &str, out: &Path) -> PathBuf {
    let trainer = Path::new(env!("CARGO_MANIFEST_DIR")).join("../trainer");
    let o = Command::new(python)
        .current_dir(&trainer)
        .args(["train.py", "--preset", "small", "--steps", "2", "--seed", seed, "--out"])
        .arg(out)
        .output()
        .expect("run the trainer");
    assert!(o.status.success(), "trainer failed: {}", String::from_utf8_lossy(&o.stderr));
    let printed = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert_eq!(printed, out.join("model-f32.gguf").display().to_string(), "the last line is the model's path");
    PathBuf::from(printed)
}

#[test]
fn the_same_seed_trains_the_same_bytes_and_the_model_runs_resident() {
    let Some(python) = std::env::var_os("SLUICE_TRAINER_PYTHON").filter(|p| !p.is_empty()) else {
        eprintln!("SLUICE_TRAINER_PYTHON is not set (make test sets it): skipped");
        return;
    };
    let python = PathBuf::from(python);
    let dir = tempfile::tempdir().unwrap();
    let a = train(&python, "5", &dir.path().join("a"));
    let b = train(&python, "5", &dir.path().join("b"));
    let (a_bytes, b_bytes) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(
        a_bytes == b_bytes,
        "two runs of seed 5 wrote different models ({} and {} bytes)",
        a_bytes.len(),
        b_bytes.len()
    );
    for f in ["held-out.txt", "baselines.json"] {
        assert_eq!(std::fs::read(a.with_file_name(f)).unwrap(), std::fs::read(b.with_file_name(f)).unwrap(), "{f}");
    }

    let o = sluice_command()
        .args(["run", "--resident", "-n", "8", "-p", "And God said", "-m"])
        .arg(&a)
        .env("SLUICE_CACHE_DIR", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "sluice run --resident on the trained model: {err}");
    assert!(err.contains("generated: 8 tokens"), "{err}");
}
