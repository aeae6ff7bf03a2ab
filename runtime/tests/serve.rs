//! `sluice serve` end to end, as systemd and an HTTP client see it: notifications on a
//! `NOTIFY_SOCKET`, OpenAI-compatible requests (plain, streamed, chat, bad), the bounded queue,
//! a client that disconnects mid-stream, a clean stop on SIGTERM, and warm restarts.

use std::io::BufReader;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
mod serving;
use common::sluice_command;
use serving::*;

const GREEDY: &str = r#"{"prompt":"The quick brown fox","max_tokens":24,"temperature":0}"#;

#[test]
fn serve_answers_openai_requests_notifies_systemd_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let state = dir.path().join("state");
    let mut server = Server::start(
        dir.path(),
        &model,
        &["--drain-secs", "5", "--state-dir", state.to_str().unwrap(), "--save-secs", "1"],
    );
    server.wait_note("READY=1");
    let notes = server.notes();
    let ready_at = notes.iter().position(|n| n == "READY=1").unwrap();
    assert!(
        notes[..ready_at].iter().any(|n| n.starts_with("STATUS=loading: reading dense weights")),
        "READY=1 must follow the load: {notes:?}"
    );
    assert!(notes[..ready_at].iter().any(|n| n.starts_with("EXTEND_TIMEOUT_USEC=")), "{notes:?}");
    assert!(server.log().contains("INFO  sluice::serve] ready"), "{}", server.log());

    let health = server.request("GET", "/health", None);
    assert_eq!((health.status, health.json()["status"].as_str()), (200, Some("ready")));
    let models = server.request("GET", "/v1/models", None).json();
    assert_eq!(models["data"][0]["id"], "m");

    // Completions: greedy is deterministic; streamed chunks join to the same text.
    let plain = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_eq!(plain.status, 200, "{}", plain.body);
    let v = plain.json();
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert!(!text.is_empty());
    let again = server.request("POST", "/v1/completions", Some(GREEDY)).json();
    assert_eq!(again["choices"][0]["text"].as_str().unwrap(), text);
    let streamed = server.request(
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"The quick brown fox","max_tokens":24,"temperature":0,"stream":true}"#),
    );
    assert_eq!(streamed.status, 200);
    assert_eq!(streamed.header("content-type").as_deref(), Some("text/event-stream"));
    assert!(sse_data(&streamed.body).len() > 3, "one event per token: {}", streamed.body);
    assert_eq!(streamed_text(&streamed.body, false), (text.clone(), "length".to_string()));

    // A stop sequence taken from the greedy text ends it there.
    let cut: String = text.chars().skip(3).take(2).collect();
    let stop_body = serde_json::json!({"prompt":"The quick brown fox","max_tokens":24,"temperature":0,"stop":[cut]});
    let stopped = server.request("POST", "/v1/completions", Some(&stop_body.to_string())).json();
    let expected = &text[..text.find(&cut).unwrap()];
    assert_eq!(stopped["choices"][0]["text"].as_str().unwrap(), expected);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    // Sampling with a seed repeats; temperature 0 is greedy.
    let seeded = r#"{"prompt":"The quick brown fox","max_tokens":16,"temperature":0.8,"seed":42}"#;
    let a = server.request("POST", "/v1/completions", Some(seeded)).json();
    let b = server.request("POST", "/v1/completions", Some(seeded)).json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // Chat, plain and streamed.
    let chat = r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello"}],"max_tokens":12,"temperature":0}"#;
    let c = server.request("POST", "/v1/chat/completions", Some(chat));
    assert_eq!(c.status, 200, "{}", c.body);
    let c = c.json();
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    let chat_text = c["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let chat_stream = chat.replace("\"temperature\":0", "\"temperature\":0,\"stream\":true");
    let cs = server.request("POST", "/v1/chat/completions", Some(&chat_stream));
    let first: Value = serde_json::from_str(&sse_data(&cs.body)[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(streamed_text(&cs.body, true).0, chat_text);

    // Bad input: a 4xx with an OpenAI error body, every time, and the server carries on.
    let bad = [
        ("/v1/completions", r#"{"prompt":"hi""#, 400, None, "not valid JSON"),
        ("/v1/completions", r#"{"prompt":"hi","max_tokens":"many"}"#, 400, Some("max_tokens"), "invalid type"),
        ("/v1/completions", r#"{"prompt":5}"#, 400, Some("prompt"), "a string or an array of one string"),
        (
            "/v1/completions",
            r#"{"prompt":"hi","logit_bias":{}}"#,
            400,
            Some("logit_bias"),
            "Unrecognized request argument",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":100000}"#,
            400,
            Some("max_tokens"),
            "maximum context length is 4096",
        ),
        ("/v1/completions", r#"{"prompt":"hi","temperature":-1}"#, 400, Some("temperature"), "out of range"),
        ("/v1/completions", r#"{"prompt":"hi","model":"gpt-4"}"#, 404, Some("model"), "does not exist"),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user"}]}"#,
            400,
            Some("messages[0]"),
            "missing field `content`",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x","extra":1}]}"#,
            400,
            Some("messages[0].extra"),
            "Unrecognized",
        ),
        ("/v1/chat/completions", r#"[1,2]"#, 400, None, "must be a JSON object"),
        ("/v1/chat/completions", r#"{"model":"m"}"#, 400, Some("messages"), "missing field `messages`"),
    ];
    for (path, body, status, param, needle) in bad {
        let r = server.request("POST", path, Some(body));
        assert_api_error(&r, status, param, needle);
    }
    let long_prompt = serde_json::json!({ "prompt": "fox ".repeat(5000), "max_tokens": 4 }).to_string();
    let r = server.request("POST", "/v1/completions", Some(&long_prompt));
    assert_api_error(&r, 400, Some("max_tokens"), "maximum context length");
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_api_error(&server.request("GET", "/v1/nothing", None), 404, None, "no such endpoint");
    assert_api_error(&server.request("GET", "/v1/completions", None), 405, None, "does not take GET");
    let after = server.request("POST", "/v1/completions", Some(GREEDY)).json();
    assert_eq!(after["choices"][0]["text"].as_str().unwrap(), text, "bad requests must not disturb the next");

    let metrics = server.request("GET", "/metrics", None);
    for needle in [
        "sluice_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
        "sluice_requests_total{endpoint=\"/v1/completions\",status=\"400\"}",
        "sluice_completion_tokens_total",
        "sluice_decode_tokens_per_second",
        "sluice_expert_cache_hit_ratio",
        "sluice_expert_bytes_read_total",
        "sluice_ledger_bytes{item=\"KV cache\"}",
        "sluice_resident_memory_bytes",
        "sluice_state{state=\"ready\"} 1",
    ] {
        assert!(metrics.body.contains(needle), "/metrics lacks {needle}:\n{}", metrics.body);
    }
    assert!(server.metric("sluice_expert_bytes_read_total") > 0.0);

    // The watchdog is pinged while the engine is alive (every 0.2 s for WATCHDOG_USEC 0.4 s).
    let t0 = Instant::now();
    while server.notes().iter().filter(|n| *n == "WATCHDOG=1").count() < 3 {
        assert!(t0.elapsed() < PATIENCE, "no WATCHDOG=1 pings: {:?}", server.notes());
        std::thread::sleep(Duration::from_millis(50));
    }

    // The heat map is saved while serving (every --save-secs), not only at the end.
    let t0 = Instant::now();
    while !state.join("expert-heat.bin").is_file() {
        assert!(t0.elapsed() < PATIENCE, "no periodic heat-map save; log:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }

    let (status, _, notes, log) = server.stop();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(notes.iter().any(|n| n == "STOPPING=1"), "{notes:?}");
    assert!(log.contains("stopped"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

/// Starts a long streamed generation and returns its connection once the first token arrived.
fn long_stream(addr: SocketAddr) -> BufReader<TcpStream> {
    let body = r#"{"prompt":"The quick brown fox","max_tokens":3000,"temperature":0,"stream":true}"#;
    let mut r = BufReader::new(send(addr, "POST", "/v1/completions", Some(body)));
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    let first = read_chunk(&mut r).expect("a first event");
    assert!(first.starts_with("data: "), "{first}");
    r
}

#[test]
fn a_full_queue_gets_503_and_a_disconnect_cancels_without_harming_the_next_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--queue", "1", "--drain-secs", "5"]);
    server.wait_note("READY=1");
    let reference = server.request("POST", "/v1/completions", Some(GREEDY)).json()["choices"][0]["text"].clone();

    // One running, one queued, the third is turned away at once.
    let running = long_stream(server.addr);
    let queued = {
        let addr = server.addr;
        std::thread::spawn(move || request(addr, "POST", "/v1/completions", Some(GREEDY)))
    };
    let t0 = Instant::now();
    while server.metric("sluice_queued_requests") < 1.0 {
        assert!(t0.elapsed() < PATIENCE, "the second request never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let busy = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_api_error(&busy, 503, None, "queue is full");
    assert_eq!(busy.header("retry-after").as_deref(), Some("1"));

    // The running client goes away mid-stream: its generation is cancelled, the queued request
    // then runs and gets the same text as before.
    drop(running);
    let q = queued.join().unwrap();
    assert_eq!(q.status, 200, "{}", q.body);
    assert_eq!(q.json()["choices"][0]["text"], reference);
    assert_eq!(server.metric("sluice_generations_cancelled_total"), 1.0);
    let completed = server.metric("sluice_completion_tokens_total");
    assert!(completed < 3000.0 + 2.0 * 24.0, "the cancelled stream ran to its end ({completed} tokens)");
    let next = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_eq!(next.json()["choices"][0]["text"], reference);

    // SIGTERM during a generation: the drain lets it finish or cancels it within the bound.
    let _in_flight = long_stream(server.addr);
    let (status, elapsed, notes, log) = server.stop();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(notes.iter().any(|n| n == "STOPPING=1"), "{notes:?}");
    assert!(elapsed < Duration::from_secs(5 + 20), "took {elapsed:?} to stop with a 5 s drain bound");
}

fn first_request_hit_ratio(dir: &Path, model: &Path, state: &Path) -> (f64, f64, String) {
    let mut server =
        Server::start(dir, model, &["--state-dir", state.to_str().unwrap(), "--cache-mb", "4", "--drain-secs", "5"]);
    server.wait_note("READY=1");
    let warm = server.metric("sluice_warm_start_bytes");
    let r = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_eq!(r.status, 200, "{}", r.body);
    let ratio = server.metric("sluice_expert_cache_hit_ratio");
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
    (ratio, warm, log)
}

#[test]
fn a_restart_is_warm_and_a_corrupt_state_file_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let state = dir.path().join("state");
    let (cold, warm_bytes, log) = first_request_hit_ratio(dir.path(), &model, &state);
    assert_eq!(warm_bytes, 0.0, "nothing to warm from on a first start");
    assert!(log.contains("heat map saved"), "{log}");
    let heat = state.join("expert-heat.bin");
    assert!(heat.is_file());

    let (warm, warm_bytes, log) = first_request_hit_ratio(dir.path(), &model, &state);
    assert!(warm_bytes > 0.0, "the saved heat map pre-fills the cache; log:\n{log}");
    assert!(warm > cold, "first-request hit rate warm {warm} must beat cold {cold}");

    let mut bytes = std::fs::read(&heat).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&heat, &bytes).unwrap();
    let (ratio, warm_bytes, log) = first_request_hit_ratio(dir.path(), &model, &state);
    assert_eq!(warm_bytes, 0.0, "a corrupt heat map is not used");
    assert!(log.contains("not a valid sluice heat map (checksum mismatch)"), "{log}");
    assert_eq!(ratio, cold, "a corrupt file starts as cold as a first start");
}

#[test]
fn chat_prompts_use_the_models_own_template() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("chatml.gguf");
    let o = sluice_command()
        .args(["synth", "--out", model.to_str().unwrap(), "--chat-template", "chatml"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    let chat = r#"{"messages":[{"role":"user","content":"Hello"}],"max_tokens":12,"temperature":0}"#;
    let c = server.request("POST", "/v1/chat/completions", Some(chat)).json();
    // The same text as a completion of the prompt ChatML makes of the message.
    let formatted =
        r#"{"prompt":"<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n","max_tokens":12,"temperature":0}"#;
    let p = server.request("POST", "/v1/completions", Some(formatted)).json();
    assert_eq!(c["usage"]["prompt_tokens"], p["usage"]["prompt_tokens"]);
    assert_eq!(c["choices"][0]["message"]["content"], p["choices"][0]["text"]);
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn the_official_openai_client_parses_every_response() {
    // `make test` puts the client in a virtual environment and names its Python here.
    let python = std::env::var("SLUICE_OPENAI_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_client = std::process::Command::new(&python).args(["-c", "import openai"]).output();
    if !has_client.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: {python} cannot import openai (pip install openai, or set SLUICE_OPENAI_PYTHON)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start_with_env(dir.path(), &model, &[], &[("SLUICE_API_KEY", "test-key")]);
    server.wait_note("READY=1");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/openai-check.py");
    let o = std::process::Command::new(&python)
        .args([script, &format!("http://{}/v1", server.addr), "test-key", "m"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("7 passed, 0 failed"), "{out}");
}
