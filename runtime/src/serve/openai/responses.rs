//! `POST /v1/responses`: the part of OpenAI's Responses API that its official client, LangChain
//! and the Agents SDK use, checked and translated into a chat request (the template, grammar and
//! parser are the chat's): `input` as text or items (messages, function calls and their outputs,
//! reasoning), `instructions`, function `tools`, `text.format`, `reasoning.effort`,
//! `max_output_tokens`, and `previous_response_id` over the responses the server keeps.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::response_input::{input_items, input_messages, InputField};
use super::{chat_from, parse, RequestBody};
use crate::serve::error::ApiError;
use crate::serve::job::GenerationRequest;

/// `text`: the answer's format.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextOptions {
    format: Option<Value>,
    verbosity: Option<IgnoredAny>,
}

/// `reasoning`: how much a thinking model thinks.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasoningOptions {
    effort: Option<String>,
    summary: Option<IgnoredAny>,
    generate_summary: Option<IgnoredAny>,
}

/// The body of `POST /v1/responses`: the fields sluice honours or knowingly ignores; any other
/// field is a 400.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponsesBody {
    model: Option<String>,
    input: Option<InputField>,
    instructions: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<TextOptions>,
    reasoning: Option<ReasoningOptions>,
    max_output_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    stream: Option<bool>,
    previous_response_id: Option<String>,
    store: Option<bool>,
    background: Option<bool>,
    include: Option<Vec<String>>,
    truncation: Option<String>,
    thinking_budget_tokens: Option<i64>,
    cache_prompt: Option<bool>,
    // Known fields that do not change what sluice generates: accepted, logged at debug.
    metadata: Option<Map<String, Value>>,
    stream_options: Option<IgnoredAny>,
    user: Option<IgnoredAny>,
    service_tier: Option<IgnoredAny>,
    safety_identifier: Option<IgnoredAny>,
    prompt_cache_key: Option<IgnoredAny>,
}

/// What answering a `/v1/responses` request needs besides the generation: the fields its
/// response object repeats, and the conversation to keep for a later `previous_response_id`.
#[derive(Debug, Clone)]
pub struct ResponseSetup {
    /// The request's settings as the response object repeats them.
    pub echo: Map<String, Value>,
    /// Whether the response is kept for `previous_response_id`.
    pub store: bool,
    /// The conversation so far as chat messages (the previous response's, then this input),
    /// without the instructions, which a later response does not inherit.
    pub history: Vec<Value>,
    /// This request's input as items (`GET /v1/responses/{id}/input_items`).
    pub input_items: Vec<Value>,
}

/// Parses and checks a `/v1/responses` body for the model `served`; `previous` finds the
/// conversation of a kept response.
pub fn responses_request(
    body: &[u8],
    served: &str,
    previous: &dyn Fn(&str) -> Option<Vec<Value>>,
) -> Result<(GenerationRequest, ResponseSetup), ApiError> {
    let mut r: ResponsesBody = parse(body)?;
    log_ignored(&r);
    if r.background == Some(true) {
        return Err(ApiError::invalid(
            "background: sluice answers while the connection is open; leave background out or false",
            Some("background"),
        ));
    }
    if let Some(t) = r.truncation.as_deref().filter(|t| *t != "disabled" && *t != "auto") {
        return Err(ApiError::invalid(
            format!("truncation: {t:?} is not \"disabled\" or \"auto\""),
            Some("truncation"),
        ));
    }
    for inc in r.include.iter().flatten() {
        if inc != "reasoning.encrypted_content" {
            return Err(ApiError::invalid(
                format!("include: {inc:?} is not supported (sluice returns reasoning as text; \"reasoning.encrypted_content\" is accepted and has nothing to add)"),
                Some("include"),
            ));
        }
    }
    if r.max_output_tokens == Some(0) {
        return Err(ApiError::invalid("max_output_tokens: must be at least 1", Some("max_output_tokens")));
    }
    let mut history = match &r.previous_response_id {
        None => Vec::new(),
        Some(id) => previous(id).ok_or_else(|| {
            ApiError::new(
                404,
                "invalid_request_error",
                format!("previous_response_id: no response {id:?} is kept here (sluice keeps a bounded number of recent responses, in memory, while it runs; responses made with store false are not kept): send the whole conversation in input"),
            )
            .with_param("previous_response_id")
        })?,
    };
    let input = r.input.take().ok_or_else(|| ApiError::invalid("missing field `input`", Some("input")))?;
    let input_items = input_items(&input);
    history.extend(input_messages(input)?);
    let mut messages: Vec<Value> = r.instructions.iter().map(|i| json!({"role": "system", "content": i})).collect();
    messages.extend(history.iter().cloned());
    let text_format = r.text.as_ref().and_then(|t| t.format.clone());
    let effort = r.reasoning.as_ref().and_then(|o| o.effort.clone());
    let echo = echo(&r, text_format.as_ref(), effort.as_deref());
    let chat = RequestBody {
        model: r.model,
        messages: Some(messages),
        max_tokens: r.max_output_tokens,
        temperature: r.temperature,
        top_p: r.top_p,
        stream: r.stream,
        tools: r.tools.map(chat_tools).transpose()?,
        tool_choice: r.tool_choice.map(chat_tool_choice).transpose()?,
        parallel_tool_calls: r.parallel_tool_calls,
        response_format: text_format.map(chat_format).transpose()?,
        reasoning_effort: effort,
        thinking_budget_tokens: r.thinking_budget_tokens,
        cache_prompt: r.cache_prompt,
        ..RequestBody::default()
    };
    let request = chat_from(chat, served).map_err(responses_names)?;
    Ok((request, ResponseSetup { echo, store: r.store.unwrap_or(true), history, input_items }))
}

/// An error about the chat request, naming the Responses API's fields.
pub(super) fn responses_names(e: ApiError) -> ApiError {
    e.renamed(&RESPONSES_NAMES)
}

/// The chat request's fields the Responses API names otherwise.
const RESPONSES_NAMES: [(&str, &str); 6] = [
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
    ("tools[{i}].function.parameters", "tools[{i}].parameters"),
    ("tools[{i}].function", "tools[{i}]"),
];

/// Says at debug which fields were accepted without effect.
fn log_ignored(r: &ResponsesBody) {
    let verbosity = r.text.as_ref().is_some_and(|t| t.verbosity.is_some());
    let summary = r.reasoning.as_ref().is_some_and(|o| o.summary.is_some() || o.generate_summary.is_some());
    for (name, sent) in [
        ("text.verbosity", verbosity),
        ("reasoning.summary", summary),
        ("stream_options", r.stream_options.is_some()),
        ("user", r.user.is_some()),
        ("service_tier", r.service_tier.is_some()),
        ("safety_identifier", r.safety_identifier.is_some()),
        ("prompt_cache_key", r.prompt_cache_key.is_some()),
    ] {
        if sent {
            log::debug!("request field {name} accepted and ignored: it does not change what sluice generates");
        }
    }
}

/// The request's settings as the response object repeats them.
fn echo(r: &ResponsesBody, format: Option<&Value>, effort: Option<&str>) -> Map<String, Value> {
    let mut e = Map::new();
    e.insert("instructions".into(), json!(r.instructions));
    e.insert("tools".into(), json!(r.tools.clone().unwrap_or_default()));
    e.insert("tool_choice".into(), r.tool_choice.clone().unwrap_or(json!("auto")));
    e.insert("parallel_tool_calls".into(), json!(r.parallel_tool_calls.unwrap_or(false)));
    e.insert("temperature".into(), json!(r.temperature.unwrap_or(1.0)));
    e.insert("top_p".into(), json!(r.top_p.unwrap_or(1.0)));
    e.insert("max_output_tokens".into(), json!(r.max_output_tokens));
    e.insert("previous_response_id".into(), json!(r.previous_response_id));
    e.insert("reasoning".into(), json!({ "effort": effort, "summary": null }));
    e.insert("text".into(), json!({ "format": format.cloned().unwrap_or(json!({"type": "text"})) }));
    e.insert("store".into(), json!(r.store.unwrap_or(true)));
    e.insert("metadata".into(), json!(r.metadata.clone().unwrap_or_default()));
    e.insert("truncation".into(), json!(r.truncation.clone().unwrap_or_else(|| "disabled".into())));
    e
}

/// Responses tools (`{"type": "function", "name", "description", "parameters", "strict"}`) as
/// chat tools; only function tools run here.
fn chat_tools(tools: Vec<Value>) -> Result<Vec<Value>, ApiError> {
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let param = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!(
                            "{param}.type: {other:?} tools are OpenAI's hosted tools; sluice runs function tools only"
                        ),
                        Some(&format!("{param}.type")),
                    ))
                }
                None => return Err(ApiError::invalid(format!("{param}.type: missing (\"function\")"), Some(&param))),
            }
            let mut function = Map::new();
            for key in ["name", "description", "parameters", "strict"] {
                if let Some(v) = t.get(key) {
                    function.insert(key.into(), v.clone());
                }
            }
            Ok(json!({ "type": "function", "function": function }))
        })
        .collect()
}

/// A Responses `tool_choice` (a mode, or `{"type": "function", "name"}`) as the chat's.
fn chat_tool_choice(choice: Value) -> Result<Value, ApiError> {
    match &choice {
        Value::String(_) => Ok(choice),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => match o.get("name") {
            Some(Value::String(name)) => Ok(json!({ "type": "function", "function": { "name": name } })),
            _ => Err(ApiError::invalid("tool_choice.name: the function's name is missing", Some("tool_choice.name"))),
        },
        _ => Err(ApiError::invalid(
            format!("tool_choice: {choice} is not \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": ...}}"),
            Some("tool_choice"),
        )),
    }
}

/// `text.format` (`{"type": "json_schema", "name", "schema", "strict"}` and the others) as the
/// chat's `response_format`.
fn chat_format(format: Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") | Some("json_object") => Ok(json!({ "type": format["type"] })),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(key) {
                    schema.insert(key.into(), v.clone());
                }
            }
            Ok(json!({ "type": "json_schema", "json_schema": schema }))
        }
        _ => Err(ApiError::invalid(
            format!("text.format.type: {} is not \"text\", \"json_object\" or \"json_schema\"", format["type"]),
            Some("text.format.type"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> Result<(GenerationRequest, ResponseSetup), ApiError> {
        responses_request(body.to_string().as_bytes(), "m", &|id| {
            (id == "resp_1").then(|| vec![json!({"role": "user", "content": "before"})])
        })
    }

    #[test]
    fn items_become_the_chat_they_stand_for() {
        let (req, setup) = request(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"},
            "max_output_tokens": 9,
            "store": false
        }))
        .unwrap();
        let crate::serve::job::PromptInput::Chat(inputs) = &req.prompt else { panic!("a chat") };
        let m = inputs.messages.as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["reasoning_content"], "look it up");
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}));
        assert_eq!(inputs.tool_choice, ggml_sys::ToolChoice::Required);
        assert_eq!(inputs.json_schema, Some(json!({"type": "object"})));
        assert_eq!(inputs.kwargs["reasoning_effort"], "low");
        assert_eq!(req.max_tokens, Some(9));
        assert!(!setup.store);
        assert_eq!(setup.history.len(), 3, "the instructions are not inherited");
        assert_eq!(setup.echo["tool_choice"], json!({"type": "function", "name": "get_weather"}));
    }

    #[test]
    fn a_previous_response_comes_before_the_input_or_is_refused() {
        let (req, setup) = request(json!({"input": "after", "previous_response_id": "resp_1"})).unwrap();
        let crate::serve::job::PromptInput::Chat(inputs) = &req.prompt else { panic!("a chat") };
        assert_eq!(inputs.messages[0]["content"], "before");
        assert_eq!(inputs.messages[1]["content"], "after");
        assert!(setup.store);
        let e = request(json!({"input": "x", "previous_response_id": "resp_gone"})).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (404, Some("previous_response_id")));
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        for (body, param) in [
            (json!({"input": "x", "tools": [{"type": "web_search"}]}), "tools[0].type"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0]"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0]",
            ),
            (json!({"input": "x", "text": {"format": {"type": "xml"}}}), "text.format.type"),
            (json!({"input": "x", "max_output_tokens": 0}), "max_output_tokens"),
            (json!({"input": "x", "frequency_penalty": 1}), "frequency_penalty"),
            (json!({"input": "x", "include": ["file_search_call.results"]}), "include"),
            // Fields inside a schema, named as this API names them.
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}}),
                "text.format.schema",
            ),
            (
                json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"pattern": "a{5,2}"}}}}]}),
                "tools[0].parameters",
            ),
        ] {
            let e = request(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }
}
