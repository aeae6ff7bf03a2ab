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
    assert!(server.log().contains("INFO  sluice::serve::shared] ready"), "{}", server.log());

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
            r#"{"prompt":"hi","logit_biases":{}}"#,
            400,
            Some("logit_biases"),
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
            Some("messages[0].content"),
            "a user message needs content",
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
    // Anthropic's clients retry its 529 overloaded_error.
    let message = r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
    let busy = server.request("POST", "/v1/messages", Some(message));
    assert_eq!(busy.status, 529, "{}", busy.body);
    assert_eq!(busy.json()["error"]["type"], "overloaded_error", "{}", busy.body);
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
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    if let Some(out) = client_script(dir.path(), &model, "openai-check.py", "openai") {
        assert!(out.contains("23 passed, 0 failed"), "{out}");
    }
}

/// A bounded schema: every answer the grammar allows ends within a few dozen tokens.
const SCHEMA: &str = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":9},"ok":{"type":"boolean"}},"required":["n","ok"],"additionalProperties":false}"#;
const WEATHER_TOOL: &str = r#"{"type":"function","function":{"name":"get_weather","description":"Weather in a city","parameters":{"type":"object","properties":{"city":{"type":"string","enum":["Paris","Oslo"]}},"required":["city"],"additionalProperties":false}}}"#;

#[test]
fn structured_output_always_parses_and_follows_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    for seed in 0..20 {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"A number and a flag, as JSON"}}],"max_tokens":400,"temperature":1,"seed":{seed},"chat_template_kwargs":{{"enable_thinking":false}},"response_format":{{"type":"json_schema","json_schema":{{"name":"answer","schema":{SCHEMA}}}}}}}"#
        );
        let r = server.request("POST", "/v1/chat/completions", Some(&body));
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "seed {seed}: the grammar ends the answer: {}", r.body);
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let answer: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        let obj = answer.as_object().unwrap_or_else(|| panic!("seed {seed}: {text:?} is not an object"));
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["n", "ok"], "seed {seed}: {text:?}");
        assert!(obj["n"].as_u64().is_some_and(|n| n <= 9), "seed {seed}: {text:?}");
        assert!(obj["ok"].is_boolean(), "seed {seed}: {text:?}");
    }
    // json_object: any object.
    let body = r#"{"messages":[{"role":"user","content":"JSON"}],"max_tokens":200,"temperature":0,"chat_template_kwargs":{"enable_thinking":false},"response_format":{"type":"json_object"}}"#;
    let r = server.request("POST", "/v1/chat/completions", Some(body));
    let v = r.json();
    if v["choices"][0]["finish_reason"] == "stop" {
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(serde_json::from_str::<Value>(text).is_ok_and(|a| a.is_object()), "{text:?}");
    }
    // A schema the grammar converter cannot enforce is refused, never answered unconstrained.
    let body = r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","properties":{"a":{"$ref":"https://example.com/a.json"}}}}}}"#;
    let refused = server.request("POST", "/v1/chat/completions", Some(body));
    assert_api_error(&refused, 400, Some("response_format.json_schema.schema"), "properties.a.$ref");
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

/// The tool calls of a chat answer: (id, name, arguments).
fn tool_calls(message: &Value) -> Vec<(String, String, String)> {
    message["tool_calls"]
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let f = &c["function"];
                    (
                        c["id"].as_str().unwrap().to_string(),
                        f["name"].as_str().unwrap().to_string(),
                        f["arguments"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn tool_calls_are_parsed_streamed_and_taken_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    let ask = |stream: bool| {
        format!(
            r#"{{"messages":[{{"role":"user","content":"Weather in Paris?"}}],"tools":[{WEATHER_TOOL}],"tool_choice":"required","max_tokens":200,"temperature":0,"stream":{stream},"reasoning_effort":"none"}}"#
        )
    };
    let r = server.request("POST", "/v1/chat/completions", Some(&ask(false)));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{}", r.body);
    let calls = tool_calls(&choice["message"]);
    assert!(!calls.is_empty(), "{}", r.body);
    for (_, name, arguments) in &calls {
        assert_eq!(name, "get_weather");
        let args: Value = serde_json::from_str(arguments).unwrap();
        assert!(args["city"] == "Paris" || args["city"] == "Oslo", "{arguments}");
    }
    let (id, _, arguments) = &calls[0];
    let args: Value = serde_json::from_str(arguments).unwrap();

    // Streamed: deltas that add up to the same first call.
    let r = server.request("POST", "/v1/chat/completions", Some(&ask(true)));
    let data = sse_data(&r.body);
    let (mut streamed_name, mut streamed_args, mut deltas, mut finish) =
        (String::new(), String::new(), 0, String::new());
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).unwrap();
        let c = &c["choices"][0];
        if let Some(calls) = c["delta"]["tool_calls"].as_array() {
            for call in calls {
                if call["index"] != 0 {
                    continue;
                }
                deltas += 1;
                if let Some(n) = call["function"]["name"].as_str() {
                    streamed_name.push_str(n);
                    assert!(call["id"].is_string() && call["type"] == "function", "{d}");
                }
                streamed_args.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        finish = c["finish_reason"].as_str().map(str::to_string).unwrap_or(finish);
    }
    assert_eq!((streamed_name.as_str(), finish.as_str()), ("get_weather", "tool_calls"), "{}", r.body);
    assert_eq!(serde_json::from_str::<Value>(&streamed_args).unwrap(), args, "{}", r.body);
    assert!(deltas > 1, "the call's arguments arrive over several deltas: {}", r.body);

    // The round trip: the call and its result go back; the template renders them.
    let back = format!(
        r#"{{"messages":[{{"role":"user","content":"Weather in Paris?"}},{{"role":"assistant","content":null,"tool_calls":[{{"id":"{id}","type":"function","function":{{"name":"get_weather","arguments":{arguments:?}}}}}]}},{{"role":"tool","tool_call_id":"{id}","content":"sunny, 18 C"}}],"tools":[{WEATHER_TOOL}],"tool_choice":"none","max_tokens":8,"temperature":0}}"#
    );
    let r = server.request("POST", "/v1/chat/completions", Some(&back));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 40, "{}", r.body);
    assert!(tool_calls(&v["choices"][0]["message"]).is_empty(), "tool_choice none: {}", r.body);

    // A model whose template has no tool-call syntax (ChatML) calls in the generic JSON form.
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
    let plain = synth(dir.path());
    let mut server = Server::start(dir.path(), &plain, &[]);
    server.wait_note("READY=1");
    let r = server.request("POST", "/v1/chat/completions", Some(&ask(false)));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{}", r.body);
    assert_eq!(tool_calls(&v["choices"][0]["message"])[0].1, "get_weather", "{}", r.body);
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn logprobs_usage_and_model_lookup_follow_openai() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    // Greedy: the chosen token is the likeliest, so it heads its own alternatives.
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":6,"temperature":0,"logprobs":true,"top_logprobs":3}"#;
    let v = server.request("POST", "/v1/chat/completions", Some(body)).json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), v["usage"]["completion_tokens"].as_u64().unwrap() as usize);
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["logprob"], t["logprob"], "{t}");
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()), "{t}");
    }
    let body = r#"{"prompt":"The quick brown fox","max_tokens":5,"temperature":0,"logprobs":2}"#;
    let v = server.request("POST", "/v1/completions", Some(body)).json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{v}");
    let text: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(lp["text_offset"][0], 0);
    if !text.contains('\u{fffd}') {
        assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    }
    // include_usage: every chunk says usage null, one last chunk carries it.
    let body = r#"{"prompt":"The quick brown fox","max_tokens":4,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}"#;
    let r = server.request("POST", "/v1/completions", Some(body));
    let data = sse_data(&r.body);
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 4);
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert!(first["usage"].is_null() && first.get("usage").is_some());
    // GET /v1/models/{id}.
    assert_eq!(server.request("GET", "/v1/models/m", None).json()["id"], "m");
    assert_api_error(&server.request("GET", "/v1/models/other", None), 404, Some("model"), "does not exist");
    // An editor's Ollama mode: the names /api/tags lists, then chat and completions over
    // OpenAI's API.
    let tags = server.request("GET", "/api/tags", None).json();
    let listed = tags["models"][0]["name"].as_str().unwrap().to_string();
    assert_eq!(listed, "m:latest", "{tags}");
    assert_eq!(server.request("GET", &format!("/v1/models/{listed}"), None).status, 200);
    for (path, body) in [
        (
            "/v1/chat/completions",
            format!(r#"{{"model":"{listed}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":2}}"#),
        ),
        ("/v1/completions", format!(r#"{{"model":"{listed}","prompt":"Hi","max_tokens":2}}"#)),
        ("/v1/responses", format!(r#"{{"model":"{listed}","input":"Hi","max_output_tokens":2}}"#)),
    ] {
        let r = server.request("POST", path, Some(&body));
        assert_eq!(r.status, 200, "{path} with the listed name {listed}: {}", r.body);
    }
    // Known fields are accepted; n > 1 and image parts are refused with the field named.
    let ok = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"user":"u","store":false,"metadata":{"a":"b"},"service_tier":"auto","top_k":5,"min_p":0.05,"presence_penalty":0.5,"frequency_penalty":0.5,"repetition_penalty":1.1,"seed":9}"#;
    assert_eq!(server.request("POST", "/v1/chat/completions", Some(ok)).status, 200);
    let n2 = r#"{"messages":[{"role":"user","content":"Hi"}],"n":2}"#;
    assert_api_error(&server.request("POST", "/v1/chat/completions", Some(n2)), 400, Some("n"), "n = 1");
    let image = r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:,"}}]}]}"#;
    assert_api_error(
        &server.request("POST", "/v1/chat/completions", Some(image)),
        400,
        Some("messages[0].content[0]"),
        "text-only",
    );
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

/// The served context without `--ctx`: 8192 positions (what Ollama's clients assume) where the
/// board's plan keeps that KV cache within an eighth of the budget, else less.
#[test]
fn without_ctx_the_context_is_what_the_board_s_plan_affords() {
    let dir = tempfile::tempdir().unwrap();
    let synth = |name: &str, shape: &[&str]| {
        let path = dir.path().join(name);
        let o = sluice_command()
            .args(["synth", "--out", path.to_str().unwrap(), "--ctx", "32768"])
            .args(shape)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        path
    };
    let served_context = |model: &std::path::Path, budget_mib: u32| {
        let profile = dir.path().join(format!("board-{budget_mib}.toml"));
        let generic = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../boards/generic.toml")).unwrap();
        std::fs::write(&profile, generic.replace("[memory]", &format!("[memory]\nbudget_mib = {budget_mib}"))).unwrap();
        let mut server = Server::start(dir.path(), model, &["--board", profile.to_str().unwrap()]);
        server.wait_note("READY=1");
        let n_ctx = server.request("GET", "/props", None).json()["default_generation_settings"]["n_ctx"].as_u64();
        let (status, _, _, log) = server.stop();
        assert!(status.success(), "{log}");
        (n_ctx.unwrap(), log)
    };
    // A small KV cache (1 KiB a position): 8192 positions.
    let small = synth("small-kv.gguf", &[]);
    assert_eq!(served_context(&small, 600).0, 8192);
    // 16 KiB a position: 8192 would take 128 MiB of a 600 MiB budget, 4096 takes 64.
    let large = synth("large-kv.gguf", &["--layers", "4", "--heads", "8", "--kv-heads", "8", "--head-dim", "128"]);
    let (n_ctx, log) = served_context(&large, 600);
    assert_eq!(n_ctx, 4096, "{log}");
    assert!(log.contains("context: 4096 positions"), "the log says why: {log}");
    // Never more than the model's own length.
    let short = dir.path().join("m.gguf");
    let o = sluice_command().args(["synth", "--out", short.to_str().unwrap(), "--ctx", "2048"]).output().unwrap();
    assert!(o.status.success());
    assert_eq!(served_context(&short, 600).0, 2048);
}
