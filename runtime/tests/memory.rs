//! The memory budget as a board sees it: a streamed run, and a server with four slots generating
//! at once, inside a memory cgroup stay within their ledger (peak RSS at most the ledger total
//! plus 5%) without hitting the cgroup's limit, and `sluice bench --budget-mb` completes and
//! writes its CSV and SVG. Both need to create memory
//! cgroups (root); they are skipped, saying so, where that is impossible, and under qemu-user,
//! whose own translation memory is not the runtime's.

use std::path::Path;
use std::process::{Command, Output};

use sluice_hal::cgroup::MemoryCgroup;

mod common;
mod serving;
use common::emulated;

fn sluice(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(args).env_remove("RUST_LOG");
    c
}

fn synth(dir: &Path, size: &str) -> String {
    let p = dir.join("m.gguf");
    let o = sluice(&["synth", "--out", p.to_str().unwrap(), "--size", size, "--layers", "4"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    p.to_string_lossy().into_owned()
}

/// A cgroup of `mib`, or the reason there is none.
fn cgroup(name: &str, mib: u64) -> Option<MemoryCgroup> {
    if emulated() {
        eprintln!("skipped: under qemu-user the process's memory is the emulator's");
        return None;
    }
    let cg = match MemoryCgroup::create(&format!("{name}-{}", std::process::id()), mib << 20) {
        Ok(cg) => cg,
        Err(e) => {
            eprintln!("skipped: {e}");
            return None;
        }
    };
    // Some hierarchies (a container's, a v2 cgroup with processes of its own) refuse members.
    let procs = cg.dir().join("cgroup.procs");
    let joined = Command::new("sh").args(["-c", &format!("echo $$ > {}", procs.display())]).status();
    if !joined.is_ok_and(|s| s.success()) {
        eprintln!("skipped: cannot move a process into {}", cg.dir().display());
        return None;
    }
    Some(cg)
}

fn check(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "sluice failed: {err}");
    err
}

#[test]
fn a_streamed_run_in_a_memory_cgroup_stays_within_its_ledger() {
    let Some(cg) = cgroup("sluice-test-rss", 192) else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), "300MiB");
    let csv = dir.path().join("run.csv");
    // The shell joins the cgroup, then becomes sluice: everything sluice holds is charged there.
    let script = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cg.dir().display());
    let o = Command::new("sh")
        .args([
            "-c",
            &script,
            "sh",
            env!("CARGO_BIN_EXE_sluice"),
            "run",
            "-m",
            &model,
            "-p",
            "a board with little memory",
        ])
        .args(["-n", "24", "--csv", csv.to_str().unwrap()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = check(&o);
    let text = std::fs::read_to_string(&csv).unwrap();
    let field = |key: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("# {key} = ")))
            .unwrap_or_else(|| panic!("no {key} in the CSV: {text}"))
            .parse()
            .unwrap()
    };
    let (total, budget, peak) = (field("ledger_total_bytes"), field("budget_bytes"), field("peak_rss_bytes"));
    assert_eq!(budget, 192 << 20, "the budget is the cgroup's limit: {err}");
    assert!(total <= budget, "{err}");
    assert!(peak as f64 <= total as f64 * 1.05, "peak RSS {peak} over the ledger total {total} + 5%: {err}");
    assert!(field("cache_bytes") > 0, "the budget leaves room for a cache: {err}");
    assert_eq!(cg.limit_hits(), Some(0), "the run leaned on reclaim: {err}");
}

#[test]
fn four_busy_slots_in_a_memory_cgroup_stay_within_the_ledger() {
    let Some(cg) = cgroup("sluice-test-slots", 192) else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), "300MiB");
    let join = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cg.dir().display());
    let wrapper = ["sh", "-c", &join, "sh"];
    let args = ["--slots", "4", "--ctx", "256", "--batch", "64"];
    let mut server = serving::Server::start_under(dir.path(), Path::new(&model), &args, &wrapper);
    server.wait_note("READY=1");
    let prompts = ["a board with little memory", "four clients at once", "the river runs", "a quiet lake"];
    std::thread::scope(|s| {
        for p in prompts {
            let server = &server;
            s.spawn(move || {
                let body = serde_json::json!({ "prompt": p, "max_tokens": 32, "temperature": 0 }).to_string();
                let r = server.request("POST", "/v1/completions", Some(&body));
                assert_eq!(r.status, 200, "{}", r.body);
            });
        }
    });
    assert!(server.metric("sluice_shared_decodes_total") > 0.0, "the slots never ran together");
    let status = server.request("GET", "/status", None).json();
    let memory = &status["memory"];
    let total: u64 = memory["ledger"].as_array().unwrap().iter().map(|l| l["bytes"].as_u64().unwrap()).sum();
    let (peak, budget) = (memory["rss_peak_bytes"].as_u64().unwrap(), memory["budget_bytes"].as_u64().unwrap());
    assert_eq!(budget, 192 << 20, "the budget is the cgroup's limit: {status}");
    assert!(peak as f64 <= total as f64 * 1.05, "peak RSS {peak} over the ledger total {total} + 5%: {status}");
    assert_eq!(cg.limit_hits(), Some(0), "the server leaned on reclaim: {}", server.log());
}

#[test]
fn bench_under_a_budget_writes_its_table_csv_and_chart() {
    let Some(probe) = cgroup("sluice-test-bench-probe", 64) else { return };
    drop(probe);
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), "200MiB");
    let out = dir.path().join("out");
    let args =
        ["bench", "-m", &model, "--budget-mb", "192", "-n", "6", "--conversations", "--out", out.to_str().unwrap()];
    let lossy = ["--prompt-tokens", "64", "--draft", "ngram", "--experts-used", "1", "--substitute", "2"];
    let o = sluice(&[&args[..], &lossy[..]].concat()).output().unwrap();
    check(&o);
    let table = String::from_utf8_lossy(&o.stdout);
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("a 64-token prompt"), "{said}");
    for needle in [
        "resident-mmap",
        "streamed, no cache",
        "streamed, auto cache",
        "auto overlap",
        "ngram draft",
        "draft acc %",
        "LOSSY 1 of 2 experts",
        "LOSSY substitute from 2 ranks",
        "top-1 %",
        "mean KL",
        "prefill MiB",
        "cgroup peak MiB",
        "% ceiling",
        "storage ceiling",
    ] {
        assert!(table.contains(needle), "{needle:?} missing:\n{table}");
    }
    let csv = std::fs::read_to_string(out.join("bench.csv")).unwrap();
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let header = reader.headers().unwrap().clone();
    let col = |name: &str| header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no {name} in {csv}"));
    let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    assert_eq!(records.len(), 11, "resident, 6 streamed, 2 drafting, 2 lossy:\n{csv}");
    for r in &records {
        let (config, top1, kl) = (&r[col("config")], &r[col("top1_agreement")], &r[col("mean_kl")]);
        if config.contains("LOSSY") {
            let top1: f64 = top1.parse().unwrap();
            let kl: f64 = kl.parse().unwrap();
            assert!((0.0..=1.0).contains(&top1) && kl >= 0.0, "{config}: top-1 {top1}, KL {kl}");
        } else {
            assert_eq!(&r[col("same_text")], "true", "{config} generates the resident tokens:\n{csv}");
            assert!(top1.is_empty() && kl.is_empty(), "{config} is exact:\n{csv}");
        }
        if config.starts_with("streamed") {
            let prefill: f64 = r[col("prefill_mib")].parse().unwrap();
            assert!(prefill > 0.0, "{config} read its experts for the 64-token prompt:\n{csv}");
        }
    }
    check_conversations(&std::fs::read_to_string(out.join("conversations.csv")).unwrap());
    let svg = std::fs::read_to_string(out.join("bench.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<rect x=").count() == 11, "{svg}");
}

/// The conversation rows: five turns from an empty slot (nothing reused), five in a kept slot
/// (whole prompt batches reused from the third turn on), the sixth turn warm and after a restart
/// (the saved slot read back keeps as much), the same keeping any prefix (every turn after the
/// first keeps something), and 1, 2 and 4 clients; none hit the cgroup's limit.
fn check_conversations(csv: &str) {
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    let labels: Vec<&str> = records.iter().map(|r| &r[0]).collect();
    assert_eq!(records.len(), 22, "{csv}");
    assert!(labels[..5].iter().all(|l| l.contains("from an empty slot")), "{csv}");
    assert!(labels[5].ends_with(", 0 reused") && labels[9].ends_with(", 1024 reused"), "{csv}");
    assert!(
        labels[10].contains("warm, 1024 reused") && labels[11].contains("restart, saved slot read back, 1024 reused")
    );
    assert!(labels[12].ends_with("0 reused, any prefix (LOSSY)"), "{csv}");
    assert!(labels[13..17].iter().all(|l| !l.contains(" 0 reused")), "any prefix keeps the last prompt:\n{csv}");
    assert!(labels[18].contains("restart, saved slot read back") && labels[18].ends_with("any prefix (LOSSY)"));
    for (label, n) in labels[19..].iter().zip(["1 client", "2 clients", "4 clients"]) {
        assert!(label.starts_with(n), "{csv}");
    }
    for r in &records {
        assert_eq!(&r[7], "0", "{} hit the cgroup's limit:\n{csv}", &r[0]);
        assert!(r[3].parse::<f64>().unwrap() > 0.0, "{} generated nothing:\n{csv}", &r[0]);
    }
}

/// `make bench-board`'s recipe at CI's size (scripts/bench-board's small shape): a drawn Q4_K_M
/// model, routed by its own recorded routes, benched in a memory cgroup with its reads throttled;
/// the results table has every mode with the columns a board owner reads.
#[test]
fn bench_board_small_shape_writes_its_results_table() {
    let Some(probe) = cgroup("sluice-test-board-probe", 64) else { return };
    drop(probe);
    // On the build's disk: the throttle needs a block device under the model.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/bench-board");
    let o = Command::new(script)
        .args([env!("CARGO_BIN_EXE_sluice"), dir.path().to_str().unwrap(), "record", "small"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    check(&o);
    let csv = std::fs::read_to_string(dir.path().join("results.csv")).unwrap();
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
    assert_eq!(
        header.join(","),
        "board,speed_mbs,mode,tok_s,ttft_s,hit_pct,mib_per_token,stall_ms,io_bound_tok_s,compute_tok_s,of_bound_pct,x_mmap"
    );
    let rows: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    let modes: Vec<&str> = rows.iter().map(|r| &r[2]).collect();
    assert_eq!(modes, ["mmap", "no-cache", "auto-cache", "overlap", "default", "lossy"], "{csv}");
    for r in &rows {
        let number = |i: usize| r[i].parse::<f64>().unwrap_or_else(|_| panic!("column {} of {r:?}", header[i]));
        assert!(number(3) > 0.0 && number(9) > 0.0 && number(11) > 0.0, "{r:?}");
        if &r[2] != "mmap" {
            assert!(number(6) > 0.0 && number(8) > 0.0 && number(10) > 0.0, "a streamed row reads experts: {r:?}");
            assert!(number(7) >= 0.0, "a streamed row has its wait for storage: {r:?}");
        }
    }
    let svg = std::fs::read_to_string(dir.path().join("results.svg")).unwrap();
    assert_eq!(svg.matches("<rect ").count(), 6, "{svg}");
    // The KV cache's rows: the default row at a long context with an f16 and a q8_0 cache.
    let kv = std::fs::read_to_string(dir.path().join("kv.csv")).unwrap();
    let types: Vec<String> =
        csv::Reader::from_reader(kv.as_bytes()).records().map(|r| r.unwrap()[3].to_string()).collect();
    assert_eq!(types, ["f16", "q8_0"], "{kv}");
}
