//! The body of `POST /v1/messages` (and `/v1/messages/count_tokens`), checked and translated into
//! the chat request every API shares: `system`, messages of text, `thinking`, `tool_use` and
//! `tool_result` blocks, `tools`, `tool_choice`, `thinking`, `stop_sequences` and sampling.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::job::GenerationRequest;
use crate::serve::{http, openai};

/// The fields of a Messages request that sluice honours or knowingly ignores; any other is a 400.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesBody {
    model: Option<String>,
    messages: Option<Vec<Value>>,
    system: Option<Value>,
    max_tokens: Option<u32>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
    output_config: Option<OutputConfig>,
    container: Option<IgnoredAny>,
    // Fields that do not change what a local model generates: accepted and ignored (prompt
    // caching is automatic here: a slot keeps what a later request starts with).
    metadata: Option<IgnoredAny>,
    service_tier: Option<IgnoredAny>,
    cache_control: Option<IgnoredAny>,
    diagnostics: Option<IgnoredAny>,
    inference_geo: Option<IgnoredAny>,
    speed: Option<IgnoredAny>,
    user_profile_id: Option<IgnoredAny>,
    workspace_id: Option<IgnoredAny>,
}

/// `output_config`: the answer's JSON schema and how hard the model thinks.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputConfig {
    effort: Option<String>,
    format: Option<Value>,
}

/// What answering needs besides the generation: the request's own stop sequences (a stop of the
/// template's is an end of turn, not a `stop_sequence`).
#[derive(Debug, Clone, Default)]
pub struct MessagesSetup {
    /// `stop_sequences`.
    pub stop_sequences: Vec<String>,
    /// Whether `thinking` asked for thinking blocks: without it the answer has none, as on
    /// Anthropic's API (a template that thinks anyway, gpt-oss's, has its thinking left out).
    pub thinking: bool,
}

/// Parses a Messages body; `count_only` for `count_tokens`, which takes no `max_tokens`.
pub fn parse(body: &[u8], count_only: bool) -> Result<(GenerationRequest, MessagesSetup), ApiError> {
    let b: MessagesBody = http::parse(body)?;
    let ignored = [
        b.metadata.is_some(),
        b.service_tier.is_some(),
        b.cache_control.is_some(),
        b.diagnostics.is_some(),
        b.inference_geo.is_some(),
        b.speed.is_some(),
        b.user_profile_id.is_some(),
        b.workspace_id.is_some(),
    ];
    if ignored.into_iter().any(|sent| sent) {
        log::debug!("Messages fields that do not change what sluice generates accepted and ignored");
    }
    if b.container.is_some() {
        return Err(ApiError::invalid(
            "container: code execution containers do not run here; leave container out",
            Some("container"),
        ));
    }
    if let Some(m) = &b.model {
        log::debug!("a Messages request for model {m:?}: answered by the served model (agents name their own models)");
    }
    let max_tokens = match (b.max_tokens, count_only) {
        (Some(0), false) => return Err(ApiError::invalid("max_tokens: must be at least 1", Some("max_tokens"))),
        (None, false) => return Err(ApiError::invalid("max_tokens: Field required", Some("max_tokens"))),
        (n, _) => n,
    };
    let Some(messages) = b.messages else {
        return Err(ApiError::invalid("messages: Field required", Some("messages")));
    };
    if messages.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is needed", Some("messages")));
    }
    if let Some(t) = b.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::invalid(format!("temperature: {t} is out of range; use 0 to 1"), Some("temperature")));
    }
    let mut chat = Vec::new();
    if let Some(system) = &b.system {
        chat.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    for (i, m) in messages.iter().enumerate() {
        translate_message(i, m, &mut chat)?;
    }
    let mut openai = Map::new();
    openai.insert("messages".into(), Value::Array(chat));
    if let Some(n) = max_tokens {
        openai.insert("max_tokens".into(), json!(n));
    }
    for (key, value) in [
        ("temperature", b.temperature.map(|v| json!(v))),
        ("top_p", b.top_p.map(|v| json!(v))),
        ("top_k", b.top_k.map(|v| json!(v))),
        ("stop", b.stop_sequences.clone().map(|v| json!(v))),
        ("stream", b.stream.map(|v| json!(v))),
    ] {
        if let Some(v) = value {
            openai.insert(key.into(), v);
        }
    }
    if let Some(tools) = &b.tools {
        openai.insert("tools".into(), Value::Array(translate_tools(tools)?));
    }
    let parallel = translate_tool_choice(b.tool_choice.as_ref(), &mut openai)?;
    openai.insert("parallel_tool_calls".into(), json!(parallel));
    let thinking = translate_thinking(b.thinking.as_ref(), &mut openai)?;
    if let Some(config) = b.output_config {
        translate_output_config(config, &mut openai)?;
    }
    let request = openai::chat_request_from(Value::Object(openai), "").map_err(anthropic_names)?;
    Ok((request, MessagesSetup { stop_sequences: b.stop_sequences.unwrap_or_default(), thinking }))
}

/// An error about the translated request, naming the Messages API's fields.
pub(super) fn anthropic_names(e: ApiError) -> ApiError {
    const NAMES: [(&str, &str); 8] = [
        ("stop", "stop_sequences"),
        ("thinking_budget_tokens", "thinking.budget_tokens"),
        ("response_format.json_schema.schema", "output_config.format.schema"),
        ("response_format", "output_config.format"),
        ("reasoning_effort", "output_config.effort"),
        ("tools[{i}].function.parameters", "tools.{i}.input_schema"),
        ("tools[{i}].function", "tools.{i}"),
        ("tools[{i}]", "tools.{i}"),
    ];
    e.renamed(&NAMES)
}

/// Text given as a string or an array of text blocks (`cache_control` and citations ignored).
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = Vec::new();
            for (j, block) in blocks.iter().enumerate() {
                match (block["type"].as_str(), block["text"].as_str()) {
                    (Some("text"), Some(t)) => out.push(t),
                    _ => {
                        let param = format!("{at}.{j}");
                        return Err(ApiError::invalid(
                            format!("{param}: expected a text block ({{\"type\": \"text\", \"text\": ...}})"),
                            Some(&param),
                        ));
                    }
                }
            }
            Ok(out.join("\n"))
        }
        other => {
            Err(ApiError::invalid(format!("{at}: must be a string or an array of text blocks, got {other}"), Some(at)))
        }
    }
}

/// One Messages message as chat messages: a user turn's tool results become tool messages
/// (before its text), an assistant turn's thinking, text and tool uses one assistant message.
fn translate_message(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("messages.{i}");
    let role = m["role"].as_str().unwrap_or_default();
    if role != "user" && role != "assistant" {
        let param = format!("{at}.role");
        return Err(ApiError::invalid(
            format!("{param}: {} is not \"user\" or \"assistant\"", m["role"]),
            Some(&param),
        ));
    }
    if let Some(extra) = m.as_object().and_then(|o| o.keys().find(|k| *k != "role" && *k != "content")) {
        let param = format!("{at}.{extra}");
        return Err(ApiError::invalid(format!("{param}: Extra inputs are not permitted"), Some(&param)));
    }
    let blocks = match &m["content"] {
        Value::String(s) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        other => {
            let param = format!("{at}.content");
            return Err(ApiError::invalid(
                format!("{param}: must be a string or an array of content blocks, got {other}"),
                Some(&param),
            ));
        }
    };
    let Blocks { text, thinking, calls } = translate_blocks(&at, role, blocks, out)?;
    if role == "user" {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": text.join("\n")}));
        }
        return Ok(());
    }
    let mut message = json!({"role": "assistant", "content": text.join("\n")});
    if !thinking.is_empty() {
        message["reasoning_content"] = json!(thinking.join("\n"));
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    out.push(message);
    Ok(())
}

/// What a message's blocks hold besides tool results.
#[derive(Debug, Default)]
struct Blocks {
    text: Vec<String>,
    thinking: Vec<String>,
    calls: Vec<Value>,
}

/// A message's blocks: its text, thinking and tool calls; tool results go to `out` as tool
/// messages.
fn translate_blocks(at: &str, role: &str, blocks: &[Value], out: &mut Vec<Value>) -> Result<Blocks, ApiError> {
    let (mut text, mut thinking, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        let kind = block["type"].as_str().unwrap_or_default();
        match (role, kind) {
            (_, "text") => text.push(string_field(block, "text", &at)?.to_string()),
            ("assistant", "thinking") => thinking.push(string_field(block, "thinking", &at)?.to_string()),
            ("assistant", "redacted_thinking") => {}
            ("assistant", "tool_use") => {
                let id = string_field(block, "id", &at)?;
                let name = string_field(block, "name", &at)?;
                let input = block.get("input").filter(|v| v.is_object()).ok_or_else(|| {
                    ApiError::invalid(format!("{at}.input: must be an object"), Some(&format!("{at}.input")))
                })?;
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("user", "tool_result") => {
                let id = string_field(block, "tool_use_id", &at)?;
                let content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{at}.content"))?,
                };
                let content = if block["is_error"] == true { format!("Error: {content}") } else { content };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (_, "image" | "document" | "search_result" | "container_upload") => {
                return Err(ApiError::invalid(
                    format!("{at}: {kind} blocks are not supported: this server runs a text-only model; send text blocks"),
                    Some(&at),
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    format!("{at}.type: {kind:?} is not a block a {role} message can hold here (text, thinking, tool_use in assistant turns, tool_result in user turns)"),
                    Some(&format!("{at}.type")),
                ))
            }
        }
    }
    Ok(Blocks { text, thinking, calls })
}

fn string_field<'a>(block: &'a Value, field: &str, at: &str) -> Result<&'a str, ApiError> {
    block[field].as_str().ok_or_else(|| {
        let param = format!("{at}.{field}");
        ApiError::invalid(format!("{param}: Field required (a string)"), Some(&param))
    })
}

/// Client tools as chat functions; Anthropic's server tools cannot run here.
fn translate_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools.{i}");
            if let Some(kind) = t["type"].as_str().filter(|k| *k != "custom") {
                return Err(ApiError::invalid(
                    format!("{at}.type: {kind:?} is one of Anthropic's server tools, which do not run here; give client tools (name, description, input_schema)"),
                    Some(&format!("{at}.type")),
                ));
            }
            let name = string_field(t, "name", &at)?;
            let Some(schema) = t.get("input_schema").filter(|s| s.is_object()) else {
                let param = format!("{at}.input_schema");
                return Err(ApiError::invalid(format!("{param}: Field required (a JSON schema object)"), Some(&param)));
            };
            let mut function = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description") {
                function["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

/// `tool_choice` (auto, any, tool, none) as the chat's; returns whether parallel calls are allowed.
fn translate_tool_choice(choice: Option<&Value>, openai: &mut Map<String, Value>) -> Result<bool, ApiError> {
    let Some(choice) = choice else { return Ok(true) };
    let parallel = choice["disable_parallel_tool_use"] != true;
    let chat = match choice["type"].as_str() {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = string_field(choice, "name", "tool_choice")?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(ApiError::invalid(
                format!("tool_choice.type: {} is not one of \"auto\", \"any\", \"tool\", \"none\"", choice["type"]),
                Some("tool_choice.type"),
            ))
        }
    };
    if !openai.contains_key("tools") && choice["type"] != "none" && choice["type"] != "auto" {
        return Err(ApiError::invalid("tool_choice: needs tools to choose from", Some("tool_choice")));
    }
    openai.insert("tool_choice".into(), chat);
    Ok(parallel)
}

/// `output_config`: `format` as the chat's JSON schema, `effort` as its reasoning effort.
fn translate_output_config(config: OutputConfig, openai: &mut Map<String, Value>) -> Result<(), ApiError> {
    match config.format {
        None | Some(Value::Null) => {}
        Some(f) if f["type"] == "json_schema" && f["schema"].is_object() => {
            openai.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": f["schema"]}}),
            );
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}",
                Some("output_config.format"),
            ))
        }
    }
    match config.effort.as_deref() {
        None => {}
        Some(e @ ("low" | "medium" | "high")) => {
            openai.insert("reasoning_effort".into(), json!(e));
        }
        Some("xhigh" | "max") => {
            openai.insert("reasoning_effort".into(), json!("high"));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("output_config.effort: {other:?} is not one of low, medium, high, xhigh, max"),
                Some("output_config.effort"),
            ))
        }
    }
    Ok(())
}

/// `thinking`: enabled with a budget of tokens, disabled, or left to the model (adaptive,
/// between tools); absent, off, as on Anthropic's API, where thinking is asked for. Returns
/// whether it was asked for.
fn translate_thinking(thinking: Option<&Value>, openai: &mut Map<String, Value>) -> Result<bool, ApiError> {
    let Some(t) = thinking else {
        openai.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
        return Ok(false);
    };
    match t["type"].as_str() {
        Some("enabled") => {
            let budget = t["budget_tokens"].as_u64().filter(|b| *b >= 1).ok_or_else(|| {
                ApiError::invalid(
                    "thinking.budget_tokens: Field required (a number of tokens)",
                    Some("thinking.budget_tokens"),
                )
            })?;
            openai.insert("thinking_budget_tokens".into(), json!(budget));
            openai.insert("chat_template_kwargs".into(), json!({"enable_thinking": true}));
        }
        Some("disabled") => {
            openai.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
            return Ok(false);
        }
        Some("adaptive" | "between_tools") => {
            openai.insert("chat_template_kwargs".into(), json!({"enable_thinking": true}));
        }
        _ => {
            return Err(ApiError::invalid(
                format!(
                    "thinking.type: {} is not \"enabled\", \"disabled\", \"adaptive\" or \"between_tools\"",
                    t["type"]
                ),
                Some("thinking.type"),
            ))
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests;
