//! The OpenAI-compatible request bodies, their checks, and error bodies.

use serde::Deserialize;

use crate::generate::Sampling;

/// An HTTP error with an OpenAI-style body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What went wrong and what to do.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// An error of another status and type.
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// The same error with `code`.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        serde_json::json!({
            "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code }
        })
        .to_string()
    }
}

/// A prompt: a string, or an array holding one string.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of one string")]
pub enum PromptField {
    /// `"prompt": "text"`.
    One(String),
    /// `"prompt": ["text"]`.
    Many(Vec<String>),
}

/// Stop sequences: a string or an array of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum StopField {
    /// `"stop": "x"`.
    One(String),
    /// `"stop": ["x", "y"]`.
    Many(Vec<String>),
}

/// A chat message's content: a string, or text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of {\"type\": \"text\", \"text\": ...} parts")]
pub enum ContentField {
    /// `"content": "text"`.
    Text(String),
    /// `"content": [{"type": "text", "text": "..."}]`.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: String,
}

/// One message of a chat request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessageField {
    role: Role,
    content: ContentField,
    #[allow(dead_code)] // accepted for compatibility; a name does not change the prompt
    name: Option<String>,
}

/// Who speaks.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// Instructions (the newer name for `system`).
    Developer,
    /// The user.
    User,
    /// The model.
    Assistant,
}

/// The body of `POST /v1/completions` (`prompt`) and `POST /v1/chat/completions` (`messages`):
/// the fields OpenAI defines that sluice honours or accepts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestBody {
    model: Option<String>,
    prompt: Option<PromptField>,
    messages: Option<Vec<ChatMessageField>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    stream: Option<bool>,
    stop: Option<StopField>,
    seed: Option<u64>,
    #[allow(dead_code)] // accepted for compatibility; it does not change the generation
    user: Option<String>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
}

/// What a generation request asks for, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Tokens to generate at most; `None`: what the context leaves.
    pub max_tokens: Option<u32>,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Server-sent events.
    pub stream: bool,
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Completion text, tokenized as is (with BOS).
    Text(String),
    /// Chat messages, formatted with the model's template.
    Chat(Vec<ggml_sys::ChatMessage>),
}

/// The most bytes of text a prompt can have and still fit the context: every token stands for
/// at most `max_token_bytes` bytes, so a longer text needs more than `n_ctx` tokens. A prompt
/// over it is refused before it is tokenized (tokenizing megabytes takes long).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptBound {
    /// Context positions; 0 until the model is loaded (no bound).
    pub n_ctx: u32,
    /// The longest text any token stands for, in bytes.
    pub max_token_bytes: usize,
}

impl PromptBound {
    /// The bound in bytes, if known.
    pub fn bytes(&self) -> Option<usize> {
        (self.n_ctx > 0).then(|| (self.n_ctx as usize).saturating_mul(self.max_token_bytes.max(1)))
    }

    /// 400 `context_length_exceeded` when `request`'s prompt text is over the bound.
    pub fn check(&self, request: &GenerationRequest) -> Result<(), ApiError> {
        let Some(limit) = self.bytes() else { return Ok(()) };
        let (bytes, param) = match &request.prompt {
            PromptInput::Text(t) => (t.len(), "prompt"),
            PromptInput::Chat(m) => (m.iter().map(|m| m.content.len() + m.role.len()).sum(), "messages"),
        };
        if bytes <= limit {
            return Ok(());
        }
        Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {} tokens. However, your prompt of {bytes} bytes needs more than that (no token of this model stands for more than {} bytes). Please reduce the prompt.",
                self.n_ctx, self.max_token_bytes
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"))
    }
}

/// Tokens a completion generates when `max_tokens` is absent (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: u32 = 16;
/// Most stop sequences a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// Parses a JSON body into `T`, naming the field at fault.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.into_inner().to_string();
        // serde names an unknown field in its message; report it as the parameter at fault.
        let unknown = msg.strip_prefix("unknown field `").and_then(|r| r.split('`').next()).map(str::to_string);
        match unknown {
            Some(field) => {
                let param = if path == "." {
                    field
                } else if path == field || path.ends_with(&format!(".{field}")) {
                    path
                } else {
                    format!("{path}.{field}")
                };
                ApiError::invalid(format!("Unrecognized request argument supplied: {param}"), Some(&param))
            }
            None if path == "." => ApiError::invalid(format!("invalid request body: {msg}"), None),
            None => ApiError::invalid(format!("{path}: {msg}"), Some(&path)),
        }
    })
}

impl RequestBody {
    /// Checks the fields both endpoints share; returns the sampling and the stop sequences.
    fn sampling_and_stop(&mut self, served: &str) -> Result<(Sampling, Vec<String>), ApiError> {
        if let Some(m) = self.model.take().filter(|m| m != served) {
            return Err(ApiError {
                status: 404,
                message: format!("The model `{m}` does not exist: this server serves `{served}` (GET /v1/models)"),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n: sluice generates one choice per request; use n = 1", Some("n")));
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(
                    format!("{name}: not supported by sluice; leave it out or use 0"),
                    Some(name),
                ));
            }
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                format!("temperature: {temperature} is out of range; use 0 (greedy) to 2"),
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                format!("top_p: {top_p} is out of range; use a value in (0, 1]"),
                Some("top_p"),
            ));
        }
        let sampling = if temperature == 0.0 {
            Sampling::Greedy
        } else {
            Sampling::Random { temperature, top_p, seed: self.seed.unwrap_or_else(random_seed) }
        };
        let stop = match self.stop.take() {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s],
            Some(StopField::Many(v)) => v,
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                format!("stop: at most {MAX_STOPS} sequences, got {}", stop.len()),
                Some("stop"),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop: a stop sequence is empty", Some("stop")));
        }
        Ok((sampling, stop))
    }
}

/// A field the other endpoint takes, sent to this one.
fn wrong_endpoint(field: &str, endpoint: &str) -> ApiError {
    ApiError::invalid(
        format!("Unrecognized request argument supplied: {field} ({endpoint} does not take it)"),
        Some(field),
    )
}

/// A seed for a request that gives none.
fn random_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)
}

fn check_max_tokens(v: Option<u32>, param: &str) -> Result<Option<u32>, ApiError> {
    match v {
        Some(0) => Err(ApiError::invalid(format!("{param}: must be at least 1"), Some(param))),
        v => Ok(v),
    }
}

/// Parses and checks a `/v1/completions` body for the model `served`.
pub fn completion_request(body: &[u8], served: &str) -> Result<GenerationRequest, ApiError> {
    let mut r: RequestBody = parse(body)?;
    for (field, sent) in
        [("messages", r.messages.is_some()), ("max_completion_tokens", r.max_completion_tokens.is_some())]
    {
        if sent {
            return Err(wrong_endpoint(field, "/v1/completions"));
        }
    }
    let prompt = match r.prompt.take() {
        None => return Err(ApiError::invalid("missing field `prompt`", Some("prompt"))),
        Some(PromptField::One(p)) => p,
        Some(PromptField::Many(mut v)) if v.len() == 1 => v.remove(0),
        Some(PromptField::Many(v)) => {
            return Err(ApiError::invalid(
                format!("prompt: an array must hold exactly one string (got {}); send one request per prompt", v.len()),
                Some("prompt"),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt: the prompt is empty", Some("prompt")));
    }
    let max_tokens = Some(check_max_tokens(r.max_tokens, "max_tokens")?.unwrap_or(DEFAULT_COMPLETION_TOKENS));
    let (sampling, stop) = r.sampling_and_stop(served)?;
    Ok(GenerationRequest {
        prompt: PromptInput::Text(prompt),
        max_tokens,
        sampling,
        stop,
        stream: r.stream.unwrap_or(false),
    })
}

/// Parses and checks a `/v1/chat/completions` body for the model `served`.
pub fn chat_request(body: &[u8], served: &str) -> Result<GenerationRequest, ApiError> {
    let mut r: RequestBody = parse(body)?;
    if r.prompt.is_some() {
        return Err(wrong_endpoint("prompt", "/v1/chat/completions"));
    }
    let Some(fields) = r.messages.take() else {
        return Err(ApiError::invalid("missing field `messages`", Some("messages")));
    };
    if fields.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is needed", Some("messages")));
    }
    let mut messages = Vec::with_capacity(fields.len());
    for (i, m) in fields.into_iter().enumerate() {
        let content = match m.content {
            ContentField::Text(t) => t,
            ContentField::Parts(parts) => {
                let mut text = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    if p.kind != "text" {
                        let param = format!("messages[{i}].content[{j}].type");
                        return Err(ApiError::invalid(
                            format!("{param}: only \"text\" parts are supported, got {:?}", p.kind),
                            Some(&param),
                        ));
                    }
                    text.push_str(&p.text);
                }
                text
            }
        };
        let role = match m.role {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        };
        messages.push(ggml_sys::ChatMessage { role: role.into(), content });
    }
    let max_tokens = match (r.max_completion_tokens, r.max_tokens) {
        (Some(v), _) => check_max_tokens(Some(v), "max_completion_tokens")?,
        (None, v) => check_max_tokens(v, "max_tokens")?,
    };
    let (sampling, stop) = r.sampling_and_stop(served)?;
    Ok(GenerationRequest {
        prompt: PromptInput::Chat(messages),
        max_tokens,
        sampling,
        stop,
        stream: r.stream.unwrap_or(false),
    })
}

/// Formats chat `messages` as one prompt: with `template` (the model's own) when llama.cpp
/// knows it, else a plain transcript (`role: content` lines, then `assistant:`). Returns the
/// text and whether it came from the template (its control tokens are then parsed).
pub fn chat_prompt(template: Option<&str>, messages: &[ggml_sys::ChatMessage]) -> (String, bool) {
    if let Some(t) = template {
        match ggml_sys::apply_chat_template(t, messages) {
            Ok(text) => return (text, true),
            Err(e) => log::warn!("{e}; using the plain chat format"),
        }
    }
    let mut text = String::new();
    for m in messages {
        text.push_str(&m.role);
        text.push_str(": ");
        text.push_str(&m.content);
        text.push('\n');
    }
    text.push_str("assistant:");
    (text, false)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(r.prompt, PromptInput::Text("hi".into()));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling, Sampling::Random { temperature: 0.5, top_p: 0.9, seed: 7 });
        assert_eq!(r.stop, ["x"]);
        assert!(r.stream);
        let r = completion_request(br#"{"prompt":"hi","temperature":0}"#, "m").unwrap();
        assert_eq!((r.sampling, r.max_tokens), (Sampling::Greedy, Some(DEFAULT_COMPLETION_TOKENS)));
    }

    #[test]
    fn bad_completion_requests_name_the_field() {
        let e = err(r#"{"prompt":"hi","max_tokens":"five"}"#);
        assert_eq!((e.status, e.param.as_deref()), (400, Some("max_tokens")));
        assert!(e.message.contains("invalid type"), "{}", e.message);
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
        let e = err(r#"{"prompt":"hi","model":"gpt-4"}"#);
        assert_eq!((e.status, e.code), (404, Some("model_not_found")));
    }

    #[test]
    fn chat_requests_read_roles_and_text_parts() {
        let r = chat_request(
            br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":4}"#,
            "m",
        )
        .unwrap();
        let PromptInput::Chat(m) = r.prompt else { panic!("chat prompt expected") };
        assert_eq!((m[0].role.as_str(), m[1].content.as_str()), ("system", "hi"));
        assert_eq!(r.max_tokens, Some(4));
        let e = chat_request(br#"{"messages":[{"role":"robot","content":"x"}]}"#, "m").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = chat_request(br#"{"messages":[]}"#, "m").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn prompts_over_the_byte_bound_are_refused_before_tokenizing() {
        let bound = PromptBound { n_ctx: 16, max_token_bytes: 4 };
        let ok = completion_request(&serde_json::to_vec(&serde_json::json!({"prompt": "x".repeat(64)})).unwrap(), "m");
        assert!(bound.check(&ok.unwrap()).is_ok());
        let long =
            completion_request(&serde_json::to_vec(&serde_json::json!({"prompt": "x".repeat(65)})).unwrap(), "m");
        let e = bound.check(&long.unwrap()).unwrap_err();
        assert_eq!((e.status, e.code, e.param.as_deref()), (400, Some("context_length_exceeded"), Some("prompt")));
        assert!(e.message.contains("maximum context length is 16 tokens"), "{}", e.message);
        let chat = chat_request(
            &serde_json::to_vec(&serde_json::json!({"messages": [{"role": "user", "content": "y".repeat(70)}]}))
                .unwrap(),
            "m",
        );
        assert_eq!(bound.check(&chat.unwrap()).unwrap_err().param.as_deref(), Some("messages"));
        assert!(PromptBound::default().check(&completion_request(br#"{"prompt":"hi"}"#, "m").unwrap()).is_ok());
    }

    #[test]
    fn chat_prompts_use_a_known_template_or_the_plain_format() {
        let m = vec![ggml_sys::ChatMessage { role: "user".into(), content: "hi".into() }];
        let (text, templated) = chat_prompt(Some("chatml"), &m);
        assert!(templated);
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(chat_prompt(None, &m), ("user: hi\nassistant:".to_string(), false));
        assert!(!chat_prompt(Some("{{ not a template llama.cpp knows }}"), &m).1);
    }
}
