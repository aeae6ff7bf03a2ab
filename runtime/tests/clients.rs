//! The APIs beside OpenAI's, end to end over `sluice serve`: Anthropic's Messages API with the
//! official `anthropic` SDK (a forced tool on every template the agent tests use), Ollama's API
//! with the official `ollama` client, LangChain's ChatOllama and Home Assistant's request
//! sequence, llama-server's utility endpoints, and hostile input to every new route, answered in
//! each API's own error shape. No logit bias or other push: the grammar alone holds the contract.

use std::io::BufReader;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
mod serving;
use common::emulated;
use serving::*;

#[test]
fn the_official_anthropic_sdk_creates_streams_calls_tools_and_counts_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    if let Some(out) = client_script(dir.path(), &model, "anthropic-check.py", "anthropic") {
        assert!(out.contains("anthropic-check: 11 passed, 0 failed"), "{out}");
    }
}

#[test]
fn a_forced_anthropic_tool_is_always_made_on_every_template() {
    if emulated() {
        eprintln!("skipped under an emulator: the SDK tests the HTTP API, which the native run covers");
        return;
    }
    for template in TEMPLATES {
        let dir = tempfile::tempdir().unwrap();
        let model = synth_with(dir.path(), template);
        let args = ["tools-only"];
        if let Some(out) = client_script_with(dir.path(), &model, "anthropic-check.py", "anthropic", &args) {
            assert!(out.contains("anthropic-check: 3 passed, 0 failed"), "{template:?}: {out}");
        }
    }
}

#[test]
fn the_official_ollama_client_langchain_and_home_assistant_work() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    if let Some(out) = client_script(dir.path(), &model, "ollama-check.py", "ollama, langchain_ollama") {
        assert!(out.contains("ollama-check: 22 passed, 0 failed"), "{out}");
    }
}

#[test]
fn utility_endpoints_tokenize_detokenize_render_and_describe() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--model-id", "m"]);
    server.wait_note("READY=1");
    let post = |path: &str, body: Value| server.request("POST", path, Some(&body.to_string()));
    let t = post("/tokenize", json!({"content": "Hello world", "with_pieces": true})).json();
    let tokens = t["tokens"].as_array().unwrap();
    let ids: Vec<Value> = tokens.iter().map(|t| t["id"].clone()).collect();
    assert!(!ids.is_empty(), "{t}");
    let pieces: String = tokens.iter().filter_map(|t| t["piece"].as_str()).collect();
    assert_eq!(pieces, "Hello world");
    let d = post("/detokenize", json!({"tokens": ids})).json();
    assert_eq!(d["content"], "Hello world");
    assert_api_error(
        &post("/detokenize", json!({"tokens": [1 << 30]})),
        400,
        Some("tokens[0]"),
        "not a token of this model",
    );

    // The template's rendering, tokenized, is the prompt a chat request counts.
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let prompt = post("/apply-template", json!({"messages": messages})).json()["prompt"].as_str().unwrap().to_string();
    assert!(prompt.contains("Be brief.") && prompt.contains("Hi"), "{prompt}");
    let counted =
        post("/tokenize", json!({"content": prompt, "add_special": true})).json()["tokens"].as_array().unwrap().len();
    let chat = post("/v1/chat/completions", json!({"messages": messages, "max_tokens": 1})).json();
    assert_eq!(chat["usage"]["prompt_tokens"], counted);
    // Anthropic's request thinks only when asked: its prompt is the chat's with thinking off.
    let counted_anthropic = post(
        "/v1/messages/count_tokens",
        json!({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .json();
    let off = post("/v1/chat/completions", json!({"messages": messages, "max_tokens": 1, "reasoning_effort": "none"}));
    assert_eq!(counted_anthropic["input_tokens"], off.json()["usage"]["prompt_tokens"]);
    let thinking = json!({"type": "enabled", "budget_tokens": 16});
    let counted_thinking = post(
        "/v1/messages/count_tokens",
        json!({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}], "thinking": thinking}),
    )
    .json();
    assert_eq!(counted_thinking["input_tokens"], counted);

    // Thinking off on Qwen3's template: the prompt closes the empty block itself, and the
    // answer does not begin with a forced end tag.
    let off = post(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 4, "temperature": 0, "reasoning_effort": "none"}),
    );
    let content = off.json()["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    assert!(!content.starts_with("</think>"), "{content:?}");

    let props = server.request("GET", "/props", None).json();
    assert_eq!(
        (props["default_generation_settings"]["n_ctx"].as_u64(), props["total_slots"].as_u64()),
        (Some(4096), Some(1))
    );
    assert!(props["chat_template"].as_str().unwrap().contains("<think>"), "{props}");
    let slots = server.request("GET", "/slots", None).json();
    assert_eq!(slots[0]["is_processing"], false, "{slots}");
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

/// Each new route's body: a valid one, for the limits that need a route to reach.
const ROUTES: [(&str, &str); 8] = [
    ("/v1/messages", r#"{"max_tokens":4,"messages":[{"role":"user","content":"Hi"}]}"#),
    ("/v1/messages/count_tokens", r#"{"messages":[{"role":"user","content":"Hi"}]}"#),
    (
        "/api/chat",
        r#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"options":{"num_predict":4}}"#,
    ),
    ("/api/generate", r#"{"model":"m","prompt":"Hi","stream":false,"options":{"num_predict":4}}"#),
    ("/api/show", r#"{"model":"m"}"#),
    ("/tokenize", r#"{"content":"Hi"}"#),
    ("/detokenize", r#"{"tokens":[1]}"#),
    ("/apply-template", r#"{"messages":[{"role":"user","content":"Hi"}]}"#),
];

/// The message of an error in the shape of the API `path` belongs to.
fn error_message(path: &str, r: &Response) -> String {
    let v = r.json();
    let m = if path.starts_with("/v1/messages") {
        assert_eq!(v["type"], "error", "{}", r.body);
        assert!(v["error"]["type"].is_string(), "{}", r.body);
        &v["error"]["message"]
    } else if path.starts_with("/api/") {
        &v["error"]
    } else {
        &v["error"]["message"]
    };
    m.as_str().unwrap_or_else(|| panic!("{path}: no error message in {}", r.body)).to_string()
}

#[test]
fn hostile_input_to_every_new_route_is_refused_in_its_apis_shape() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--model-id", "m"]);
    server.wait_note("READY=1");
    let addr = server.addr;
    let raw = |path: &str, headers: &str, body: &str| {
        read_response(send_raw(
            addr,
            format!("POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}\r\n{body}").as_bytes(),
        ))
    };
    let huge = "Hi ".repeat(1 << 20);
    for (path, good) in ROUTES {
        let ok = server.request("POST", path, Some(good));
        assert_eq!(ok.status, 200, "{path}: {}", ok.body);
        let bogus = good.replacen('{', r#"{"bogus_field":1,"#, 1);
        let ollama = path.starts_with("/api/");
        if ollama {
            // Ollama ignores the fields it does not know (clients add their own); the log names
            // them.
            let r = server.request("POST", path, Some(&bogus));
            assert_eq!(r.status, 200, "{path}: a field it does not know: {}", r.body);
            assert!(server.log().contains("ignored the fields bogus_field"), "{path}: not logged:\n{}", server.log());
        }
        let tokenized = server.metric("sluice_prompt_tokens_total");
        let mut cases: Vec<(Response, u16, &str)> = vec![
            (raw(path, &format!("Content-Length: {}\r\n", 9 << 20), ""), 413, "over 8388608 bytes"),
            (raw(path, "", ""), 411, "no Content-Length"),
            (raw(path, "Transfer-Encoding: chunked\r\n", "2\r\n{}\r\n0\r\n\r\n"), 400, "Transfer-Encoding"),
            (server.request("POST", path, Some("{not json")), 400, "not valid JSON"),
            (server.request("POST", path, Some("[1]")), 400, "must be a JSON object"),
        ];
        if !ollama {
            cases.push((server.request("POST", path, Some(&bogus)), 400, "bogus_field"));
        }
        if path != "/detokenize" && path != "/api/show" && !ollama {
            // (those have no text to make too long; Ollama's cut it to fit, below)
            cases.push((server.request("POST", path, Some(&good.replace("Hi", &huge))), 400, "maximum context length"));
        }
        for (i, (r, status, needle)) in cases.into_iter().enumerate() {
            assert_eq!(r.status, status, "{path} case {i}: {}", r.body);
            let message = error_message(path, &r);
            assert!(message.contains(needle), "{path} case {i}: {message:?} lacks {needle:?}");
        }
        assert_eq!(server.metric("sluice_prompt_tokens_total"), tokenized, "{path}: a refused request was tokenized");
        if ollama && path != "/api/show" {
            // Ollama's APIs cut a prompt over the context to fit, as Ollama does: 3 MiB is
            // answered from its end, and no more of it is tokenized than could fit.
            let r = server.request("POST", path, Some(&good.replace("Hi", &huge)));
            assert_eq!(r.status, 200, "{path}: {}", r.body);
            let ps = server.request("GET", "/api/ps", None).json();
            let context = ps["models"][0]["context_length"].as_u64().unwrap();
            assert!(r.json()["prompt_eval_count"].as_u64().unwrap() < context, "{path}: {}", r.body);
        }
    }
    // A client that leaves a stream cancels its generation, on both new streaming APIs.
    for (path, body) in [
        (
            "/v1/messages",
            r#"{"max_tokens":3000,"stream":true,"messages":[{"role":"user","content":"Hi"}],"thinking":{"type":"disabled"}}"#,
        ),
        (
            "/api/chat",
            r#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"think":false,"options":{"num_predict":3000}}"#,
        ),
    ] {
        let before = server.metric("sluice_generations_cancelled_total");
        let mut r = BufReader::new(send(addr, "POST", path, Some(body)));
        let (status, _) = read_head(&mut r);
        assert_eq!(status, 200, "{path}");
        for _ in 0..3 {
            assert!(read_chunk(&mut r).is_some(), "{path}: the stream ended early");
        }
        drop(r);
        let t0 = Instant::now();
        while server.metric("sluice_generations_cancelled_total") <= before {
            assert!(t0.elapsed() < PATIENCE, "{path}: a departed client's generation was not cancelled");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(server.child.try_wait().unwrap().is_none(), "the server exited; log:\n{}", server.log());
}

/// A template without a system role: it renders user and assistant turns only.
const NO_SYSTEM_ROLE: &str = "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

#[test]
fn every_system_message_reaches_a_template_without_a_system_role() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("nosys.gguf");
    let o = common::sluice_command()
        .args(["synth", "--out", model.to_str().unwrap(), "--chat-template", NO_SYSTEM_ROLE])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    for (first, second) in [("system", "system"), ("system", "developer")] {
        let messages = json!([
            {"role": first, "content": "Rule one."},
            {"role": second, "content": "Rule two."},
            {"role": "user", "content": "Hi"}
        ]);
        let r = server.request("POST", "/apply-template", Some(&json!({"messages": messages}).to_string()));
        let prompt = r.json()["prompt"].as_str().unwrap_or_default().to_string();
        assert!(
            prompt.contains("Rule one.") && prompt.contains("Rule two.") && prompt.contains("Hi"),
            "{first} + {second}: {prompt:?}"
        );
    }
    // The Responses API's instructions and a developer item, counted in the prompt's tokens.
    let alone = json!({"input": "Hi", "max_output_tokens": 1});
    let both = json!({"input": [{"role": "developer", "content": "Rule two, which is longer than a word."}, {"role": "user", "content": "Hi"}],
        "instructions": "Rule one, also a sentence.", "max_output_tokens": 1});
    let tokens = |body: &Value| {
        server.request("POST", "/v1/responses", Some(&body.to_string())).json()["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(tokens(&both) > tokens(&alone) + 20, "{} vs {}", tokens(&both), tokens(&alone));
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn slot_actions_save_erase_and_restore_a_slot() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen3(dir.path());
    let state = dir.path().join("state");
    let args = ["--state-dir", state.to_str().unwrap(), "--reuse", "any"];
    let mut server = Server::start(dir.path(), &model, &args);
    server.wait_note("READY=1");
    let held = |server: &Server| server.request("GET", "/slots", None).json()[0]["n_tokens"].as_u64().unwrap();
    let chat = json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0});
    assert_eq!(server.request("POST", "/v1/chat/completions", Some(&chat.to_string())).status, 200);
    let tokens = held(&server);
    assert!(tokens > 0);
    let saved = server.request("POST", "/slots/0?action=save", Some(r#"{"filename":"mine.bin"}"#)).json();
    assert_eq!(saved["n_saved"].as_u64(), Some(tokens), "{saved}");
    let name = saved["filename"].as_str().unwrap().to_string();
    let erased = server.request("POST", "/slots/0?action=erase", None).json();
    assert_eq!((erased["n_erased"].as_u64(), held(&server)), (Some(tokens), 0), "{erased}");
    let body = json!({"filename": name}).to_string();
    let restored = server.request("POST", "/slots/0?action=restore", Some(&body)).json();
    assert_eq!((restored["n_restored"].as_u64(), held(&server)), (Some(tokens), tokens), "{restored}");
    // The restored slot answers the same conversation from memory: its prompt is reused.
    let again = server.request("POST", "/v1/chat/completions", Some(&chat.to_string())).json();
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{again}");
    assert_api_error(&server.request("POST", "/slots/7?action=save", None), 400, Some("id_slot"), "0 to 0");
    assert_api_error(
        &server.request("POST", "/slots/0?action=fly", None),
        400,
        Some("action"),
        "not save, restore or erase",
    );
    let missing = server.request("POST", "/slots/0?action=restore", Some(r#"{"filename":"nothing.slot"}"#));
    assert_api_error(&missing, 404, Some("filename"), "no saved slot");
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn tool_calls_reach_the_ollama_client_langchain_and_home_assistant() {
    let dir = tempfile::tempdir().unwrap();
    // A model whose weights always begin a call (Kimi-K2's call marker, which wakes the lazy
    // grammar): every answer with tools offered calls one, with no tool_choice to force it.
    let model = synth_favouring(dir.path(), "calls", "moonshotai-Kimi-K2-Thinking", "<|tool_call_begin|>");
    let args = ["tools"];
    if let Some(out) = client_script_with(dir.path(), &model, "ollama-check.py", "ollama, langchain_ollama", &args) {
        assert!(out.contains("ollama-check: 5 passed, 0 failed"), "{out}");
    }
}

#[test]
fn ollama_s_answers_that_clients_rely_on() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let ollama_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{ollama_port}");
    let mut server =
        Server::start(dir.path(), &model, &["--model-id", "m", "--ollama-listen", &listen, "--ctx", "512"]);
    server.wait_note("READY=1");
    let ollama: std::net::SocketAddr = listen.parse().unwrap();
    // Front-ends detect Ollama by its root; the chat page stays on sluice's own port.
    for method in ["GET", "HEAD"] {
        let r = request(ollama, method, "/", None);
        assert_eq!(r.status, 200, "{method}: {}", r.body);
        if method == "GET" {
            assert_eq!(r.body, "Ollama is running");
        }
    }
    assert!(server.request("GET", "/", None).body.contains("<html"), "the chat page moved");
    let post = |path: &str, body: Value| request(ollama, "POST", path, Some(&body.to_string()));
    let refused = |r: Response, needle: &str| {
        assert_eq!(r.status, 400, "{}", r.body);
        let message = r.json()["error"].as_str().unwrap_or_default().to_string();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        message
    };
    let hi = json!([{"role": "user", "content": "hi"}]);
    // Thinking asked of a model that has no thinking block.
    refused(post("/api/chat", json!({"model": "m", "messages": hi, "think": true})), "\"m\" does not support thinking");
    refused(post("/api/generate", json!({"model": "m", "prompt": "hi", "think": "high"})), "does not support thinking");
    // keep_alive as Ollama reads it.
    refused(post("/api/chat", json!({"model": "m", "messages": hi, "keep_alive": "5 minutes"})), "keep_alive");
    refused(post("/api/generate", json!({"model": "m", "keep_alive": [1]})), "keep_alive");
    let loaded = post("/api/generate", json!({"model": "m", "keep_alive": "1h30m"}));
    assert_eq!(loaded.json()["done_reason"], "load", "{}", loaded.body);
    let listed = |path: &str| request(ollama, "GET", path, None).json()["models"].as_array().unwrap().len();
    assert_eq!(listed("/api/ps"), 1, "the model is loaded");
    let unloaded = post("/api/chat", json!({"model": "m", "messages": [], "keep_alive": "0s"}));
    assert_eq!(unloaded.json()["done_reason"], "unload", "{}", unloaded.body);
    // Unloaded, the model leaves /api/ps, stays listed and described, and the next request
    // loads it again.
    server.wait_log_count("the model is unloaded", 1);
    assert_eq!(listed("/api/ps"), 0, "an unloaded model is not in /api/ps");
    assert_eq!(listed("/api/tags"), 1);
    assert_eq!(post("/api/show", json!({"model": "m"})).status, 200);
    let answer =
        post("/api/chat", json!({"model": "m", "messages": hi, "stream": false, "options": {"num_predict": 3}}));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(listed("/api/ps"), 1, "a request loads the model again");
    // keep_alive 0 on a generation unloads once it is answered.
    let last = post(
        "/api/generate",
        json!({"model": "m", "prompt": "hi", "stream": false, "keep_alive": 0, "options": {"num_predict": 3}}),
    );
    assert_eq!(last.status, 200, "{}", last.body);
    server.wait_log_count("the model is unloaded", 2);
    assert_eq!(listed("/api/ps"), 0);
    let loaded = post("/api/generate", json!({"model": "m"}));
    assert_eq!(loaded.json()["done_reason"], "load", "{}", loaded.body);
    server.wait_log_count("the model is in memory", 3);
    assert_eq!(listed("/api/ps"), 1, "a load request loads it again");
    // A request over the context, asked not to be cut, names Ollama's fields.
    let over = post(
        "/api/generate",
        json!({"model": "m", "prompt": "hi", "stream": false, "truncate": false, "options": {"num_predict": 5000}}),
    );
    let message = refused(over, "options.num_predict");
    assert!(!message.contains("max_tokens"), "{message}");
    // What /api/show carries: the file's metadata, the capabilities, a Modelfile without the
    // board's paths.
    let shown = post("/api/show", json!({"model": "m"})).json();
    let info = &shown["model_info"];
    let arch = info["general.architecture"].as_str().unwrap();
    assert!(info["general.basename"].is_string(), "{shown}");
    for key in ["block_count", "expert_count", "expert_used_count", "embedding_length", "context_length"] {
        assert!(info[format!("{arch}.{key}")].is_u64(), "{arch}.{key} missing: {info}");
    }
    assert!(info.as_object().unwrap().contains_key("tokenizer.ggml.tokens"), "{info}");
    assert_eq!(shown["capabilities"], json!(["completion", "tools"]), "{shown}");
    assert_eq!(shown["parameters"], "num_ctx 512", "{shown}");
    let modelfile = shown["modelfile"].as_str().unwrap();
    assert!(!modelfile.contains(dir.path().to_str().unwrap()) && modelfile.contains("FROM m"), "{modelfile}");
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn ollama_cuts_a_prompt_over_the_context_as_ollama_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--model-id", "m", "--ctx", "512"]);
    server.wait_note("READY=1");
    // 8 tokens for the answer: the prompt is cut to 504.
    let target = 504;
    let chat = |messages: &[Value], truncate: bool| {
        let body = json!({"model": "m", "messages": messages, "stream": false, "truncate": truncate,
            "options": {"num_predict": 8, "temperature": 0}});
        server.request("POST", "/api/chat", Some(&body.to_string()))
    };
    let system = json!({"role": "system", "content": "You answer briefly."});
    let mut conversation = vec![system.clone()];
    for i in 0..40 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        conversation
            .push(json!({"role": role, "content": format!("message {i}: the weather in town number {i} today")}));
    }
    // Whole, it is over the context: refused when asked not to cut, answered otherwise.
    let refused = chat(&conversation, false);
    assert_eq!(refused.status, 400, "{}", refused.body);
    let fitted = chat(&conversation, true);
    assert_eq!(fitted.status, 200, "{}", fitted.body);
    let fitted_count = fitted.json()["prompt_eval_count"].as_u64().unwrap();
    assert!(fitted_count <= target, "{}", fitted.body);
    // It is the system message and the most recent messages that fit: one more does not.
    let with_last = |n: usize| -> Vec<Value> {
        std::iter::once(system.clone()).chain(conversation[conversation.len() - n..].iter().cloned()).collect()
    };
    let kept = (1..conversation.len())
        .find(|&n| chat(&with_last(n + 1), false).status == 400)
        .expect("the whole conversation is over the context");
    let explicit = chat(&with_last(kept), false);
    assert_eq!(explicit.status, 200, "{}", explicit.body);
    assert_eq!(explicit.json()["prompt_eval_count"].as_u64().unwrap(), fitted_count, "{}", explicit.body);
    // A last message (or a raw prompt) too long alone is cut token by token, to the target.
    let long = "the weather in town today is ".repeat(200);
    let alone = chat(&[system.clone(), json!({"role": "user", "content": long})], true);
    assert_eq!(alone.status, 200, "{}", alone.body);
    assert_eq!(alone.json()["prompt_eval_count"].as_u64().unwrap(), target, "{}", alone.body);
    let raw = json!({"model": "m", "prompt": long, "raw": true, "stream": false, "options": {"num_predict": 8}});
    let raw = server.request("POST", "/api/generate", Some(&raw.to_string()));
    assert_eq!(raw.status, 200, "{}", raw.body);
    assert_eq!(raw.json()["prompt_eval_count"].as_u64().unwrap(), target, "{}", raw.body);
    // num_ctx below the server's context is the request's context.
    let small = json!({"model": "m", "prompt": long, "raw": true, "stream": false,
        "options": {"num_predict": 8, "num_ctx": 128}});
    let small = server.request("POST", "/api/generate", Some(&small.to_string()));
    assert_eq!(small.json()["prompt_eval_count"].as_u64().unwrap(), 120, "{}", small.body);
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("truncating input prompt"), "{log}");
}

/// A template that, as Llama 3.x's, takes one tool call an assistant turn and raises on more.
const SINGLE_CALL_TEMPLATE: &str = r#"{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + message.tool_calls[0].function.name + '", "parameters": ' + (message.tool_calls[0].function.arguments | tojson) + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"#;

/// The weather tool in Anthropic's shape.
fn anthropic_weather() -> Value {
    json!({"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"]}})
}

#[test]
fn anthropic_s_answers_make_one_call_where_the_template_takes_one_and_think_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    // Weights that favour `,`: where the grammar lets an answer add another call, it does.
    let single = dir.path().join("single.gguf");
    let o = common::sluice_command()
        .args(["synth", "--out", single.to_str().unwrap(), "--favour", ",", "--chat-template", SINGLE_CALL_TEMPLATE])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut server = Server::start(dir.path(), &single, &["--model-id", "m"]);
    server.wait_note("READY=1");
    let ask = json!([{"role": "user", "content": "Weather in Paris and in Oslo?"}]);
    for seed in 0..5 {
        // A forced tool, parallel calls not disabled: one call, which the template takes back.
        let body = json!({"model": "m", "max_tokens": 200, "messages": ask, "tools": [anthropic_weather()],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 1.0, "top_k": 40 + seed});
        let r = server.request("POST", "/v1/messages", Some(&body.to_string()));
        assert_eq!(r.status, 200, "seed {seed}: {}", r.body);
        let answer = r.json();
        let uses: Vec<&Value> =
            answer["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
        assert_eq!(uses.len(), 1, "seed {seed}: the template takes one call a turn: {}", r.body);
        let next = json!({"model": "m", "max_tokens": 4, "tools": [anthropic_weather()], "messages": [
            ask[0],
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "sunny"}]},
        ]});
        let r = server.request("POST", "/v1/messages", Some(&next.to_string()));
        assert_eq!(r.status, 200, "seed {seed}: the call sent back: {}", r.body);
    }
    // OpenAI's parallel_tool_calls too.
    let body = json!({"messages": ask, "max_tokens": 200, "parallel_tool_calls": true, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": anthropic_weather()["input_schema"]}}]});
    let r = server.request("POST", "/v1/chat/completions", Some(&body.to_string()));
    assert_eq!(r.json()["choices"][0]["message"]["tool_calls"].as_array().map(Vec::len), Some(1), "{}", r.body);
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");

    // Thinking is asked for on Anthropic's API: a model whose generation prompt opens its
    // thinking block (Qwen3.5's) answers without one unless the request has `thinking`.
    let thinker = synth_with(dir.path(), Some("Qwen3.5-4B"));
    let mut server = Server::start(dir.path(), &thinker, &["--model-id", "m"]);
    server.wait_note("READY=1");
    for (thinking, stream) in
        [(None, false), (None, true), (Some(json!({"type": "enabled", "budget_tokens": 64})), false)]
    {
        let mut body = json!({"model": "m", "max_tokens": 48, "messages": ask, "stream": stream, "temperature": 0});
        if let Some(t) = &thinking {
            body["thinking"] = t.clone();
        }
        let r = server.request("POST", "/v1/messages", Some(&body.to_string()));
        assert_eq!(r.status, 200, "{}", r.body);
        let thought = r.body.contains("\"thinking\"") || r.body.contains("thinking_delta");
        assert_eq!(thought, thinking.is_some(), "thinking {thinking:?}, stream {stream}: {}", r.body);
    }
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}
