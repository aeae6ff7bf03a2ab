//! `sluice perplexity` as a user runs it: the figure equals one computed independently from the
//! model's logits, streamed equals resident exactly (on a synthetic model, and on the trained
//! KJV model where `SLUICE_TRAINED_MODEL` names it), a lossy knob reports its cost, and a
//! missing, empty or non-UTF-8 text is a clear error.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::sluice_command;

use sluice::generate::{self, ContextShape, GenerateError, Session};

fn sluice(args: &[&str], cache: &Path) -> Output {
    sluice_command().args(args).env("SLUICE_CACHE_DIR", cache).output().expect("run sluice")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The figure on the last line of a successful run's output (`perplexity: X`).
fn figure(o: &Output) -> f64 {
    assert!(o.status.success(), "sluice perplexity failed: {}", stderr(o));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap_or_default();
    let value = last.strip_prefix("perplexity: ").unwrap_or_else(|| panic!("last line {last:?} of {out}"));
    value.parse().unwrap_or_else(|e| panic!("{value:?}: {e}"))
}

/// A synthetic qwen3moe model (byte tokens: a character is about a token) and a text for it.
fn model_and_text(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("m.gguf");
    let o = sluice(&["synth", "--out", model.to_str().unwrap(), "--type", "f32"], dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = dir.join("text.txt");
    std::fs::write(&text, "In the beginning was the word, and the word was with the board. ".repeat(4)).unwrap();
    (model, text)
}

/// `-log softmax(logits)[t]`, all in f64 (written apart from the runtime's own).
fn nll(logits: &[f32], t: i32) -> f64 {
    let max = logits.iter().map(|&l| f64::from(l)).fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = logits.iter().map(|&l| (f64::from(l) - max).exp()).sum();
    z.ln() + max - f64::from(logits[t as usize])
}

#[test]
fn the_figure_equals_the_mean_nll_of_the_second_half_of_each_window() {
    let dir = tempfile::tempdir().unwrap();
    let (model_path, text_path) = model_and_text(dir.path());
    let n_ctx = 32usize;
    let args = ["perplexity", "-m", model_path.to_str().unwrap(), "-f", text_path.to_str().unwrap(), "--ctx", "32"];
    let resident = figure(&sluice(&[&args[..], &["--resident"]].concat(), dir.path()));

    // Independently: each window teacher-forced one token at a time from its first half (the
    // other kernels of single-token decodes), its second half scored against the text.
    let model = generate::load_model(&model_path).unwrap();
    let text = std::fs::read_to_string(&text_path).unwrap();
    let tokens = model.tokenize(&text, true).unwrap();
    let bos = tokens[0];
    let mut session =
        Session::new(&model, ContextShape::one(n_ctx as u32), &ggml_sys::Threads::unpinned(2), None).unwrap();
    let (mut sum, mut count) = (0.0, 0usize);
    for w in tokens.chunks_exact(n_ctx) {
        let mut window = w.to_vec();
        window[0] = bos;
        let first = n_ctx / 2;
        let (prompt, rest) = window.split_at(first + 1);
        session
            .score_continuation(
                prompt,
                rest,
                |i, logits| {
                    sum += nll(logits, rest[i]);
                    count += 1;
                },
                &mut |_| Ok::<(), GenerateError>(()),
            )
            .unwrap();
    }
    assert_eq!(count, tokens.len() / n_ctx * (n_ctx - 1 - n_ctx / 2));
    let independent = (sum / count as f64).exp();
    let rel = (resident - independent).abs() / independent;
    assert!(rel < 1e-3, "sluice perplexity {resident}, computed from the logits {independent}");
    assert!(resident > 1.0);
}

#[test]
fn streamed_equals_resident_exactly_and_a_lossy_knob_reports_its_cost() {
    let dir = tempfile::tempdir().unwrap();
    let (model, text) = model_and_text(dir.path());
    let args = ["perplexity", "-m", model.to_str().unwrap(), "-f", text.to_str().unwrap(), "--ctx", "32"];
    let resident = figure(&sluice(&[&args[..], &["--resident"]].concat(), dir.path()));
    for cache in ["0", "1", "1024"] {
        let streamed = figure(&sluice(&[&args[..], &["--cache-mb", cache, "--force-cache"]].concat(), dir.path()));
        assert_eq!(
            streamed.to_bits(),
            resident.to_bits(),
            "cache {cache} MiB: streamed {streamed}, resident {resident}"
        );
    }
    // A token at a time past each window's first half: the same positions, the same figure to
    // rounding (other kernels than a prompt batch's).
    let decoded = figure(&sluice(&[&args[..], &["--decode"]].concat(), dir.path()));
    assert!((decoded - resident).abs() / resident < 1e-3, "--decode {decoded}, batched {resident}");
    let lossy = sluice(&[&args[..], &["--experts-used", "1"]].concat(), dir.path());
    let out = String::from_utf8_lossy(&lossy.stdout).into_owned();
    assert!(out.contains(&format!("lossless perplexity: {resident:.4}")), "{out}");
    assert!(out.contains("lossy / lossless: ") && out.contains("top-1 agreement with the lossless run: "), "{out}");
    assert_ne!(figure(&lossy).to_bits(), resident.to_bits(), "one expert of several changed nothing: {out}");
}

#[test]
fn the_trained_models_stream_their_perplexity_exactly_and_record_their_routes() {
    for (name, model) in common::trained_models() {
        // A cache that holds a token's experts and a small share of all: the KJV model's experts
        // are 6 MiB in all; the board-shaped one's 48 MiB (0.1 MiB each), 3.8 MiB a token.
        let cache = if name == "board-shaped" { "6" } else { "1" };
        let text = model.with_file_name("held-out.txt");
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("routes.sluice-trace");
        let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
        let args = ["perplexity", "-m", m, "-f", t, "--ctx", "128", "--chunks", "8"];
        let resident = figure(&sluice(&[&args[..], &["--resident"]].concat(), dir.path()));
        let streamed = figure(&sluice(
            &[&args[..], &["--cache-mb", cache, "--trace", trace.to_str().unwrap()]].concat(),
            dir.path(),
        ));
        assert_eq!(streamed.to_bits(), resident.to_bits(), "{name}: streamed {streamed}, resident {resident}");
        // Language, not noise: far below the vocabulary's size (1024) and the unigram model (~300).
        assert!(resident < 100.0, "the {name} model's held-out perplexity is {resident}");
        let replay = sluice(&["replay", "--trace", trace.to_str().unwrap(), "--cache-mb", cache], dir.path());
        assert!(replay.status.success(), "{name}: {}", stderr(&replay));
        assert!(String::from_utf8_lossy(&replay.stdout).contains("belady-min"));
    }
}

/// The board-shaped model's experts are padded with zero units (trainer/pad.py): the padded file
/// must compute exactly what the unpadded one does, in perplexity and in greedy text, streamed.
#[test]
fn the_padded_board_model_computes_what_the_unpadded_one_does() {
    let Some(padded) = std::env::var_os("SLUICE_TRAINED_BOARD_MODEL").filter(|p| !p.is_empty()) else {
        eprintln!("SLUICE_TRAINED_BOARD_MODEL is not set (make test sets it): skipped");
        return;
    };
    let padded = PathBuf::from(padded);
    let unpadded = padded.with_file_name("model-unpadded-q8_0.gguf");
    let (padded_len, unpadded_len) =
        (std::fs::metadata(&padded).unwrap().len(), std::fs::metadata(&unpadded).unwrap().len());
    assert!(padded_len > 4 * unpadded_len, "padded {padded_len} bytes, unpadded {unpadded_len}: not padded");
    let text = padded.with_file_name("held-out.txt");
    let dir = tempfile::tempdir().unwrap();
    let perplexity = |model: &Path| {
        let m = model.to_str().unwrap();
        figure(&sluice(
            &["perplexity", "-m", m, "-f", text.to_str().unwrap(), "--ctx", "128", "--chunks", "8"],
            dir.path(),
        ))
    };
    let (p, u) = (perplexity(&padded), perplexity(&unpadded));
    assert_eq!(p.to_bits(), u.to_bits(), "padded {p}, unpadded {u}");
    let greedy = |model: &Path| {
        let o = sluice(&["run", "-m", model.to_str().unwrap(), "-p", "And God said", "-n", "24"], dir.path());
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(greedy(&padded), greedy(&unpadded), "the padded model's greedy text differs");
}

#[test]
fn a_missing_empty_or_non_utf8_text_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = model_and_text(dir.path());
    let m = model.to_str().unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait".repeat(20)).unwrap();
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let cases = [
        ("/nonexistent/text.txt", "--file /nonexistent/text.txt: cannot read it"),
        (empty.to_str().unwrap(), "the file is empty"),
        (latin1.to_str().unwrap(), "not UTF-8 text (invalid bytes at offset 3)"),
        (short.to_str().unwrap(), "needs at least 64 (two windows)"),
    ];
    for (file, needle) in cases {
        let o = sluice(&["perplexity", "-m", m, "-f", file, "--ctx", "32", "--resident"], dir.path());
        let err = stderr(&o);
        assert!(!o.status.success() && !err.contains("panicked") && err.contains(needle), "{file}: {err}");
    }
}

/// The bytes `sluice perplexity` asks the allocator for while it reads and tokenizes a text of
/// `n` times 'a' (measured by `faults/count_alloc.c`, the shared object `so`, preloaded).
fn bytes_asked_tokenizing(dir: &Path, so: &Path, model: &Path, n: usize) -> u64 {
    let text = dir.join(format!("run-{n}.txt"));
    std::fs::write(&text, "a".repeat(n)).unwrap();
    let report = dir.join(format!("asked-{n}"));
    let o = sluice_command()
        .args(["perplexity", "--model", model.to_str().unwrap(), "--file", text.to_str().unwrap()])
        .args(["--ctx", "64", "--chunks", "1"])
        .env("LD_PRELOAD", so)
        .env("SLUICE_ALLOC_REPORT", &report)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(&report).unwrap().trim().parse().unwrap()
}

#[test]
fn a_long_run_of_one_character_tokenizes_in_linear_work() {
    if common::emulated() {
        println!("skipped: an emulated run (the preloaded counter would load into the emulator)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let so = dir.path().join("count_alloc.so");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/faults/count_alloc.c");
    match Command::new("cc").args(["-shared", "-fPIC", "-O1", "-o", so.to_str().unwrap(), src]).output() {
        Ok(o) if o.status.success() => {}
        other => {
            println!("skipped: the allocation counter does not build: {other:?}");
            return;
        }
    }
    // Synthesized models tokenize with SentencePiece (SPM), whose byte fallback reserved the
    // output one symbol at a time: 512 KiB asked for about 5e11 bytes (18 s).
    let model = dir.path().join("m.gguf");
    let o = sluice_command().args(["synth", "--out", model.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let small = bytes_asked_tokenizing(dir.path(), &so, &model, 64 << 10);
    let large = bytes_asked_tokenizing(dir.path(), &so, &model, 512 << 10);
    let per_byte = large.saturating_sub(small) / (448 << 10);
    println!("tokenizing: {small} bytes asked for 64 KiB, {large} for 512 KiB: {per_byte} a byte of text");
    assert!(
        per_byte < 1000,
        "{per_byte} bytes asked a byte of text: not linear ({small} for 64 KiB, {large} for 512 KiB)"
    );
}
