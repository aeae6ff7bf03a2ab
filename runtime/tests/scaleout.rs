//! Several boards serving one model: `sluice worker`s on loopback, each in a memory cgroup of
//! its budget where this machine lets the test make one, and `plan`, `run` and `serve --rpc` on
//! the head: the same greedy text as resident, the plan within each worker's budget, and a worker
//! killed mid-generation (the request fails naming it, the server is degraded until it is back,
//! then serves again).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
mod serving;
mod workers;
use common::sluice_command;
use serving::{free_port, read_chunk, read_head, send, Server, PATIENCE};
use workers::{SilentProxy, Worker};

/// Budget of each test worker (and its cgroup's limit).
const WORKER_MIB: u64 = 256;
/// The fixture's end-of-sequence token (synth's vocabulary), biased away so a generation runs
/// to its length.
const EOS: u32 = 2;

fn sluice(args: &[&str]) -> Output {
    sluice_command().args(args).output().expect("run sluice")
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "sluice failed:\n{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// A five-layer fixture (so that two workers each get layers beside the head's first) written
/// by `sluice synth` with `args`.
fn fixture(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let path = dir.join(format!("{name}.gguf"));
    ok(&sluice(&[&["synth", "--out", path.to_str().unwrap(), "--layers", "5", "--seed", "7"], args].concat()));
    path
}

/// The gate fixtures' variants: f32, Q8_0, deepseek2 (latent attention, a shared expert, a
/// leading dense layer, a NextN block) and gpt-oss with MXFP4 experts.
const VARIANTS: [(&str, &[&str]); 4] = [
    ("f32", &["--type", "f32"]),
    ("q8_0", &["--type", "q8_0"]),
    ("deepseek2", &["--arch", "deepseek2"]),
    ("gptoss", &["--arch", "gpt-oss", "--type", "mxfp4_moe"]),
];

/// The split `plan --rpc --json` prints, checked: the workers' shares follow the head's layers
/// to the end, each within what its worker had free, the output on the last.
fn checked_split(plan: &Value, workers: &[&Worker]) -> Vec<(u64, u64)> {
    let split = &plan["split"];
    let n_layer = split["n_layer"].as_u64().unwrap();
    let mut start = split["first_remote"].as_u64().unwrap();
    assert!(start >= 1, "the head keeps its first MoE layer: {split}");
    let shares = split["shares"].as_array().unwrap();
    assert_eq!(shares.len(), workers.len(), "{split}");
    let mut out = Vec::new();
    for (s, w) in shares.iter().zip(workers) {
        assert_eq!(s["endpoint"], w.endpoint.as_str(), "{split}");
        let (a, b) = (s["layers"]["start"].as_u64().unwrap(), s["layers"]["end"].as_u64().unwrap());
        assert!(a == start && b > a, "contiguous, non-empty shares: {split}");
        start = b;
        let held = s["weights"].as_u64().unwrap() + s["kv"].as_u64().unwrap() + s["compute"].as_u64().unwrap();
        let (free, total) = (s["free"].as_u64().unwrap(), s["total"].as_u64().unwrap());
        assert!(held > 0 && held <= free && free <= total && total < WORKER_MIB << 20, "{split}");
        out.push((a, b));
    }
    assert_eq!(start, n_layer, "the workers hold the layers to the end: {split}");
    assert_eq!(shares.last().unwrap()["output"], true, "{split}");
    assert!(plan["ledger"]["total"].as_u64().unwrap() <= plan["ledger"]["budget"].as_u64().unwrap(), "{plan}");
    out
}

#[test]
fn two_workers_give_the_resident_text_within_their_budgets() {
    let dir = tempfile::tempdir().unwrap();
    let w1 = Worker::start(dir.path(), "w1", WORKER_MIB, None);
    let w2 = Worker::start(dir.path(), "w2", WORKER_MIB, None);
    let rpc = format!("{},{}", w1.endpoint, w2.endpoint);
    let mut models: Vec<(&str, PathBuf)> =
        VARIANTS.iter().map(|(name, args)| (*name, fixture(dir.path(), name, args))).collect();
    // The small trained KJV models (four layers; the board-shaped one 128 experts wide), where
    // `make test` names them.
    models.extend(common::trained_models());
    for (name, model) in models {
        let m = model.to_str().unwrap();
        let plan: Value =
            serde_json::from_str(&ok(&sluice(&["plan", "-m", m, "--ctx", "256", "--rpc", &rpc, "--json"]))).unwrap();
        let shares = checked_split(&plan, &[&w1, &w2]);
        println!("{name}: head keeps layers 0..{}, workers {shares:?}", shares[0].0);
        let prompt = "The quick brown fox jumps over the lazy dog.";
        let resident = ok(&sluice(&["run", "-m", m, "-p", prompt, "-n", "12", "--resident"]));
        let o = sluice(&["run", "-m", m, "-p", prompt, "-n", "12", "--rpc", &rpc]);
        let split = ok(&o);
        assert_eq!(split, resident, "{name}: --rpc generated other text than resident");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(&format!("{} ", w1.endpoint)) && err.contains("+ output"), "{name}: {err}");
    }
    w1.assert_within_cgroup(WORKER_MIB);
    w2.assert_within_cgroup(WORKER_MIB);
}

#[test]
fn a_worker_with_no_room_and_an_absent_worker_are_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture(dir.path(), "m", &[]);
    let m = model.to_str().unwrap();
    // Nothing listens there.
    let absent = format!("127.0.0.1:{}", free_port().port());
    let o = sluice(&["plan", "-m", m, "--rpc", &absent]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&format!("cannot use the RPC worker at {absent}")), "{err}");
    assert!(err.contains("sluice worker --listen") && !err.contains("panicked"), "{err}");
    // A worker whose budget leaves nothing to lend does not start.
    let profile = dir.path().join("tiny.toml");
    std::fs::write(&profile, "name = \"tiny\"\n[memory]\nbudget_mib = 8\n").unwrap();
    let o = sluice(&["--board", profile.to_str().unwrap(), "worker", "--listen", &absent, "--no-cache"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("leaves nothing to lend"), "{err}");
    // Malformed lists name the entry.
    let o = sluice(&["plan", "-m", m, "--rpc", "127.0.0.1"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--rpc \"127.0.0.1\": no :PORT"));
}

/// Reads server-sent events from a streaming completion until it ends; returns them joined.
fn rest_of_stream(r: &mut impl BufRead) -> String {
    let mut out = String::new();
    while let Some(chunk) = read_chunk(r) {
        out.push_str(&chunk);
    }
    out
}

fn wait_for_health(server: &Server, status: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let h = server.request("GET", "/health", None).json();
        if h["status"] == status {
            return h;
        }
        assert!(t0.elapsed() < PATIENCE, "no /health {status} after {PATIENCE:?}: {h}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A degraded server answers a request with 503 naming the worker at `endpoint`.
fn assert_refused_naming(server: &Server, endpoint: &str) {
    let r = server.request("POST", "/v1/completions", Some(r#"{"prompt":"hi","max_tokens":4}"#));
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains(endpoint), "{}", r.body);
}

/// A server that serves again gives a request its 16 tokens.
fn assert_serves_16_tokens(server: &Server) {
    let r = server.request(
        "POST",
        "/v1/completions",
        Some(&format!(r#"{{"prompt":"hi","max_tokens":16,"temperature":0,"logit_bias":{{"{EOS}":-100}}}}"#)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 16, "{}", r.body);
}

#[test]
fn a_worker_lost_mid_generation_fails_the_request_and_the_server_serves_again_once_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture(dir.path(), "m", &[]);
    let w1 = Worker::start(dir.path(), "w1", WORKER_MIB, None);
    let mut w2 = Worker::start(dir.path(), "w2", WORKER_MIB, None);
    let rpc = format!("{},{}", w1.endpoint, w2.endpoint);
    let mut server = Server::start(dir.path(), &model, &["--rpc", &rpc, "--ctx", "2048"]);
    server.wait_note("READY=1");
    let body =
        format!(r#"{{"prompt":"hi","max_tokens":2000,"stream":true,"temperature":0,"logit_bias":{{"{EOS}":-100}}}}"#);
    let stream = send(server.addr, "POST", "/v1/completions", Some(&body));
    let mut r = BufReader::new(stream);
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut r).is_some_and(|c| c.contains("data:")), "a first token");
    w2.kill();
    let rest = rest_of_stream(&mut r);
    let lost = format!("lost the RPC worker at {}", w2.endpoint);
    assert!(rest.contains(&lost) && !rest.contains("[DONE]"), "the stream ends with the error: {rest}");
    // Degraded until the worker is back; requests meanwhile get 503 naming it.
    let h = wait_for_health(&server, "degraded");
    assert!(h["reason"].as_str().unwrap().contains(&w2.endpoint), "{h}");
    assert_refused_naming(&server, &w2.endpoint);
    let _w2 = Worker::start(dir.path(), "w2", WORKER_MIB, Some(w2.port()));
    wait_for_health(&server, "ready");
    assert_serves_16_tokens(&server);
    let log = server.log();
    assert!(log.contains("answers again: loading the model") && !log.contains("panicked"), "{log}");
    drop(w1);
}

#[test]
fn a_worker_that_stops_answering_degrades_the_server_until_it_answers_again() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture(dir.path(), "m", &[]);
    let w = Worker::start(dir.path(), "w", WORKER_MIB, None);
    let proxy = SilentProxy::start(&w.endpoint, usize::MAX);
    let mut server =
        Server::start(dir.path(), &model, &["--rpc", &proxy.endpoint, "--ctx", "2048", "--rpc-call-timeout", "10"]);
    server.wait_note("READY=1");
    let body =
        format!(r#"{{"prompt":"hi","max_tokens":2000,"stream":true,"temperature":0,"logit_bias":{{"{EOS}":-100}}}}"#);
    let mut r = BufReader::new(send(server.addr, "POST", "/v1/completions", Some(&body)));
    assert_eq!(read_head(&mut r).0, 200);
    assert!(read_chunk(&mut r).is_some_and(|c| c.contains("data:")), "a first token");
    // The worker stops answering with its connections open: one call bound (10 s here, the
    // default's 60 s would only make the test longer) ends the generation, and the engine does
    // not wait on the worker again while it is silent.
    proxy.silence();
    let rest = rest_of_stream(&mut r);
    assert!(rest.contains(&format!("lost the RPC worker at {}", proxy.endpoint)), "{rest}");
    let h = wait_for_health(&server, "degraded");
    assert!(h["reason"].as_str().unwrap().contains(&proxy.endpoint), "{h}");
    let status = server.request("GET", "/status", None).json();
    assert!(status.to_string().contains(&proxy.endpoint), "/status does not name the worker: {status}");
    assert_refused_naming(&server, &proxy.endpoint);
    // Back: the server loads the model again and serves.
    proxy.speak();
    wait_for_health(&server, "ready");
    assert_serves_16_tokens(&server);
    assert!(!server.log().contains("panicked"), "{}", server.log());
}
