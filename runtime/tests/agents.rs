//! What agent clients rely on, end to end over `sluice serve`, on random-weight fixtures that
//! carry real chat templates (the nine of tests/chat/templates, and ChatML for a model whose
//! template has no tool-call syntax): a required or named tool call comes first and is always
//! made, plain and streamed; a JSON schema is always enforced, on the text the client decodes;
//! the Responses API; and the queue admits its bound beside the running request. No logit bias
//! or other push is used: the grammar alone has to hold the contract.

use std::sync::{Arc, Barrier};

use serde_json::{json, Value};

mod common;
mod serving;
use common::emulated;
use serving::*;

/// The templates a run covers: all of them natively, Qwen3's under an emulator (where a token
/// costs fifty times as much; the grammar and sampler code is the same for every family).
fn templates() -> Vec<Option<&'static str>> {
    if emulated() {
        vec![TEMPLATES[0]]
    } else {
        TEMPLATES.to_vec()
    }
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": false}}})
}

fn clock() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}, "dst": {"type": "boolean"}},
        "required": ["zone", "dst"], "additionalProperties": false}}})
}

/// Thinking off (the even seeds), or on with a bounded block before the call (the odd ones).
fn thinking(seed: u64) -> Value {
    if seed % 2 == 0 {
        json!({"reasoning_effort": "none"})
    } else {
        json!({"thinking_budget_tokens": 16})
    }
}

/// The calls of a chat answer, plain or streamed: (name, arguments).
fn answer_calls(body: &str, stream: bool) -> (Vec<(String, String)>, String) {
    if !stream {
        let v: Value = serde_json::from_str(body).unwrap();
        let c = &v["choices"][0];
        let calls = c["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        let calls = calls
            .iter()
            .map(|t| {
                (t["function"]["name"].as_str().unwrap().into(), t["function"]["arguments"].as_str().unwrap().into())
            })
            .collect();
        return (calls, c["finish_reason"].as_str().unwrap_or_default().into());
    }
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let (mut calls, mut finish) = (Vec::<(String, String)>::new(), String::new());
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = t["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push((String::new(), String::new()));
            }
            calls[i].0.push_str(t["function"]["name"].as_str().unwrap_or(""));
            calls[i].1.push_str(t["function"]["arguments"].as_str().unwrap_or(""));
        }
        finish = c["finish_reason"].as_str().map(str::to_string).unwrap_or(finish);
    }
    (calls, finish)
}

#[test]
fn a_required_or_named_call_is_always_made_first_on_every_template() {
    // 10 seeds of each choice, whole and streamed, on each of 10 templates: 400 forced calls.
    let seeds = if emulated() { 1 } else { 10 };
    let tools = [weather(), clock()];
    let validators: Vec<_> = tools
        .iter()
        .map(|t| {
            let f = &t["function"];
            (f["name"].as_str().unwrap().to_string(), jsonschema::validator_for(&f["parameters"]).unwrap())
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    for template in templates() {
        let model = synth_with(dir.path(), template);
        let mut server = Server::start(dir.path(), &model, &[]);
        server.wait_note("READY=1");
        for seed in 0..seeds {
            let named = json!({"type": "function", "function": {"name": "get_time"}});
            for choice in [json!("required"), named] {
                let mut plain = None;
                for stream in [false, true] {
                    let mut body = json!({"messages": [{"role": "user", "content": "Weather in Paris, and the time?"}],
                        "tools": tools, "tool_choice": choice, "max_tokens": 400, "temperature": 1.0, "seed": seed,
                        "stream": stream});
                    body.as_object_mut().unwrap().extend(thinking(seed).as_object().unwrap().clone());
                    let r = server.request("POST", "/v1/chat/completions", Some(&body.to_string()));
                    let at = format!("{template:?} seed {seed} {choice} stream {stream}");
                    assert_eq!(r.status, 200, "{at}: {}", r.body);
                    let (calls, finish) = answer_calls(&r.body, stream);
                    assert_eq!(finish, "tool_calls", "{at}: {}", r.body);
                    assert_eq!(calls.len(), 1, "{at}: parallel_tool_calls is off: {}", r.body);
                    for (name, arguments) in &calls {
                        if choice.is_object() {
                            assert_eq!(name, "get_time", "{at}: a named choice calls only that function");
                        }
                        let (_, validator) = validators.iter().find(|(n, _)| n == name).expect("a tool's name");
                        let args: Value =
                            serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{at}: {e}: {arguments}"));
                        assert!(validator.is_valid(&args), "{at}: {arguments}");
                    }
                    // The same seed streamed makes the same call.
                    match &plain {
                        None => plain = Some(calls),
                        Some(p) => assert_eq!(p, &calls, "{at}"),
                    }
                }
            }
        }
        let (status, _, _, log) = server.stop();
        assert!(status.success(), "{log}");
    }
}

#[test]
fn a_forced_call_comes_within_its_bound_on_a_model_that_keeps_writing_digits() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_favouring(dir.path(), "kimi-digits", "moonshotai-Kimi-K2-Thinking", "1");
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    let ask = json!([{"role": "user", "content": "Weather in Paris?"}]);
    // The fixture does what it is for: left alone, the model writes the digit.
    let free = json!({"messages": ask, "max_tokens": 12, "temperature": 0, "reasoning_effort": "none"});
    let text = server.request("POST", "/v1/chat/completions", Some(&free.to_string())).json()["choices"][0]["message"]
        ["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(text.matches('1').count() >= 10, "the model does not keep writing digits: {text:?}");
    let seeds = if emulated() { 2 } else { 20 };
    for seed in 0..seeds {
        let body = json!({"messages": ask, "tools": [weather()], "tool_choice": "required", "max_tokens": 200,
            "temperature": 1.0, "seed": seed, "reasoning_effort": "none"});
        let r = server.request("POST", "/v1/chat/completions", Some(&body.to_string()));
        let v = r.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "seed {seed}: {}", r.body);
        let call = &choice["message"]["tool_calls"][0];
        let id = call["id"].as_str().unwrap_or_default();
        let digits = id.strip_prefix("functions.get_weather:").unwrap_or_else(|| panic!("seed {seed}: id {id:?}"));
        assert!(
            (1..=4).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()),
            "seed {seed}: id {id:?}"
        );
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"] == "Paris" || args["city"] == "Oslo", "seed {seed}: {args}");
    }
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

/// A schema with every kind of constraint the grammar has to hold: lengths, a pattern, an enum
/// of mixed types, nested objects and arrays.
fn pet_schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "kind": {"enum": ["cat", "dog", 3, null]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "where": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"}}, "required": ["x", "ok"], "additionalProperties": false}},
        "required": ["name", "code", "kind", "tags", "where"], "additionalProperties": false})
}

#[test]
fn every_finished_structured_answer_follows_its_schema_on_every_template() {
    let seeds = if emulated() { 2 } else { 40 };
    let schema = pet_schema();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for template in templates() {
        let model = synth_with(dir.path(), template);
        let mut server = Server::start(dir.path(), &model, &[]);
        server.wait_note("READY=1");
        let mut finished = 0;
        for seed in 0..seeds {
            let body = json!({"messages": [{"role": "user", "content": "Describe a pet."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
                "max_tokens": 400, "temperature": 1.0, "seed": seed, "reasoning_effort": "none"});
            let r = server.request("POST", "/v1/chat/completions", Some(&body.to_string()));
            let at = format!("{template:?} seed {seed}");
            assert_eq!(r.status, 200, "{at}: {}", r.body);
            let c = &r.json()["choices"][0];
            if c["finish_reason"] != "stop" {
                continue;
            }
            finished += 1;
            let text = c["message"]["content"].as_str().unwrap();
            assert!(!text.contains('\u{fffd}'), "{at}: the answer is not valid UTF-8: {text:?}");
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{at}: {e}: {text:?}"));
            let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{at}: {errors:?}: {text}");
        }
        assert!(finished * 4 >= seeds * 3, "{template:?}: only {finished} of {seeds} answers finished");
        let (status, _, _, log) = server.stop();
        assert!(status.success(), "{log}");
    }
}

/// The typed events of a streamed response: (type, event).
fn response_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (head, data) = e.split_once('\n').unwrap();
            let kind = head.strip_prefix("event: ").unwrap().to_string();
            let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(v["type"], kind.as_str(), "{e}");
            (kind, v)
        })
        .collect()
}

#[test]
fn the_responses_api_answers_streams_calls_and_continues_a_conversation() {
    if emulated() {
        eprintln!("skipped under an emulator: the Responses API is the chat path's, which the other tests sample");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = synth_with(dir.path(), Some("Qwen-Qwen3-0.6B"));
    let mut server = Server::start(dir.path(), &model, &["--model-id", "m"]);
    server.wait_note("READY=1");
    let post = |body: Value| server.request("POST", "/v1/responses", Some(&body.to_string()));

    // Plain text: the output's message, incomplete at the token bound.
    let r = post(
        json!({"model": "m", "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let plain = r.json();
    assert_eq!((plain["object"].as_str(), plain["status"].as_str()), (Some("response"), Some("incomplete")));
    assert_eq!(plain["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(plain["usage"]["output_tokens"], 8);
    assert_eq!(plain["instructions"], "Be brief.");
    let message = plain["output"].as_array().unwrap().iter().find(|o| o["type"] == "message").unwrap().clone();
    let text = message["content"][0]["text"].as_str().unwrap().to_string();

    // Streamed: typed events in order, numbered, adding up to the same text and response.
    let r = post(
        json!({"model": "m", "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0, "stream": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let events = response_events(&r.body);
    assert_eq!(events[0].0, "response.created");
    assert_eq!(events[1].0, "response.in_progress");
    assert_eq!(events.last().unwrap().0, "response.incomplete");
    assert!(events.iter().enumerate().all(|(i, (_, e))| e["sequence_number"] == i as u64));
    let streamed: String = events
        .iter()
        .filter(|(k, _)| k == "response.output_text.delta")
        .map(|(_, e)| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"], message["content"]);
    assert_eq!(last["usage"], plain["usage"]);

    // A required call, its output sent back on the stored conversation.
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": weather()["function"]["parameters"]}]);
    let r = post(json!({"model": "m", "input": "Weather in Paris?", "tools": tools, "tool_choice": "required",
        "max_output_tokens": 300, "reasoning": {"effort": "none"}}));
    assert_eq!(r.status, 200, "{}", r.body);
    let called = r.json();
    let call = called["output"].as_array().unwrap().iter().find(|o| o["type"] == "function_call").unwrap().clone();
    assert_eq!(call["name"], "get_weather");
    let city = serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap()["city"].clone();
    assert!(city == "Paris" || city == "Oslo", "{call}");
    let output = json!([{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 18 C"}]);
    let r = post(json!({"model": "m", "previous_response_id": called["id"], "input": output, "tools": tools,
        "max_output_tokens": 4}));
    assert_eq!(r.status, 200, "{}", r.body);
    let after = r.json();
    assert!(
        after["usage"]["input_tokens"].as_u64() > called["usage"]["input_tokens"].as_u64(),
        "the previous response's conversation comes first: {after}"
    );
    assert_eq!(after["previous_response_id"], called["id"]);
    // Ids are 128 random bits: no client derives another's from its own (a neighbour of an id
    // is nothing), so none continues another's stored conversation.
    let (a, b) = (called["id"].as_str().unwrap(), after["id"].as_str().unwrap());
    for id in [a, b] {
        assert!(id.len() == 5 + 32 && id[5..].bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
    }
    let differing = a[5..].bytes().zip(b[5..].bytes()).filter(|(x, y)| x != y).count();
    assert!(differing > 16, "consecutive ids {a} and {b} share {} of 32 digits", 32 - differing);
    let last = u8::from_str_radix(&b[b.len() - 1..], 16).unwrap();
    let neighbour = format!("{}{:x}", &b[..b.len() - 1], last ^ 1);
    let r = post(json!({"model": "m", "previous_response_id": neighbour, "input": "x"}));
    assert_api_error(&r, 404, Some("previous_response_id"), "is kept here");

    // The whole conversation as items does the same without the stored one.
    let items = json!([{"role": "user", "content": "Weather in Paris?"}, call, output[0]]);
    let r = post(json!({"model": "m", "input": items, "tools": tools, "max_output_tokens": 4}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["input_tokens"], after["usage"]["input_tokens"]);

    // text.format: the schema holds.
    let schema = pet_schema();
    let r = post(
        json!({"model": "m", "input": "A pet", "text": {"format": {"type": "json_schema", "name": "pet", "schema": schema}},
        "max_output_tokens": 400, "reasoning": {"effort": "none"}, "temperature": 1, "store": false}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let structured = r.json();
    if structured["status"] == "completed" {
        let text = structured["output"][0]["content"][0]["text"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap();
        assert!(jsonschema::is_valid(&schema, &v), "{text}");
    }
    // Not stored: it cannot be continued.
    let r = post(json!({"model": "m", "previous_response_id": structured["id"], "input": "more"}));
    assert_api_error(&r, 404, Some("previous_response_id"), "is kept here");
    // What sluice cannot do is named.
    assert_api_error(
        &post(json!({"input": "x", "tools": [{"type": "web_search"}]})),
        400,
        Some("tools[0].type"),
        "function tools",
    );
    assert_api_error(&post(json!({"input": "x", "seed": 1})), 400, Some("seed"), "Unrecognized");
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn the_queue_admits_its_bound_beside_the_running_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--queue", "8"]);
    server.wait_note("READY=1");
    let start = Arc::new(Barrier::new(9));
    let clients: Vec<_> = (0..9)
        .map(|_| {
            let (addr, start) = (server.addr, Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                request(addr, "POST", "/v1/completions", Some(r#"{"prompt":"The quick brown fox","max_tokens":32}"#))
            })
        })
        .collect();
    for c in clients {
        let r = c.join().unwrap();
        assert_eq!(r.status, 200, "a burst of 9 with --queue 8: one runs, eight wait: {}", r.body);
    }
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn the_agent_frameworks_get_their_calls_and_structured_answers() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_with(dir.path(), Some("Qwen-Qwen3-0.6B"));
    if let Some(out) = client_script(dir.path(), &model, "agent-clients.py", "openai, pydantic") {
        assert!(out.contains(" 0 failed"), "{out}");
    }
}
