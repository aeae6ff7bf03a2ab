//! Media that rot: `sluice verify` writes a model's checksum sidecar, `--check` finds what
//! changed since, and with `--verify` a byte flipped in an expert or a dense tensor fails the run
//! naming it in every streaming mode (never wrong tokens with exit 0), a changed header fails at
//! start, and a clean model generates exactly what it does without `--verify`.

use std::path::Path;
use std::process::Output;

mod common;
mod fuzzing;
use common::sluice_command;
use fuzzing::Gguf;

fn sluice(args: &[&str]) -> Output {
    sluice_command().args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Flips bit 6 of the byte at each of `offsets` in `path`.
fn flip(path: &Path, offsets: &[u64]) {
    let mut bytes = std::fs::read(path).unwrap();
    for &at in offsets {
        bytes[at as usize] ^= 0x40;
    }
    std::fs::write(path, bytes).unwrap();
}

/// A prompt long enough that a layer routes to nearly all its experts (waves, with a small cache).
fn long_prompt() -> String {
    "the quick brown fox jumps over the lazy dog and ".repeat(12)
}

#[test]
fn damaged_bytes_fail_a_verified_run_naming_the_expert_or_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let m = model.to_str().unwrap();
    let o = sluice(&["synth", "--out", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    let good = std::fs::read(&model).unwrap();
    let g = Gguf::parse(&good);
    let tensor = |name: &str| g.tensors.iter().find(|t| t.name == name).unwrap();

    // No sidecar yet: --verify says how to write one.
    let o = sluice(&["run", "-m", m, "-p", "hi", "-n", "4", "--verify"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("sluice verify"), "{}", stderr(&o));

    let o = sluice(&["verify", "-m", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.path().join("m.gguf.sluice-sums").is_file());
    let o = sluice(&["verify", "-m", m, "--check"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("all match"));

    // A clean model: --verify changes nothing of the output.
    let plain = sluice(&["run", "-m", m, "-p", "hi", "-n", "8", "--cache-mb", "0"]);
    let verified = sluice(&["run", "-m", m, "-p", "hi", "-n", "8", "--cache-mb", "0", "--verify"]);
    assert!(plain.status.success() && verified.status.success(), "{}", stderr(&verified));
    assert_eq!(plain.stdout, verified.stdout);

    // One byte flipped in every expert of layer 0's gate: whatever a token routes to is damaged.
    let gate = tensor("blk.0.ffn_gate_exps.weight");
    let n_expert = 8u64;
    let slice = gate.data.len() as u64 / n_expert;
    flip(&model, &(0..n_expert).map(|e| gate.at + e * slice + slice / 2).collect::<Vec<_>>());
    let o = sluice(&["verify", "-m", m, "--check"]);
    assert_eq!(o.status.code(), Some(1));
    let listed = String::from_utf8_lossy(&o.stdout);
    for e in 0..n_expert {
        assert!(listed.contains(&format!("damaged: expert {e} of tensor blk.0.ffn_gate_exps.weight")), "{listed}");
    }
    let o = sluice(&["run", "-m", m, "-p", "hi", "-n", "4", "--cache-mb", "0"]);
    assert!(o.status.success(), "without --verify the damage goes unseen: {}", stderr(&o));
    let prompt = long_prompt();
    let modes: Vec<(&str, Vec<&str>)> = vec![
        ("serial", vec!["-p", "hi", "--no-overlap"]),
        ("overlapped", vec!["-p", "hi", "--overlap"]),
        ("waves", vec!["-p", &prompt, "--cache-mb", "1", "--force-cache", "--overlap-prompt"]),
        ("no cache", vec!["-p", "hi", "--cache-mb", "0"]),
        ("page-cache reads", vec!["-p", "hi", "--no-direct-io"]),
    ];
    // Under emulation a sample: the serial and the waves modes.
    let sample = |i: usize| !common::emulated() || i == 0 || i == 2;
    for (_, (mode, args)) in modes.iter().enumerate().filter(|(i, _)| sample(*i)) {
        let o = sluice_command().args(["run", "-m", m, "-n", "4", "--verify"]).args(args).output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{mode}: {err}");
        assert!(
            err.contains("of layer 0 from") && err.contains("do not match the checksum `sluice verify` recorded"),
            "{mode}: {err}"
        );
    }

    // A dense tensor: the warm-up read names it.
    std::fs::write(&model, &good).unwrap();
    let q = tensor("blk.1.attn_q.weight");
    flip(&model, &[q.at + 5]);
    let o = sluice(&["run", "-m", m, "-p", "hi", "-n", "4", "--verify"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("reading tensor blk.1.attn_q.weight from"), "{}", stderr(&o));

    // The header (same length, still a valid GGUF): refused at start.
    std::fs::write(&model, &good).unwrap();
    let at = good.windows(14).position(|w| w == b"random weights").unwrap() as u64;
    flip(&model, &[at + 12]);
    let o = sluice(&["run", "-m", m, "-p", "hi", "-n", "4", "--verify"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("its header"), "{}", stderr(&o));

    // A damaged sidecar is refused, not trusted.
    std::fs::write(&model, &good).unwrap();
    let sidecar = dir.path().join("m.gguf.sluice-sums");
    let mut sums = std::fs::read(&sidecar).unwrap();
    sums[20] ^= 1;
    std::fs::write(&sidecar, sums).unwrap();
    let o = sluice(&["run", "-m", m, "-p", "hi", "-n", "4", "--verify"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("not a valid sluice checksum file"), "{}", stderr(&o));
}
