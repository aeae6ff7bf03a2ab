//! The request checks' tests.

use super::*;
use crate::serve::job::PromptBound;

fn err(body: &str) -> ApiError {
    completion_request(body.as_bytes(), "m").unwrap_err()
}

#[test]
fn a_full_completion_request_is_read() {
    let r = completion_request(
        br#"{"model":"m","prompt":["hi"],"max_tokens":5,"temperature":0.5,"top_p":0.9,"seed":7,"stop":"x","stream":true,"n":1}"#,
        "m",
    )
    .unwrap();
    assert!(matches!(&r.prompt, PromptInput::Text(t) if t == "hi"));
    assert_eq!(r.max_tokens, Some(5));
    assert_eq!((r.sampling.temperature, r.sampling.top_p, r.sampling.seed), (0.5, 0.9, 7));
    assert_eq!(r.stop, ["x"]);
    assert!(r.stream && !r.include_usage && r.logprobs.is_none());
    let r = completion_request(br#"{"prompt":"hi","temperature":0}"#, "m").unwrap();
    assert!(r.sampling.is_greedy());
    assert_eq!(r.max_tokens, Some(DEFAULT_COMPLETION_TOKENS));
    let r = completion_request(
        br#"{"prompt":"hi","top_k":5,"min_p":0.1,"presence_penalty":0.5,"frequency_penalty":-0.5,"repetition_penalty":1.1,"logprobs":2,"stream":true,"stream_options":{"include_usage":true},"user":"u","logit_bias":{"1":2,"7":-100}}"#,
        "m",
    )
    .unwrap();
    let s = &r.sampling;
    assert_eq!((s.top_k, s.min_p, s.penalty_present, s.penalty_freq, s.penalty_repeat), (5, 0.1, 0.5, -0.5, 1.1));
    assert_eq!((r.logprobs, r.include_usage), (Some(2), true));
    assert_eq!(s.logit_bias, [(1, 2.0), (7, -100.0)]);
    let r = completion_request(br#"{"prompt":"hi","repeat_penalty":1.2,"seed":-1}"#, "m").unwrap();
    assert_eq!((r.sampling.penalty_repeat, r.sampling.seed), (1.2, 0));
    assert!(r.cache_prompt, "a prompt's memory is kept unless asked otherwise");
    let r = completion_request(br#"{"prompt":"hi","cache_prompt":false}"#, "m").unwrap();
    assert!(!r.cache_prompt);
}

#[test]
fn bad_completion_requests_name_the_field() {
    let e = err(r#"{"prompt":"hi","max_tokens":"five"}"#);
    assert_eq!((e.status, e.param.as_deref()), (400, Some("max_tokens")));
    assert!(e.message.contains("invalid type"), "{}", e.message);
    let e = err(r#"{"prompt":"hi","cache_prompt":"no"}"#);
    assert_eq!((e.status, e.param.as_deref()), (400, Some("cache_prompt")));
    let e = err(r#"{"prompt":"hi","bogus":1}"#);
    assert_eq!(e.param.as_deref(), Some("bogus"));
    assert!(e.message.contains("Unrecognized request argument supplied: bogus"), "{}", e.message);
    assert!(err(r#"{"prompt":"hi""#).message.contains("not valid JSON"));
    assert!(err(r#"{"max_tokens":3}"#).message.contains("missing field `prompt`"));
    assert_eq!(err(r#"{"prompt":"hi","messages":[]}"#).param.as_deref(), Some("messages"));
    assert_eq!(err(r#"{"prompt":"hi","temperature":3}"#).param.as_deref(), Some("temperature"));
    assert_eq!(err(r#"{"prompt":"hi","n":2}"#).param.as_deref(), Some("n"));
    assert_eq!(err(r#"{"prompt":"hi","max_tokens":0}"#).param.as_deref(), Some("max_tokens"));
    assert_eq!(err(r#"{"prompt":["a","b"]}"#).param.as_deref(), Some("prompt"));
    assert_eq!(err(r#"{"prompt":""}"#).param.as_deref(), Some("prompt"));
    assert_eq!(err(r#"{"prompt":"hi","stop":["a","b","c","d","e"]}"#).param.as_deref(), Some("stop"));
    for (body, param) in [
        (r#"{"prompt":"hi","top_k":-1}"#, "top_k"),
        (r#"{"prompt":"hi","min_p":2}"#, "min_p"),
        (r#"{"prompt":"hi","presence_penalty":3}"#, "presence_penalty"),
        (r#"{"prompt":"hi","repetition_penalty":0}"#, "repetition_penalty"),
        (r#"{"prompt":"hi","logprobs":9}"#, "logprobs"),
        (r#"{"prompt":"hi","logprobs":true}"#, "logprobs"),
        (r#"{"prompt":"hi","stream_options":{"include_usage":true}}"#, "stream_options"),
        (r#"{"prompt":"hi","tools":[]}"#, "tools"),
        (r#"{"prompt":"hi","top_p":0}"#, "top_p"),
        (r#"{"prompt":"hi","logit_bias":{"x":1}}"#, "logit_bias.x"),
        (r#"{"prompt":"hi","logit_bias":{"5":101}}"#, "logit_bias.5"),
    ] {
        assert_eq!(err(body).param.as_deref(), Some(param), "{body}");
    }
    let e = err(r#"{"prompt":"hi","model":"gpt-4"}"#);
    assert_eq!((e.status, e.code), (404, Some("model_not_found")));
    // The name Ollama's /api/tags lists the served model under reaches it here too.
    assert!(completion_request(br#"{"prompt":"hi","model":"m:latest"}"#, "m").is_ok());
    assert_eq!(err(r#"{"prompt":"hi","model":"m:7b"}"#).status, 404);
}

#[test]
fn chat_requests_read_messages_logprobs_and_tools() {
    let r = chat_request(
        br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":4,"logprobs":true,"top_logprobs":3,"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto","parallel_tool_calls":true,"response_format":{"type":"text"},"store":false}"#,
        "m",
    )
    .unwrap();
    let PromptInput::Chat(c) = &r.prompt else { panic!("chat prompt expected") };
    assert_eq!(c.messages[1]["content"][0]["text"], "hi");
    assert!(c.parse_tool_calls && c.parallel_tool_calls && c.json_schema.is_none());
    assert_eq!((r.max_tokens, r.logprobs), (Some(4), Some(3)));
    let r = chat_request(br#"{"messages":[{"role":"user","content":"x"}],"logprobs":false}"#, "m").unwrap();
    assert_eq!(r.logprobs, None);
    for (body, param) in [
        (r#"{"messages":[{"role":"robot","content":"x"}]}"#, "messages[0].role"),
        (r#"{"messages":[]}"#, "messages"),
        (r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#, "top_logprobs"),
        (r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#, "top_logprobs"),
        (r#"{"messages":[{"role":"user","content":"x"}],"logprobs":2}"#, "logprobs"),
        (r#"{"messages":[{"role":"user","content":"x"}],"functions":[]}"#, "functions"),
    ] {
        let e = chat_request(body.as_bytes(), "m").unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}");
    }
}

#[test]
fn prompts_over_the_byte_bound_are_refused_before_tokenizing() {
    let bound = PromptBound { n_ctx: 16, max_token_bytes: 4 };
    let ok = completion_request(&serde_json::to_vec(&serde_json::json!({"prompt": "x".repeat(64)})).unwrap(), "m");
    assert!(bound.check(&ok.unwrap()).is_ok());
    let long = completion_request(&serde_json::to_vec(&serde_json::json!({"prompt": "x".repeat(65)})).unwrap(), "m");
    let e = bound.check(&long.unwrap()).unwrap_err();
    assert_eq!((e.status, e.code, e.param.as_deref()), (400, Some("context_length_exceeded"), Some("prompt")));
    assert!(e.message.contains("maximum context length is 16 tokens"), "{}", e.message);
    let chat = chat_request(
        &serde_json::to_vec(&serde_json::json!({"messages": [{"role": "user", "content": "y".repeat(70)}]})).unwrap(),
        "m",
    );
    assert_eq!(bound.check(&chat.unwrap()).unwrap_err().param.as_deref(), Some("messages"));
    assert!(PromptBound::default().check(&completion_request(br#"{"prompt":"hi"}"#, "m").unwrap()).is_ok());
}
