//! The `sluice` binary as a user runs it: bad input gets a clear error and a non-zero exit
//! (never a panic), the demo works from an empty cache, and `synth --size` hits its target.

use std::path::Path;
use std::process::Output;

mod common;
mod fuzzing;
use common::sluice_command;
use fuzzing::{Gguf, Rng, Tensor, Value};

/// Runs the built binary with `cache` as its model cache.
fn sluice(args: &[&str], cache: &Path) -> Output {
    sluice_command().args(args).env("SLUICE_CACHE_DIR", cache).output().expect("run sluice")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean failure: non-zero exit, no panic, and a message containing `needle`.
fn assert_clean_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "panic on bad input: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
}

fn small_model(dir: &Path) -> String {
    let p = dir.join("m.gguf");
    let o = sluice(&["synth", "--out", p.to_str().unwrap()], dir);
    assert!(o.status.success(), "{}", stderr(&o));
    p.to_string_lossy().into_owned()
}

#[test]
fn missing_model_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let o = sluice(&["run", "-m", "/nonexistent/model.gguf", "-p", "hi"], dir.path());
    assert_clean_error(&o, "/nonexistent/model.gguf: no such file");
}

#[test]
fn non_gguf_file_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notes.txt");
    std::fs::write(&p, "these are not weights\n".repeat(100)).unwrap();
    let o = sluice(&["run", "-m", p.to_str().unwrap(), "-p", "hi"], dir.path());
    assert_clean_error(&o, "not a readable GGUF file");
}

#[test]
fn truncated_gguf_names_the_tensor_that_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let bytes = std::fs::read(&model).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let o = sluice(&["run", "-m", cut.to_str().unwrap(), "-p", "hi"], dir.path());
    assert_clean_error(&o, "truncated: tensor");
    // A file cut inside the header is rejected too.
    std::fs::write(&cut, &bytes[..100]).unwrap();
    let o = sluice(&["run", "-m", cut.to_str().unwrap(), "-p", "hi"], dir.path());
    assert_clean_error(&o, "not a readable GGUF file");
}

#[test]
fn zero_tokens_and_empty_prompt_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["run", "-m", &model, "-p", "hi", "-n", "0"], dir.path());
    assert_clean_error(&o, "0 is not in 1..");
    let o = sluice(&["run", "-m", &model, "-p", ""], dir.path());
    assert_clean_error(&o, "the prompt is empty");
}

#[test]
fn too_long_a_request_names_the_context_length() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["run", "-m", &model, "-p", "hi", "-n", "100000"], dir.path());
    assert_clean_error(&o, "more than the model's context length 4096");
}

#[test]
fn bad_synth_parameters_name_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let o = sluice(&["synth", "--out", out.to_str().unwrap(), "--experts", "4", "--experts-used", "6"], dir.path());
    assert_clean_error(&o, "--experts-used");
    let o = sluice(&["synth", "--out", out.to_str().unwrap(), "--size", "10KiB"], dir.path());
    assert_clean_error(&o, "too small");
    // Reuse is calibrated with skewed routing only: asked for alone, it is refused, not ignored.
    let o = sluice(&["synth", "--out", out.to_str().unwrap(), "--arch", "gpt-oss", "--reuse", "2"], dir.path());
    assert_clean_error(&o, "--routing skewed");
    assert!(!out.exists(), "a failed synth must not leave a file behind");
}

#[test]
fn bad_storage_speeds_name_the_value_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["bench", "-m", &model, "--budget-mb", "512", "--storage-mbps", "fast"], dir.path());
    assert_clean_error(&o, "'fast' is not a speed");
    assert!(stderr(&o).contains("nvme-gen3"), "{}", stderr(&o));
    let o = sluice(&["bench", "-m", &model, "--storage-mbps", "sd"], dir.path());
    assert_clean_error(&o, "--budget-mb");
    let o = sluice(
        &["--board", "generic", "bench", "-m", &model, "--budget-mb", "512", "--storage-mbps", "board"],
        dir.path(),
    );
    assert_clean_error(&o, "names no storage.medium");
    // Pacing (`--pace-mbps`, every command that reads a model): a whole number of MB/s from 1.
    for bad in ["0", "fast", "-5", "4294967296"] {
        let flag = format!("--pace-mbps={bad}");
        let o = sluice(&["run", "-m", &model, "-p", "x", "-n", "1", &flag], dir.path());
        assert_clean_error(&o, "--pace-mbps");
    }
}

#[test]
fn run_prints_the_continuation_and_its_speed() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["run", "-m", &model, "-p", "Hello", "-n", "12", "-t", "1"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!o.stdout.is_empty());
    assert!(stderr(&o).contains("generated 12 tokens"), "{}", stderr(&o));
    assert!(stderr(&o).contains("tok/s"), "{}", stderr(&o));
    let again = sluice(&["run", "-m", &model, "-p", "Hello", "-n", "12", "-t", "2"], dir.path());
    assert_eq!(o.stdout, again.stdout, "greedy output must not depend on the thread count");
}

#[test]
fn demo_synthesizes_once_then_reuses_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let first = sluice(&["demo", "-n", "32"], &cache);
    assert!(first.status.success(), "{}", stderr(&first));
    let dictionary = std::fs::read_to_string("/usr/share/dict/words")
        .expect("/usr/share/dict/words (Debian package wamerican; make deps installs it)");
    let dictionary: std::collections::HashSet<&str> = dictionary.lines().collect();
    let text = String::from_utf8_lossy(&first.stdout);
    let words = text.split_whitespace().filter(|w| dictionary.contains(w)).count();
    assert!(words >= 10, "the demo printed {words} dictionary words, fewer than 10: {text}");
    assert!(stderr(&first).contains("generated just now"), "{}", stderr(&first));
    assert!(stderr(&first).contains("streamed decode:"), "{}", stderr(&first));
    assert!(stderr(&first).contains("The weights are random"), "{}", stderr(&first));
    let second = sluice(&["demo", "-n", "32"], &cache);
    assert!(second.status.success(), "{}", stderr(&second));
    assert!(stderr(&second).contains("from the cache"), "{}", stderr(&second));
    assert_eq!(first.stdout, second.stdout);
    let files: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files.len(), 1, "one model, no leftovers: {files:?}");
}

#[test]
fn synth_size_lands_just_under_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sized.gguf");
    let o = sluice(
        &[
            "synth",
            "--out",
            out.to_str().unwrap(),
            "--size",
            "48MiB",
            "--layers",
            "4",
            "--experts",
            "16",
            "--embd",
            "256",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let len = std::fs::metadata(&out).unwrap().len() as f64;
    let target = 48.0 * 1024.0 * 1024.0;
    assert!(len <= target && len > 0.95 * target, "size {len} vs target {target}");
}

#[test]
fn run_streams_by_default_and_matches_resident() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let csv = dir.path().join("t.csv");
    let streamed = sluice(
        &["run", "-m", &model, "-p", "Hello", "-n", "12", "--cache-mb", "0", "--csv", csv.to_str().unwrap()],
        dir.path(),
    );
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    assert!(stderr(&streamed).contains("streamed decode: 11 tokens"), "{}", stderr(&streamed));
    let resident = sluice(&["run", "-m", &model, "-p", "Hello", "-n", "12", "--resident"], dir.path());
    assert!(resident.status.success(), "{}", stderr(&resident));
    assert_eq!(streamed.stdout, resident.stdout);
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(text.starts_with("# model = "), "{text}");
    assert!(text.contains("# cache_bytes = 0"), "{text}");
    let rows = text.lines().filter(|l| !l.starts_with('#')).count();
    assert_eq!(rows, 1 + 12, "header, one prompt batch and 11 token decodes: {text}");
}

/// The prompt batch `run` took, from its summary line `prompt: N tokens in S s (batches of B)`.
fn prompt_and_batch(o: &Output) -> (u32, u32) {
    let err = stderr(o);
    let line = err.lines().find(|l| l.starts_with("prompt: ")).unwrap_or_else(|| panic!("no prompt line: {err}"));
    let tokens = line["prompt: ".len()..].split(' ').next().unwrap().parse().unwrap();
    let batch = line.split("batches of ").nth(1).and_then(|r| r.split(&[')', ';'][..]).next()).unwrap();
    (tokens, batch.parse().unwrap_or_else(|_| panic!("{line}")))
}

#[test]
fn run_takes_the_prompt_batch_from_the_budget_and_resident_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let prompt = "the river runs under the old stone bridge ".repeat(14);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "-m", &model, "-p", &prompt, "-n", "6"];
        args.extend_from_slice(extra);
        let o = sluice(&args, dir.path());
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        o
    };
    // The machine's budget holds the whole model: the prompt goes in one batch, resident too.
    let auto = run(&[]);
    let (tokens, batch) = prompt_and_batch(&auto);
    assert!(tokens > 512, "the prompt should need more than one batch of 512: {tokens} tokens");
    assert!(batch >= tokens, "a roomy budget takes the prompt in one batch: {tokens} tokens, batches of {batch}");
    let resident = run(&["--resident"]);
    assert_eq!(prompt_and_batch(&resident).1, batch, "{}", stderr(&resident));
    assert_eq!(auto.stdout, resident.stdout, "the resident run takes the streamed run's batch");
    // A fixed batch, streamed and resident alike.
    let fixed = run(&["--batch", "512"]);
    assert_eq!(prompt_and_batch(&fixed).1, 512);
    let fixed_resident = run(&["--batch", "512", "--resident"]);
    assert_eq!(prompt_and_batch(&fixed_resident).1, 512);
    assert_eq!(fixed.stdout, fixed_resident.stdout);
    // The plan names the batch it chose and why.
    let plan = sluice(&["plan", "-m", &model, "--ctx", "4096", "--batch", "auto"], dir.path());
    assert!(plan.status.success(), "{}", stderr(&plan));
    let text = String::from_utf8_lossy(&plan.stdout);
    assert!(text.contains("prompt batch 2048: from the budget"), "{text}");
    for bad in ["0", "big", "-3"] {
        let flag = format!("--batch={bad}");
        assert_clean_error(&sluice(&["run", "-m", &model, "-p", "Hi", &flag], dir.path()), "is not a batch");
    }
}

#[test]
fn ngram_drafting_prints_the_same_text_and_its_acceptance() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let plain = sluice(&["run", "-m", &model, "-p", "Hello", "-n", "24", "--cache-mb", "0"], dir.path());
    assert!(plain.status.success(), "{}", stderr(&plain));
    let drafted =
        sluice(&["run", "-m", &model, "-p", "Hello", "-n", "24", "--cache-mb", "0", "--draft", "ngram"], dir.path());
    assert!(drafted.status.success(), "{}", stderr(&drafted));
    assert_eq!(plain.stdout, drafted.stdout, "drafting changes no token");
    assert!(stderr(&drafted).contains("drafted tokens accepted"), "{}", stderr(&drafted));
    assert!(stderr(&drafted).contains("streamed decode: 23 tokens"), "{}", stderr(&drafted));
    let bad = sluice(&["run", "-m", &model, "--draft", "eagle"], dir.path());
    assert_clean_error(&bad, "eagle");
}

/// A small recurrent (Mamba) model with the synthetic vocabulary of `base`: llama.cpp's memory
/// of it cannot drop positions.
fn mamba_model(dir: &Path, base: &str) -> String {
    let vocab = Gguf::parse(&std::fs::read(base).unwrap());
    let n_vocab = vocab.tensors.iter().find(|t| t.name == "token_embd.weight").unwrap().dims[1];
    let (embd, inner, state, rank, conv) = (64u64, 128u64, 16u64, 4u64, 4u64);
    let mut g = Gguf { version: 3, kvs: Vec::new(), tensors: Vec::new() };
    g.set("general.architecture", Value::string("mamba"));
    for (key, v) in [
        ("context_length", 512),
        ("embedding_length", embd),
        ("block_count", 2),
        ("feed_forward_length", 0),
        ("attention.head_count", 0),
        ("ssm.conv_kernel", conv),
        ("ssm.inner_size", inner),
        ("ssm.state_size", state),
        ("ssm.time_step_rank", rank),
    ] {
        g.set(&format!("mamba.{key}"), Value::u32(v as u32));
    }
    g.set("mamba.attention.layer_norm_rms_epsilon", Value::f32(1e-5));
    g.kvs.extend(vocab.kvs.iter().filter(|(k, _)| k.starts_with("tokenizer.")).cloned());
    let mut rng = Rng(7);
    let mut tensor = |name: String, dims: Vec<u64>| {
        let n: u64 = dims.iter().product();
        let data = (0..n).flat_map(|_| ((rng.below(2000) as f32 - 1000.0) / 8000.0).to_le_bytes()).collect();
        g.tensors.push(Tensor { name, at: 0, dims, ty: 0, data });
    };
    tensor("token_embd.weight".into(), vec![embd, n_vocab]);
    tensor("output_norm.weight".into(), vec![embd]);
    for l in 0..2 {
        let b = format!("blk.{l}");
        tensor(format!("{b}.attn_norm.weight"), vec![embd]);
        tensor(format!("{b}.ssm_in.weight"), vec![embd, 2 * inner]);
        tensor(format!("{b}.ssm_conv1d.weight"), vec![conv, inner]);
        tensor(format!("{b}.ssm_conv1d.bias"), vec![inner]);
        tensor(format!("{b}.ssm_x.weight"), vec![inner, rank + 2 * state]);
        tensor(format!("{b}.ssm_dt.weight"), vec![rank, inner]);
        tensor(format!("{b}.ssm_dt.bias"), vec![inner]);
        tensor(format!("{b}.ssm_a"), vec![state, inner]);
        tensor(format!("{b}.ssm_d"), vec![inner]);
        tensor(format!("{b}.ssm_out.weight"), vec![inner, embd]);
    }
    let p = dir.join("mamba.gguf");
    std::fs::write(&p, g.write()).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn drafting_is_refused_before_a_recurrent_model_generates() {
    let dir = tempfile::tempdir().unwrap();
    let base = small_model(dir.path());
    let model = mamba_model(dir.path(), &base);
    let args = ["run", "-m", &model, "-p", "Hello", "-n", "8", "--resident"];
    let plain = sluice(&args, dir.path());
    assert!(plain.status.success(), "the fixture runs: {}", stderr(&plain));
    let drafted = sluice(&[&args[..], &["--draft", "ngram"]].concat(), dir.path());
    assert_clean_error(&drafted, "cannot forget rejected draft tokens; turn drafting off (--draft off");
    assert!(drafted.stdout.is_empty(), "nothing was generated: {}", String::from_utf8_lossy(&drafted.stdout));
}

#[test]
fn a_cache_below_one_token_is_refused_with_the_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let synth =
        sluice(&["synth", "--out", dir.path().join("big.gguf").to_str().unwrap(), "--expert-ff", "2048"], dir.path());
    assert!(synth.status.success());
    let big = dir.path().join("big.gguf");
    let o = sluice(&["run", "-m", big.to_str().unwrap(), "-p", "hi", "--cache-mb", "1"], dir.path());
    assert_clean_error(&o, "below one token's routed demand");
    assert!(stderr(&o).contains("--cache-mb"), "{}", stderr(&o));
    let forced = sluice(
        &["run", "-m", big.to_str().unwrap(), "-p", "hi", "-n", "4", "--cache-mb", "1", "--force-cache"],
        dir.path(),
    );
    assert!(forced.status.success(), "{}", stderr(&forced));
    let _ = model;
}

#[test]
fn list_archs_prints_the_verified_architectures_and_the_generic_rule() {
    let dir = tempfile::tempdir().unwrap();
    let o = sluice(&["run", "--list-archs"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for arch in ["qwen3moe", "gpt-oss", "deepseek2", "generic rule"] {
        assert!(out.contains(arch), "{arch} missing from {out}");
    }
}

#[test]
fn bench_compares_resident_and_streamed_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["bench", "-m", &model, "-n", "6", "--cache-percents", "0,100"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<&str> = out.lines().collect();
    assert_eq!(rows.len(), 4, "header, resident and two streamed rows: {out}");
    assert!(rows[1].starts_with("resident-mmap"), "{out}");
    assert!(rows[2].starts_with("streamed cache 0%") && rows[3].starts_with("streamed cache 100%"), "{out}");
    assert!(
        rows[1..].iter().all(|r| r.trim_end().ends_with("yes")),
        "every configuration generates the resident text: {out}"
    );
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fake_board(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/boards").join(name).to_string_lossy().into_owned()
}

#[test]
fn probe_reports_a_fake_pi_5_completely() {
    let dir = tempfile::tempdir().unwrap();
    let o = sluice(&["probe", "--root", &fake_board("rpi5-8gb")], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for line in [
        "model: Raspberry Pi 5 Model B Rev 1.0",
        "compatible: raspberrypi,5-model-b, brcm,bcm2712",
        "cluster 0: cpus 0-3, capacity 1024, max 2400 MHz",
        "MemTotal: 8052 MiB",
        "limit 6144 MiB",
        "device: mmcblk0, partition mmcblk0p2 (sd)",
        "max request 1024 KiB",
        "cpu-thermal: 48.5 °C",
        "throttled: 0x0 (none)",
        "ggml_ext_cpu_parallel_v1: present (CPU)",
        "ggml_ext_cuda_device_v1: absent",
        "profile: rpi5-8gb",
        "compute cores: 0-3  (4 threads",
        "I/O cores: 3",
        "read size: 1024 KiB (device queue/max_sectors_kb)",
        "lanes: 1 (profile storage.lanes)",
        "budget: 6144 MiB (memory cgroup limit",
        "compute service: cpu",
        "extension work: ggml_ext_cpu_parallel_v1 on the compute cores' thread pool",
        "GGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16",
    ] {
        assert!(out.contains(line), "probe output lacks {line:?}:\n{out}");
    }
}

#[test]
fn probe_describes_a_jetson_and_runs_it_on_the_cpu_service_without_cuda() {
    let dir = tempfile::tempdir().unwrap();
    for (tree, profile) in [("orin-nano-8gb-4core", "orin-nano-8gb"), ("agx-orin-64gb", "agx-orin-64gb")] {
        let o = sluice(&["probe", "--root", &fake_board(tree)], dir.path());
        assert!(o.status.success(), "{tree}: {}", stderr(&o));
        let out = stdout(&o);
        for line in [
            "NVIDIA Jetson".to_string(),
            format!("profile: {profile}"),
            "GPU offload: no".into(),
            "compute services this build can run: cpu (a `--features cuda` build on the board adds cuda)".into(),
            "compute service: cpu".into(),
        ] {
            assert!(out.contains(&line), "{tree}: probe output lacks {line:?}:\n{out}");
        }
        let warnings = stderr(&o);
        assert_eq!(
            warnings.matches("this build has no CUDA").count(),
            1,
            "{tree}: one warning names the missing CUDA build:\n{warnings}"
        );
    }
}

#[test]
fn probe_of_this_machine_measures_direct_reads_and_honours_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["--board", "qemu-aarch64", "probe", "--io", &model, "--io-lanes", "3"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("profile: qemu-aarch64"), "{out}");
    assert!(out.contains("lanes: 3 (--io-lanes)"), "{out}");
    assert!(out.contains("read size: 512 KiB (profile storage.read_kib)"), "{out}");
    let io = out.lines().find(|l| l.starts_with("io: ")).unwrap_or_else(|| panic!("no io line: {out}"));
    assert!(io.contains("512 KiB requests, 3 lanes"), "{io}");
    let o = sluice(&["--board", "qemu-aarch64", "probe", "--pace-mbps", "400"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("reads paced to 400 MB/s (--pace-mbps)"), "{}", stdout(&o));
    // A paced run reads the same bytes: the text equals the unpaced run's.
    let text = |extra: &[&str]| {
        let mut args = vec!["run", "-m", &model, "-p", "The board", "-n", "8"];
        args.extend_from_slice(extra);
        let o = sluice(&args, dir.path());
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(text(&["--pace-mbps", "2000"]), text(&[]));
}

#[test]
fn boards_lists_every_profile_and_bad_board_choices_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let o = sluice(&["boards"], dir.path());
    assert!(o.status.success());
    let out = stdout(&o);
    for id in ["rpi4-4gb", "rpi5-16gb", "orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb", "generic", "qemu-aarch64"] {
        assert!(out.contains(id), "{out}");
    }
    assert_clean_error(&sluice(&["--board", "rpi6", "probe"], dir.path()), "no built-in board profile \"rpi6\"");
    let bad = dir.path().join("b.toml");
    std::fs::write(&bad, "name = \"b\"\n[memory]\nbudget_gb = 1\n").unwrap();
    assert_clean_error(&sluice(&["--board", bad.to_str().unwrap(), "probe"], dir.path()), "unknown field `budget_gb`");
}

#[test]
fn plan_prints_the_ledger_as_text_and_json_and_refuses_what_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["--board", "qemu-aarch64", "plan", "-m", &model, "--ctx", "512"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for line in [
        "dense weights",
        "KV cache",
        "compute buffers",
        "I/O staging",
        "expert cache",
        "runtime overhead",
        "total held",
    ] {
        assert!(out.contains(line), "{line:?} missing:\n{out}");
    }
    assert!(out.contains("budget") && out.contains("profile memory.budget_mib"), "{out}");

    let o = sluice(&["--board", "qemu-aarch64", "plan", "-m", &model, "--ctx", "512", "--json"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["budget"], 2048u64 << 20);
    assert_eq!(v["n_ctx"], 512);
    let lines = v["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 6);
    let sum: u64 = lines.iter().filter(|l| l["held"] == true).map(|l| l["bytes"].as_u64().unwrap()).sum();
    assert_eq!(v["total"].as_u64().unwrap(), sum);

    // A board whose budget lies between the plans of 256 and 4096 positions cannot hold 4096:
    // the refusal names a context that fits.
    let total = |ctx: &str| -> u64 {
        let o = sluice(
            &["--board", "qemu-aarch64", "plan", "-m", &model, "--ctx", ctx, "--json", "--cache-mb", "0"],
            dir.path(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["total"].as_u64().unwrap()
    };
    let (small, big) = (total("256"), total("4096"));
    assert!(big > small + (4 << 20), "the KV cache grows with the context: {small} {big}");
    let budget_mib = ((small + big) / 2) >> 20;
    let board = dir.path().join("tiny.toml");
    std::fs::write(&board, format!("name = \"tiny\"\n[memory]\nbudget_mib = {budget_mib}\n")).unwrap();
    let o = sluice(
        &["--board", board.to_str().unwrap(), "plan", "-m", &model, "--ctx", "4096", "--cache-mb", "0"],
        dir.path(),
    );
    assert_clean_error(&o, &format!("more than the budget of {budget_mib}.0 MiB"));
    assert_clean_error(&o, "fits with: ");
    assert_clean_error(&o, "a context of");
    // Beyond the model's context length is its own clear error.
    let o = sluice(&["plan", "-m", &model, "--ctx", "100000"], dir.path());
    assert_clean_error(&o, "more than the model's context length 4096");
    // run refuses a plan over budget the same way, before reading any weight.
    std::fs::write(&board, "name = \"tiny\"\n[memory]\nbudget_mib = 24\n").unwrap();
    let o = sluice(&["--board", board.to_str().unwrap(), "run", "-m", &model, "-p", "hi"], dir.path());
    assert_clean_error(&o, "more than the budget of 24.0 MiB");
    assert!(!stderr(&o).contains("open:"), "{}", stderr(&o));
}

#[test]
fn output_that_cannot_be_written_fails_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let full = || std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    for resident in [false, true] {
        let mut args = vec!["run", "-m", &model, "-p", "Hello", "-n", "4"];
        if resident {
            args.push("--resident");
        }
        let o = sluice_command().args(&args).stdout(full()).output().unwrap();
        assert_clean_error(&o, "writing the generated text to standard output");
    }
    // --csv is created before anything is generated, and a failed write is an error.
    let missing = dir.path().join("no/such/dir/t.csv");
    let o = sluice(&["run", "-m", &model, "-p", "Hello", "-n", "4", "--csv", missing.to_str().unwrap()], dir.path());
    assert_clean_error(&o, "--csv");
    assert!(stderr(&o).contains("cannot create it"), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "generated before checking --csv: {:?}", String::from_utf8_lossy(&o.stdout));
    let o = sluice(&["run", "-m", &model, "-p", "Hello", "-n", "4", "--csv", "/dev/full"], dir.path());
    assert_clean_error(&o, "writing --csv /dev/full");
    // A closed standard output would swallow the text: an error before generating.
    let mut run = sluice_command();
    run.args(["run", "-m", &model, "-p", "Hello", "-n", "4"]);
    let o = std::process::Command::new("sh")
        .args(["-c", "exec \"$@\" >&-", "sh"])
        .arg(run.get_program())
        .args(run.get_args())
        .output()
        .unwrap();
    assert_clean_error(&o, "standard output is closed");
    // A /dev/null opened read-write (Python's subprocess.DEVNULL, supervisors) is a legitimate
    // place for the text, not a closed descriptor.
    let devnull = std::fs::File::options().read(true).write(true).open("/dev/null").unwrap();
    let o = sluice_command().args(["run", "-m", &model, "-p", "Hello", "-n", "4"]).stdout(devnull).output().unwrap();
    assert!(o.status.success(), "a read-write /dev/null refused: {}", stderr(&o));
    // A standard error that cannot be written loses the messages, not the run.
    let o = sluice_command().args(["run", "-m", &model, "-p", "Hello", "-n", "4"]).stderr(full()).output().unwrap();
    assert!(o.status.success(), "{:?}", o.status);
    assert!(!o.stdout.is_empty());
}

#[test]
fn streaming_flags_beside_resident_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    for flag in
        [&["--cache-mb", "4"][..], &["--force-cache"], &["--dense", "mmap"], &["--csv", "x.csv"], &["--progress"]]
    {
        let mut args = vec!["run", "-m", &model, "-p", "hi", "--resident"];
        args.extend_from_slice(flag);
        let o = sluice(&args, dir.path());
        assert_clean_error(&o, "cannot be used with");
        assert!(stderr(&o).contains(flag[0]), "{}", stderr(&o));
    }
}

#[test]
fn a_model_that_routes_every_expert_streams_with_a_cache_of_all_of_them() {
    // Q8_0 experts' page windows differ, so `layers x k x largest` exceeded all experts and
    // refused the cache the plan had sized to hold every one of them.
    let dir = tempfile::tempdir().unwrap();
    let q8 = dir.path().join("q8.gguf");
    let o = sluice(
        &["synth", "--out", q8.to_str().unwrap(), "--type", "q8_0", "--experts", "8", "--experts-used", "8"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let q8 = q8.to_str().unwrap();
    let streamed = sluice(&["run", "-m", q8, "-p", "Hello", "-n", "6"], dir.path());
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    let resident = sluice(&["run", "-m", q8, "-p", "Hello", "-n", "6", "--resident"], dir.path());
    assert_eq!(streamed.stdout, resident.stdout);
    let plan = sluice(&["plan", "--model", q8, "--json"], dir.path());
    assert!(plan.status.success(), "{}", stderr(&plan));
}

#[test]
fn non_regular_files_are_refused_as_io_targets() {
    let dir = tempfile::tempdir().unwrap();
    let o = sluice(&["probe", "--io", "/dev/zero"], dir.path());
    assert_clean_error(&o, "/dev/zero is not a regular file");
    for board in ["/dev/zero", dir.path().to_str().unwrap()] {
        let o = sluice(&["--board", board, "probe"], dir.path());
        assert_clean_error(&o, "not a regular file");
    }
}

/// `model` with the u32 value of metadata key `key` set to `value`.
fn with_metadata_u32(model: &str, key: &str, value: u32, out: &Path) -> String {
    let mut bytes = std::fs::read(model).unwrap();
    let at = bytes.windows(key.len()).position(|w| w == key.as_bytes()).expect("key in the fixture") + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4, "{key} holds a u32");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    std::fs::write(out, bytes).unwrap();
    out.to_string_lossy().into_owned()
}

#[test]
fn metadata_llama_cpp_would_abort_on_is_an_error_naming_the_key_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let aligned = dir.path().join("aligned.gguf");
    let o = sluice(&["synth", "--out", aligned.to_str().unwrap(), "--alignment", "64"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let aligned = aligned.to_string_lossy().into_owned();
    let deepseek = dir.path().join("deepseek2.gguf");
    let o = sluice(&["synth", "--out", deepseek.to_str().unwrap(), "--arch", "deepseek2", "--layers", "3"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let deepseek = deepseek.to_string_lossy().into_owned();
    let cases = [
        ("qwen3moe.block_count", 0, "qwen3moe.block_count is 0; llama.cpp runs 1 to 512 layers"),
        ("qwen3moe.block_count", 1 << 31, "qwen3moe.block_count is 2147483648"),
        ("qwen3moe.expert_count", 4, "qwen3moe.expert_count is 4, but tensor blk.0.ffn_"),
        ("qwen3moe.expert_count", 2000, "llama.cpp runs at most 1024 experts"),
        ("qwen3moe.expert_used_count", 9, "qwen3moe.expert_used_count is 9; it must be 1 to 8"),
        ("qwen3moe.expert_used_count", 0, "qwen3moe.expert_used_count is 0; it must be 1 to 8"),
        ("general.alignment", 16, "general.alignment is 16; it must be a power of two of at least 32"),
        (
            "deepseek2.attention.head_count_kv",
            4,
            "deepseek2.attention.head_count_kv is 4; latent attention has one KV head",
        ),
        ("deepseek2.rope.dimension_count", 64, "deepseek2.rope.dimension_count is 64, not below the key head size 64"),
        ("deepseek2.attention.key_length", 96, "deepseek2.attention.key_length is 96"),
    ];
    for (i, (key, value, needle)) in cases.into_iter().enumerate() {
        let source = match key {
            "general.alignment" => &aligned,
            k if k.starts_with("deepseek2.") => &deepseek,
            _ => &model,
        };
        let bad = with_metadata_u32(source, key, value, &dir.path().join(format!("bad{i}.gguf")));
        for mode in [
            &["plan", "--model", &bad][..],
            &["run", "-m", &bad, "-p", "hi"],
            &["run", "-m", &bad, "-p", "hi", "--resident"],
        ] {
            assert_clean_error(&sluice(mode, dir.path()), needle);
        }
    }
    // Two tokens with the same text.
    let mut bytes = std::fs::read(&model).unwrap();
    let a = bytes.windows(6).position(|w| w == b"<0x41>").unwrap();
    let b = bytes.windows(6).position(|w| w == b"<0x42>").unwrap();
    bytes.copy_within(a..a + 6, b);
    let dup = dir.path().join("dup.gguf");
    std::fs::write(&dup, bytes).unwrap();
    let o = sluice(&["run", "-m", dup.to_str().unwrap(), "-p", "hi", "--resident"], dir.path());
    assert_clean_error(&o, "tokenizer.ggml.tokens holds \"<0x41>\" twice");
}

#[test]
fn lossy_modes_are_named_in_the_summary_and_refused_where_they_cannot_apply() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let exact = sluice(&["run", "-m", &model, "-p", "hello", "-n", "8", "--cache-mb", "2"], dir.path());
    assert!(exact.status.success(), "{}", stderr(&exact));
    assert!(!stderr(&exact).contains("LOSSY"), "off by default: {}", stderr(&exact));
    let lossy = sluice(
        &["run", "-m", &model, "-p", "hello", "-n", "8", "--cache-mb", "2", "--experts-used", "1", "--substitute", "3"],
        dir.path(),
    );
    assert!(lossy.status.success(), "{}", stderr(&lossy));
    let said = stderr(&lossy);
    assert!(
        said.contains("LOSSY: 1 of 2 experts per token; cached experts substituted from the next 3 router ranks"),
        "{said}"
    );
    assert!(said.contains("chosen experts substituted by cached ones"), "{said}");
    let o = sluice(&["run", "-m", &model, "-p", "hello", "--experts-used", "5"], dir.path());
    assert_clean_error(&o, "--experts-used 5: the model routes each token to 2 experts; give 1 to 2");
    let o = sluice(&["run", "-m", &model, "-p", "hello", "--resident", "--substitute", "2"], dir.path());
    assert_clean_error(&o, "--substitute");
    let o = sluice(&["bench", "-m", &model, "--experts-used", "1"], dir.path());
    assert_clean_error(&o, "give --budget-mb too");
}

#[test]
fn a_megabyte_architecture_name_is_quoted_as_an_excerpt() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gguf::parse(&std::fs::read(small_model(dir.path())).unwrap());
    g.set("general.architecture", Value::string(&"x".repeat(1 << 20)));
    let p = dir.path().join("big-arch.gguf");
    std::fs::write(&p, g.write()).unwrap();
    let m = p.to_str().unwrap();
    for args in [&["run", "-m", m, "-p", "hi"][..], &["run", "-m", m, "-p", "hi", "--resident"], &["plan", "-m", m]] {
        let o = sluice(args, dir.path());
        assert_clean_error(&o, "more bytes).block_count");
        assert!(o.stderr.len() < 1024, "{args:?}: a {}-byte message", o.stderr.len());
    }
}

#[test]
fn quantize_writes_a_model_that_runs_and_refuses_what_it_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let f32_model = dir.path().join("f32.gguf");
    let o = sluice(&["synth", "--out", f32_model.to_str().unwrap(), "--type", "f32"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let m = f32_model.to_str().unwrap();
    let out = dir.path().join("q8.gguf");
    let o = sluice(&["quantize", "-m", m, "-o", out.to_str().unwrap(), "--type", "q8_0"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), out.to_str().unwrap(), "the last line is the new file");
    assert!(!dir.path().join("q8.gguf.partial").exists());
    let o = sluice(&["run", "-m", out.to_str().unwrap(), "-p", "hi", "-n", "4"], dir.path());
    assert!(o.status.success(), "the quantized model does not run: {}", stderr(&o));
    assert_clean_error(&sluice(&["quantize", "-m", m, "-o", "x.gguf", "--type", "f16"], dir.path()), "--type f16");
    assert_clean_error(&sluice(&["quantize", "-m", m, "-o", m, "--type", "q8_0"], dir.path()), "is the --model");
}

#[test]
fn replay_reads_a_foreign_trace_at_shares_of_the_experts_and_writes_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    // Two layers of four 1 MiB experts, top-1, six decodes of one BigMoeOnEdge turn.
    let mut text = "# route_trace v1\n# model=/m/Tiny.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=1\n\
                    # layer=0 expert_bytes=1048576 dense_bytes=1\n# layer=1 expert_bytes=1048576 dense_bytes=1\n\
                    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
        .to_string();
    for (step, e) in [0, 1, 0, 1, 0, 2].into_iter().enumerate() {
        for layer in 0..2 {
            text += &format!("0,1,{step},{layer},0,{e},1.0,0,1048576\n");
        }
    }
    let trace = dir.path().join("t.route.csv");
    std::fs::write(&trace, text).unwrap();
    let csv = dir.path().join("replay.csv");
    let o = sluice(
        &["replay", "--trace", trace.to_str().unwrap(), "--cache-share", "25,50", "--csv", csv.to_str().unwrap()],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("12 layer steps (6 single-token decodes) of 2 layers x 4 experts"), "{}", stderr(&o));
    let csv = std::fs::read_to_string(csv).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows[0], "policy,cache,hit_pct,of_min_pct");
    // At half the experts (four), every policy keeps 0 and 1 of both layers: 6 hits of 12.
    for policy in ["lru", "frequency", "adaptive", "default", "best-fixed-set", "belady-min"] {
        assert!(rows.iter().any(|r| r.starts_with(&format!("{policy},50%,50.0,"))), "{policy}: {csv}");
    }
    let o = sluice(&["replay", "--trace", trace.to_str().unwrap(), "--cache-share", "0"], dir.path());
    assert_clean_error(&o, "give a percentage above 0 and at most 100");
    let o = sluice(&["replay", "--trace", trace.to_str().unwrap()], dir.path());
    assert_clean_error(&o, "give --cache-mb or --cache-share");
}

#[test]
fn run_records_its_routes_and_forces_them_back_and_refuses_routes_of_another_shape() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let routes = dir.path().join("own.route.csv");
    let routes = routes.to_str().unwrap();
    let o = sluice(&["run", "-m", &model, "-p", "hello there", "-n", "6", "--record-routes", routes], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let recorded = std::fs::read_to_string(routes).unwrap();
    assert!(recorded.starts_with("# route_trace v1\n# model=m.gguf arch=qwen3moe n_layer=2 n_expert=8"), "{recorded}");
    let o = sluice(&["run", "-m", &model, "-p", "hello there", "-n", "64", "--routes", routes], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("generating 5 tokens"), "the routes hold the prompt and 5 decodes: {}", stderr(&o));
    assert!(text.starts_with(stdout(&o).trim_end()), "its own routes give its own text");
    let o = sluice(
        &["run", "-m", &model, "-p", "hello there", "-n", "8", "--routes", routes, "--routes-end", "wrap"],
        dir.path(),
    );
    assert!(o.status.success() && stderr(&o).contains("generating 8 tokens"), "{}", stderr(&o));

    let other = dir.path().join("other.route.csv");
    std::fs::write(&other, recorded.replace("n_layer=2", "n_layer=3")).unwrap();
    let o = sluice(&["run", "-m", &model, "-p", "hi", "--routes", other.to_str().unwrap()], dir.path());
    assert_clean_error(&o, "it routes 3 layers of 8 experts, and the model has 2 layers of 8");
    let o = sluice(&["run", "-m", &model, "-p", "hi", "--routes", routes, "--draft", "ngram"], dir.path());
    assert_clean_error(&o, "give --draft off");
    let o = sluice(&["serve", "-m", &model, "--routes", routes], dir.path());
    assert!(!o.status.success() && stderr(&o).contains("--routes"), "{}", stderr(&o));
}

#[test]
fn a_kv_cache_type_or_a_context_the_model_cannot_take_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model(dir.path());
    let o = sluice(&["run", "-m", &model, "-p", "hi", "--cache-type-k", "q9_0"], dir.path());
    assert_clean_error(&o, "invalid value 'q9_0' for '--cache-type-k <TYPE>'");
    assert!(stderr(&o).contains("q8_0"), "the message lists the types: {}", stderr(&o));
    let o = sluice(&["run", "-m", &model, "-p", "hi", "--ctx", "100000"], dir.path());
    assert_clean_error(&o, "a context of 100000 positions is more than the model's context length 4096");
    let o = sluice(
        &["run", "-m", &model, "-p", "hi", "-n", "4", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
}
