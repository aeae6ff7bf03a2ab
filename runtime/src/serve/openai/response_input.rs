//! The `input` of a `/v1/responses` request as the chat messages it stands for: text, or items
//! (messages, function calls and their outputs, reasoning).

use serde::Deserialize;
use serde_json::{json, Value};

use crate::serve::error::ApiError;

/// `input`: text, or a list of items.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of input items")]
pub(super) enum InputField {
    /// A user message's text.
    Text(String),
    /// Input items.
    Items(Vec<Value>),
}

/// `input` as the items `input_items` lists: text is a user message; each item gets an id when
/// it has none.
pub(super) fn input_items(input: &InputField) -> Vec<Value> {
    let items = match input {
        InputField::Text(t) => {
            vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]})]
        }
        InputField::Items(items) => items.clone(),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            if let Value::Object(o) = &mut item {
                o.entry("id").or_insert_with(|| json!(format!("in_{i}")));
                if o.contains_key("role") {
                    o.entry("type").or_insert_with(|| json!("message"));
                }
            }
            item
        })
        .collect()
}

/// `input` as chat messages: text is a user message; items are messages, function calls (joined
/// to the assistant message before them), their outputs (tool messages) and reasoning (the next
/// assistant message's `reasoning_content`).
pub(super) fn input_messages(input: InputField) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        InputField::Text(t) => return Ok(vec![json!({"role": "user", "content": t})]),
        InputField::Items(items) => items,
    };
    let mut out: Vec<Value> = Vec::new();
    let mut reasoning = String::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind =
            item.get("type").and_then(Value::as_str).unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
                if !["user", "system", "developer", "assistant"].contains(&role) {
                    return Err(ApiError::invalid(
                        format!("{at}.role: {:?} is not \"user\", \"system\", \"developer\" or \"assistant\"", item["role"]),
                        Some(&format!("{at}.role")),
                    ));
                }
                let mut m = json!({ "role": role, "content": message_text(item.get("content"), &format!("{at}.content"))? });
                if role == "assistant" && !reasoning.is_empty() {
                    m["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                }
                out.push(m);
            }
            "function_call" => {
                let call = json!({
                    "id": field(item, "call_id", &at)?,
                    "type": "function",
                    "function": { "name": field(item, "name", &at)?, "arguments": field(item, "arguments", &at)? }
                });
                let joins = out.last().is_some_and(|m| m["role"] == "assistant") && reasoning.is_empty();
                if !joins {
                    let mut m = json!({ "role": "assistant", "content": null });
                    if !reasoning.is_empty() {
                        m["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                    }
                    out.push(m);
                }
                let last = out.last_mut().expect("an assistant message was just ensured");
                last.as_object_mut().expect("messages are objects").entry("tool_calls").or_insert(json!([]));
                last["tool_calls"].as_array_mut().expect("tool_calls is an array").push(call);
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    o => message_text(o, &format!("{at}.output"))?,
                };
                out.push(json!({ "role": "tool", "tool_call_id": field(item, "call_id", &at)?, "content": output }));
            }
            "reasoning" => reasoning.push_str(&reasoning_text(item)),
            "item_reference" => {
                return Err(ApiError::invalid(
                    format!("{at}: item references are not supported; send the item itself"),
                    Some(&at),
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    format!("{at}.type: {other:?} is not an input item sluice takes (\"message\", \"function_call\", \"function_call_output\", \"reasoning\")"),
                    Some(&format!("{at}.type")),
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(ApiError::invalid("input: at least one message is needed", Some("input")));
    }
    Ok(out)
}

/// A string field of an input item.
fn field<'a>(item: &'a Value, key: &str, at: &str) -> Result<&'a str, ApiError> {
    item.get(key).and_then(Value::as_str).ok_or_else(|| {
        let param = format!("{at}.{key}");
        ApiError::invalid(format!("{param}: a string is needed"), Some(&param))
    })
}

/// A message's content: a string, or text parts (`input_text`, `output_text`, `refusal`).
fn message_text(content: Option<&Value>, param: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let at = format!("{param}[{j}]");
                let piece = match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => p.get("text").and_then(Value::as_str),
                    Some("refusal") => p.get("refusal").and_then(Value::as_str),
                    Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                        return Err(ApiError::invalid(
                            format!(
                            "{at}: {kind} parts are not supported: this server runs a text-only model; send text parts"
                        ),
                            Some(&at),
                        ))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            format!("{at}.type: {other:?} is not a text part (\"input_text\", \"output_text\")"),
                            Some(&at),
                        ))
                    }
                };
                let piece =
                    piece.ok_or_else(|| ApiError::invalid(format!("{at}.text: a string is needed"), Some(&at)))?;
                text.push_str(piece);
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(format!("{param}: must be a string or an array of text parts"), Some(param))),
    }
}

/// A reasoning item's text: its `content` (reasoning text), else its summary.
fn reasoning_text(item: &Value) -> String {
    let texts = |key: &str| -> String {
        item.get(key)
            .and_then(Value::as_array)
            .map(|parts| parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect())
            .unwrap_or_default()
    };
    let content = texts("content");
    if content.is_empty() {
        texts("summary")
    } else {
        content
    }
}
