//! The bodies of Ollama's `/api/chat` and `/api/generate`, checked and translated into the chat
//! (or, for a raw `generate`, completion) request every API shares: messages with tool calls and
//! results, `tools`, `format` (`"json"` or a schema), `think`, `options` and `stream`.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::job::{GenerationRequest, Truncation};
use crate::serve::openai;

/// `/api/chat`'s body (fields it does not know are ignored, as Ollama ignores them).
#[derive(Debug, Deserialize)]
pub struct ChatBody {
    /// The model's name.
    pub model: Option<String>,
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    format: Option<Value>,
    options: Option<Map<String, Value>>,
    stream: Option<bool>,
    think: Option<Value>,
    /// How long the model stays loaded (`0`: unload).
    pub keep_alive: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<IgnoredAny>,
    /// Whether a prompt over the context is cut to fit (the default) or refused.
    truncate: Option<bool>,
}

/// `/api/generate`'s body (fields it does not know are ignored, as Ollama ignores them).
#[derive(Debug, Deserialize)]
pub struct GenerateBody {
    /// The model's name.
    pub model: Option<String>,
    prompt: Option<String>,
    suffix: Option<String>,
    system: Option<String>,
    template: Option<String>,
    context: Option<Vec<i64>>,
    raw: Option<bool>,
    images: Option<Vec<Value>>,
    format: Option<Value>,
    options: Option<Map<String, Value>>,
    stream: Option<bool>,
    think: Option<Value>,
    /// How long the model stays loaded (`0`: unload).
    pub keep_alive: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<IgnoredAny>,
    /// Whether a prompt over the context is cut to fit (the default) or refused.
    truncate: Option<bool>,
}

/// Options that change what is generated, and their chat request's names.
const OPTIONS: [(&str, &str); 9] = [
    ("temperature", "temperature"),
    ("top_k", "top_k"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("stop", "stop"),
    ("repeat_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
];
/// Options Ollama takes that do not apply to a served model (loading, threads, GPUs) or that
/// sluice does not implement (mirostat, typical sampling): accepted and ignored, as Ollama
/// ignores an option it does not know.
const IGNORED_OPTIONS: [&str; 16] = [
    "typical_p",
    "repeat_last_n",
    "tfs_z",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "penalize_newline",
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "num_thread",
];

impl ChatBody {
    /// Whether the request only loads (or unloads) the model: no messages.
    pub fn loads_only(&self) -> bool {
        self.messages.as_ref().is_none_or(Vec::is_empty)
    }

    /// Whether `think` asks for thinking (`true` or a level).
    pub fn asks_thinking(&self) -> bool {
        asks_thinking(self.think.as_ref())
    }

    /// The generation request; `context` is the server's positions (for `num_ctx`).
    pub fn request(self, context: u32) -> Result<GenerationRequest, ApiError> {
        no_logprobs(self.logprobs, self.top_logprobs.is_some())?;
        let mut openai = Map::new();
        openai.insert("messages".into(), Value::Array(chat_messages(self.messages.unwrap_or_default())?));
        if let Some(tools) = self.tools {
            openai.insert("tools".into(), Value::Array(tools));
        }
        let truncate = truncation(self.truncate, self.options.as_ref(), context);
        common(&mut openai, self.format, self.options, self.stream, self.think.as_ref(), context)?;
        let request = openai::chat_request_from(Value::Object(openai), "").map_err(ollama_names)?;
        Ok(GenerationRequest { truncate, ..request })
    }
}

impl GenerateBody {
    /// Whether the request only loads (or unloads) the model: no prompt.
    pub fn loads_only(&self) -> bool {
        self.prompt.as_deref().is_none_or(str::is_empty)
    }

    /// Whether `think` asks for thinking (`true` or a level).
    pub fn asks_thinking(&self) -> bool {
        asks_thinking(self.think.as_ref())
    }

    /// The generation request: the prompt as a user turn of the model's template, or as is
    /// when `raw`.
    pub fn request(self, context: u32) -> Result<GenerationRequest, ApiError> {
        no_logprobs(self.logprobs, self.top_logprobs.is_some())?;
        let refuse = |field: &str, why: &str| Err(ApiError::invalid(format!("{field}: {why}"), Some(field)));
        if self.template.as_deref().is_some_and(|t| !t.is_empty()) {
            return refuse("template", "sluice renders prompts with the model's own chat template; leave template out (or send raw: true with a whole prompt)");
        }
        if self.suffix.as_deref().is_some_and(|t| !t.is_empty()) {
            return refuse("suffix", "fill-in-the-middle is not supported; send the text before the gap as the prompt");
        }
        if self.context.as_ref().is_some_and(|c| !c.is_empty()) {
            return refuse(
                "context",
                "sluice does not return or take context tokens; send the conversation to /api/chat instead",
            );
        }
        if self.images.as_ref().is_some_and(|i| !i.is_empty()) {
            return refuse("images", "this server runs a text-only model; send text");
        }
        let prompt = self.prompt.unwrap_or_default();
        let mut openai = Map::new();
        let raw = self.raw.unwrap_or(false);
        if raw {
            if self.format.is_some() || self.think.is_some() {
                return refuse(
                    "raw",
                    "a raw prompt is completed as is: format and think need the chat template (leave raw out)",
                );
            }
            openai.insert("prompt".into(), json!(prompt));
        } else {
            let mut messages = Vec::new();
            if let Some(system) = self.system {
                messages.push(json!({"role": "system", "content": system}));
            }
            messages.push(json!({"role": "user", "content": prompt}));
            openai.insert("messages".into(), Value::Array(messages));
        }
        let truncate = truncation(self.truncate, self.options.as_ref(), context);
        common(&mut openai, self.format, self.options, self.stream, self.think.as_ref(), context)?;
        let bounded = openai.contains_key("max_tokens");
        let body = Value::Object(openai);
        let request = if raw { openai::completion_request_from(body, "") } else { openai::chat_request_from(body, "") };
        let mut request = request.map_err(ollama_names)?;
        request.truncate = truncate;
        if !bounded {
            // Ollama generates until the model stops or the context is full, raw prompts too.
            request.max_tokens = None;
        }
        Ok(request)
    }
}

/// The tokens at a prompt's start that a cut never takes, unless `num_keep` says otherwise
/// (Ollama's default).
const DEFAULT_NUM_KEEP: u32 = 4;

/// How a prompt over the context is cut, as Ollama cuts it: unless `truncate` is false (then
/// it is refused), to fit `num_ctx` (at most the server's `context` positions), keeping the
/// first `num_keep` tokens.
fn truncation(truncate: Option<bool>, options: Option<&Map<String, Value>>, context: u32) -> Option<Truncation> {
    if truncate == Some(false) {
        return None;
    }
    let option = |name: &str| options.and_then(|o| o.get(name)).and_then(Value::as_u64);
    let num_ctx = option("num_ctx").filter(|&n| n > 0).map_or(context, |n| n.min(u64::from(context)) as u32);
    let keep = option("num_keep").map_or(DEFAULT_NUM_KEEP, |k| k.min(u64::from(u32::MAX)) as u32);
    Some(Truncation { context: num_ctx, keep })
}

/// Whether a `think` value asks for thinking: `true` or a level.
fn asks_thinking(think: Option<&Value>) -> bool {
    matches!(think, Some(Value::Bool(true) | Value::String(_)))
}

/// `logprobs` (asked for) and `top_logprobs` are not offered on Ollama's API.
fn no_logprobs(logprobs: Option<bool>, top: bool) -> Result<(), ApiError> {
    if logprobs == Some(true) || top {
        return Err(ApiError::invalid(
            "logprobs: log probabilities are not offered on Ollama's API here; use /v1/chat/completions with logprobs",
            Some("logprobs"),
        ));
    }
    Ok(())
}

/// The fields chat and generate share: `format`, `options`, `stream` (on by default) and `think`.
fn common(
    openai: &mut Map<String, Value>,
    format: Option<Value>,
    options: Option<Map<String, Value>>,
    stream: Option<bool>,
    think: Option<&Value>,
    context: u32,
) -> Result<(), ApiError> {
    openai.insert("stream".into(), json!(stream.unwrap_or(true)));
    match format {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => {
            openai.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some(schema @ Value::Object(_)) => {
            openai.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}),
            );
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("format: {other} is not \"json\" or a JSON schema object"),
                Some("format"),
            ))
        }
    }
    translate_options(openai, options.unwrap_or_default(), context)?;
    match think {
        None | Some(Value::Null) => {}
        Some(Value::Bool(true)) => {
            openai.insert("chat_template_kwargs".into(), json!({"enable_thinking": true}));
        }
        Some(Value::Bool(false)) => {
            openai.insert("reasoning_effort".into(), json!("none"));
        }
        Some(Value::String(level)) if ["low", "medium", "high"].contains(&level.as_str()) => {
            openai.insert("reasoning_effort".into(), json!(level));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("think: {other} is not true, false, \"low\", \"medium\" or \"high\""),
                Some("think"),
            ))
        }
    }
    Ok(())
}

/// `options` as the chat request's fields.
fn translate_options(
    openai: &mut Map<String, Value>,
    options: Map<String, Value>,
    context: u32,
) -> Result<(), ApiError> {
    for (name, value) in options {
        if let Some((_, to)) = OPTIONS.iter().find(|(from, _)| *from == name) {
            openai.insert((*to).into(), value);
        } else if name == "num_predict" {
            match value.as_i64() {
                Some(n) if n > 0 => {
                    openai.insert("max_tokens".into(), json!(n.min(i64::from(u32::MAX))));
                }
                // -1 (no bound) and -2 (fill the context): what the context leaves.
                Some(-1 | -2) => {}
                _ => {
                    return Err(ApiError::invalid(
                        format!("options.num_predict: {value} is not a positive number of tokens, -1 or -2"),
                        Some("options.num_predict"),
                    ))
                }
            }
        } else if name == "num_keep" {
            if value.as_u64().is_none() {
                return Err(ApiError::invalid(
                    format!("options.num_keep: {value} is not a number of tokens"),
                    Some("options.num_keep"),
                ));
            }
        } else if name == "num_ctx" {
            match value.as_u64() {
                Some(n) if n > u64::from(context) => {
                    log::debug!(
                        "options.num_ctx {n} is over this server's {context} positions: the server's context applies"
                    );
                }
                Some(n) if n > 0 => {}
                _ => {
                    return Err(ApiError::invalid(
                        format!("options.num_ctx: {value} is not a number of positions"),
                        Some("options.num_ctx"),
                    ))
                }
            }
        } else if IGNORED_OPTIONS.contains(&name.as_str()) {
            log::debug!("option {name} accepted and ignored: it does not apply to a served model");
        } else {
            log::warn!("invalid option provided: {name} (ignored, as Ollama ignores it)");
        }
    }
    Ok(())
}

/// An error about the translated request, naming Ollama's fields.
pub(super) fn ollama_names(e: ApiError) -> ApiError {
    const NAMES: [(&str, &str); 12] = [
        ("max_tokens", "options.num_predict"),
        ("temperature", "options.temperature"),
        ("top_k", "options.top_k"),
        ("top_p", "options.top_p"),
        ("min_p", "options.min_p"),
        ("seed", "options.seed"),
        ("stop", "options.stop"),
        ("repetition_penalty", "options.repeat_penalty"),
        ("presence_penalty", "options.presence_penalty"),
        ("frequency_penalty", "options.frequency_penalty"),
        ("response_format.json_schema.schema", "format"),
        ("response_format", "format"),
    ];
    e.renamed(&NAMES)
}

/// Ollama's messages as chat messages: tool calls get ids (Ollama's have none, or their own),
/// and each tool result answers the first call not answered yet (or the one of its `tool_name`).
fn chat_messages(messages: Vec<Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    let mut pending: Vec<(String, String)> = Vec::new();
    for (i, m) in messages.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(mut m) = m else {
            return Err(ApiError::invalid(format!("{at}: a message must be an object"), Some(&at)));
        };
        if m.get("images").and_then(Value::as_array).is_some_and(|i| !i.is_empty()) {
            let param = format!("{at}.images");
            return Err(ApiError::invalid(
                format!("{param}: this server runs a text-only model; send text"),
                Some(&param),
            ));
        }
        m.remove("images");
        if let Some(thinking) = m.remove("thinking") {
            m.insert("reasoning_content".into(), thinking);
        }
        let tool_name = m.remove("tool_name");
        if let Some(Value::Array(calls)) = m.remove("tool_calls") {
            pending.clear();
            let mut chat_calls = Vec::new();
            for (j, call) in calls.into_iter().enumerate() {
                let f = &call["function"];
                let name = f["name"].as_str().unwrap_or_default().to_string();
                let arguments = match &f["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => "{}".into(),
                    other => other.to_string(),
                };
                let id = call["id"].as_str().map_or_else(|| format!("call_{i}_{j}"), str::to_string);
                pending.push((id.clone(), name.clone()));
                chat_calls
                    .push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}));
            }
            m.insert("tool_calls".into(), Value::Array(chat_calls));
        }
        if m.get("role").and_then(Value::as_str) == Some("tool") && !m.contains_key("tool_call_id") {
            let named = tool_name.as_ref().and_then(Value::as_str);
            let at = named.and_then(|n| pending.iter().position(|(_, name)| name == n)).unwrap_or(0);
            if at < pending.len() {
                m.insert("tool_call_id".into(), json!(pending.remove(at).0));
            }
        }
        out.push(Value::Object(m));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::job::PromptInput;

    fn chat(body: Value) -> Result<GenerationRequest, ApiError> {
        serde_json::from_value::<ChatBody>(body).unwrap().request(4096)
    }

    #[test]
    fn options_map_to_the_sampler_and_tool_results_answer_their_calls() {
        let r = chat(json!({"model": "m", "options": {"num_predict": 7, "temperature": 0.5, "seed": 3, "stop": ["x"], "num_ctx": 8192, "num_thread": 4},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "rain", "tool_name": "w"}
            ]}))
        .unwrap();
        assert_eq!(
            (r.max_tokens, r.sampling.temperature, r.stop.as_slice(), r.stream),
            (Some(7), 0.5, ["x".to_string()].as_slice(), true)
        );
        let PromptInput::Chat(c) = &r.prompt else { panic!() };
        assert_eq!(c.messages[1]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(c.messages[2]["tool_call_id"], c.messages[1]["tool_calls"][0]["id"]);
    }

    #[test]
    fn bad_fields_are_named_as_ollama_names_them() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let e = |body: Value| chat(body).unwrap_err().param;
        assert_eq!(e(json!({"messages": user, "options": {"temperature": 9}})).as_deref(), Some("options.temperature"));
        assert_eq!(
            e(json!({"messages": user, "options": {"num_predict": "x"}})).as_deref(),
            Some("options.num_predict")
        );
        assert_eq!(e(json!({"messages": user, "format": 3})).as_deref(), Some("format"));
        assert_eq!(e(json!({"messages": user, "think": "max"})).as_deref(), Some("think"));
        let image = json!([{"role": "user", "content": "what is it?", "images": ["aGk="]}]);
        assert_eq!(e(json!({"messages": image})).as_deref(), Some("messages[0].images"));
        let g = |body: Value| serde_json::from_value::<GenerateBody>(body).unwrap().request(4096).unwrap_err().param;
        assert_eq!(g(json!({"prompt": "a", "suffix": "b"})).as_deref(), Some("suffix"));
        assert_eq!(g(json!({"prompt": "a", "template": "{{ .Prompt }}"})).as_deref(), Some("template"));
    }
}
