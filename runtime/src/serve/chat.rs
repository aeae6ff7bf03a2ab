//! Chat requests for llama.cpp's chat layer: what the OpenAI chat API lets a client send
//! (messages with text, tool calls and tool results; tools; `tool_choice`; `response_format`;
//! thinking switches), checked and turned into [`ChatInputs`] for the model's own Jinja
//! template. The output side is [`super::deltas`].

use ggml_sys::{ChatInputs, ToolChoice};
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::limits::{self, MAX_TOOLS};

/// Roles a message may have.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];
/// The fields a message may have (OpenAI's, and llama-server's `reasoning_content`).
const MESSAGE_FIELDS: [&str; 7] =
    ["role", "content", "name", "tool_calls", "tool_call_id", "refusal", "reasoning_content"];
/// `reasoning_effort` values passed to templates that read them (gpt-oss).
const EFFORTS: [&str; 4] = ["minimal", "low", "medium", "high"];

/// The chat-only fields of a request, as sent.
#[derive(Debug, Default)]
pub struct ChatFields {
    /// `messages`.
    pub messages: Vec<Value>,
    /// `tools`.
    pub tools: Option<Vec<Value>>,
    /// `tool_choice`.
    pub tool_choice: Option<Value>,
    /// `parallel_tool_calls`.
    pub parallel_tool_calls: Option<bool>,
    /// `response_format`.
    pub response_format: Option<Value>,
    /// `chat_template_kwargs`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `reasoning_effort`.
    pub reasoning_effort: Option<String>,
}

/// Checks the chat fields and makes the template's inputs.
pub fn chat_inputs(f: ChatFields) -> Result<ChatInputs, ApiError> {
    if f.messages.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is needed", Some("messages")));
    }
    for (i, m) in f.messages.iter().enumerate() {
        check_message(i, m)?;
    }
    let mut inputs = ChatInputs::new(Value::Array(f.messages));
    let mut tools = f.tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            format!("tools: {} tools; at most {MAX_TOOLS} per request", tools.len()),
            Some("tools"),
        ));
    }
    for (i, t) in tools.iter().enumerate() {
        check_tool(i, t)?;
    }
    inputs.tool_choice = tool_choice(f.tool_choice.as_ref(), &mut tools)?;
    if tools.is_empty() && inputs.tool_choice == ToolChoice::Required {
        return Err(ApiError::invalid("tool_choice: \"required\" needs at least one tool", Some("tool_choice")));
    }
    inputs.parse_tool_calls = !tools.is_empty() && inputs.tool_choice != ToolChoice::None;
    inputs.tools = (!tools.is_empty()).then_some(Value::Array(tools));
    inputs.parallel_tool_calls = f.parallel_tool_calls.unwrap_or(false);
    inputs.json_schema = f.response_format.as_ref().map(response_schema).transpose()?.flatten();
    inputs.kwargs = f.chat_template_kwargs.unwrap_or_default();
    thinking(&mut inputs, f.reasoning_effort.as_deref())?;
    Ok(inputs)
}

/// `tool_choice`: a mode, or a named function, which then is the only tool offered (`tools`
/// is narrowed to it) and must be called.
fn tool_choice(choice: Option<&Value>, tools: &mut Vec<Value>) -> Result<ToolChoice, ApiError> {
    Ok(match choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    format!("tool_choice: {other:?} is not one of \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    Some("tool_choice"),
                ))
            }
        },
        Some(v) => {
            // A named function: the only tool offered, and it must be called.
            let name = v.pointer("/function/name").and_then(Value::as_str).filter(|_| v["type"] == "function");
            let Some(name) = name else {
                return Err(ApiError::invalid(
                    "tool_choice: an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    Some("tool_choice"),
                ));
            };
            tools.retain(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name));
            if tools.is_empty() {
                return Err(ApiError::invalid(
                    format!("tool_choice: the function {name:?} is not among the request's tools"),
                    Some("tool_choice"),
                ));
            }
            ToolChoice::Required
        }
    })
}

/// The thinking switches: `chat_template_kwargs.enable_thinking` (already in `inputs.kwargs`)
/// and `reasoning_effort`.
fn thinking(inputs: &mut ChatInputs, effort: Option<&str>) -> Result<(), ApiError> {
    match inputs.kwargs.get("enable_thinking") {
        None => {}
        Some(Value::Bool(b)) => inputs.enable_thinking = *b,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("chat_template_kwargs.enable_thinking: must be true or false, got {other}"),
                Some("chat_template_kwargs.enable_thinking"),
            ))
        }
    }
    match effort {
        None => {}
        Some("none") => inputs.enable_thinking = false,
        Some(e) if EFFORTS.contains(&e) => {
            inputs.kwargs.entry("reasoning_effort").or_insert_with(|| json!(e));
        }
        Some(e) => {
            return Err(ApiError::invalid(
                format!("reasoning_effort: {e:?} is not one of \"none\", \"minimal\", \"low\", \"medium\", \"high\""),
                Some("reasoning_effort"),
            ))
        }
    }
    // Templates that cannot turn thinking off (gpt-oss) think least at "low".
    if !inputs.enable_thinking {
        inputs.kwargs.entry("reasoning_effort").or_insert_with(|| json!("low"));
    }
    Ok(())
}

fn check_message(i: usize, m: &Value) -> Result<(), ApiError> {
    let at = |field: &str| format!("messages[{i}]{field}");
    let Some(obj) = m.as_object() else {
        return Err(ApiError::invalid(format!("{}: a message must be an object", at("")), Some(&at(""))));
    };
    if let Some(field) = obj.keys().find(|k| !MESSAGE_FIELDS.contains(&k.as_str())) {
        let param = at(&format!(".{field}"));
        return Err(ApiError::invalid(format!("Unrecognized request argument supplied: {param}"), Some(&param)));
    }
    let role = obj.get("role").and_then(Value::as_str).unwrap_or_default();
    if let Some(calls) = obj.get("tool_calls") {
        check_calls(&at(".tool_calls"), calls)?;
    }
    if !ROLES.contains(&role) {
        let param = at(".role");
        return Err(ApiError::invalid(
            format!("{param}: {:?} is not one of {ROLES:?}", obj.get("role").unwrap_or(&Value::Null)),
            Some(&param),
        ));
    }
    match obj.get("content") {
        Some(Value::String(_)) => Ok(()),
        None | Some(Value::Null) if role == "assistant" => Ok(()),
        None | Some(Value::Null) => {
            let param = at(".content");
            Err(ApiError::invalid(format!("{param}: a {role} message needs content"), Some(&param)))
        }
        Some(Value::Array(parts)) => {
            for (j, p) in parts.iter().enumerate() {
                let param = at(&format!(".content[{j}]"));
                match p.get("type").and_then(Value::as_str) {
                    Some("text") if p.get("text").is_some_and(Value::is_string) => {}
                    Some("text") => {
                        return Err(ApiError::invalid(format!("{param}.text: a text part needs a string"), Some(&param)))
                    }
                    Some(kind @ ("image_url" | "input_image" | "input_audio" | "file" | "video_url")) => {
                        return Err(ApiError::invalid(
                            format!("{param}: {kind} parts are not supported: this server runs a text-only model; send text parts"),
                            Some(&param),
                        ))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            format!("{param}.type: {other:?} is not a content part type sluice takes (\"text\")"),
                            Some(&param),
                        ))
                    }
                }
            }
            Ok(())
        }
        Some(other) => {
            let param = at(".content");
            Err(ApiError::invalid(
                format!("{param}: must be a string, an array of text parts, or null (assistant), got {other}"),
                Some(&param),
            ))
        }
    }
}

/// An assistant message's `tool_calls`: each names its function and gives its arguments as JSON
/// (the template renders them, and a call cut off mid-arguments cannot be).
fn check_calls(param: &str, calls: &Value) -> Result<(), ApiError> {
    let Some(calls) = calls.as_array() else {
        return Err(ApiError::invalid(format!("{param}: must be an array of tool calls"), Some(param)));
    };
    for (j, c) in calls.iter().enumerate() {
        let at = format!("{param}[{j}].function");
        if !c.pointer("/function/name").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                format!("{at}.name: a tool call names its function"),
                Some(&format!("{at}.name")),
            ));
        }
        let arguments = match c.pointer("/function/arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| e.to_string()),
            Some(v @ Value::Object(_)) => Ok(v.clone()),
            _ => Err("missing".to_string()),
        };
        if let Err(e) = arguments {
            let at = format!("{at}.arguments");
            return Err(ApiError::invalid(
                format!("{at}: the arguments must be a JSON object as text ({e}); a call cut off by max_tokens cannot be sent back"),
                Some(&at),
            ));
        }
    }
    Ok(())
}

fn check_tool(i: usize, t: &Value) -> Result<(), ApiError> {
    let param = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(format!("{param}.type: only \"function\" tools exist"), Some(&param)));
    }
    let name = t.pointer("/function/name").and_then(Value::as_str).unwrap_or_default();
    if name.is_empty() {
        return Err(ApiError::invalid(format!("{param}.function.name: a tool needs a name"), Some(&param)));
    }
    match t.pointer("/function/parameters") {
        None => Ok(()),
        Some(schema @ Value::Object(_)) => limits::check_schema(&format!("{param}.function.parameters"), schema),
        Some(_) => {
            Err(ApiError::invalid(format!("{param}.function.parameters: must be a JSON schema object"), Some(&param)))
        }
    }
}

/// The JSON schema a `response_format` asks the answer to follow; `None` for plain text.
fn response_schema(format: &Value) -> Result<Option<Value>, ApiError> {
    let param = "response_format";
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({ "type": "object" }))),
        Some("json_schema") => match format.pointer("/json_schema/schema") {
            Some(schema @ Value::Object(_)) => {
                limits::check_schema("response_format.json_schema.schema", schema)?;
                Ok(Some(schema.clone()))
            }
            Some(Value::Bool(true)) | None => Ok(Some(json!({}))),
            Some(other) => Err(ApiError::invalid(
                format!("response_format.json_schema.schema: must be a JSON schema object, got {other}"),
                Some("response_format.json_schema.schema"),
            )),
        },
        other => Err(ApiError::invalid(
            format!("response_format.type: {other:?} is not one of \"text\", \"json_object\", \"json_schema\""),
            Some(param),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(messages: Value) -> ChatFields {
        ChatFields { messages: messages.as_array().unwrap().clone(), ..ChatFields::default() }
    }

    fn refused(f: ChatFields) -> ApiError {
        chat_inputs(f).unwrap_err()
    }

    #[test]
    fn messages_of_every_role_and_null_content_are_taken() {
        let f = fields(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
        ]));
        let inputs = chat_inputs(f).unwrap();
        assert_eq!(inputs.messages.as_array().unwrap().len(), 4);
        assert!(inputs.tools.is_none() && !inputs.parse_tool_calls);
    }

    #[test]
    fn bad_messages_name_the_field() {
        let e = refused(fields(json!([{"role": "robot", "content": "x"}])));
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = refused(fields(json!([{"role": "user", "content": null}])));
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = refused(fields(json!([{"role": "user", "content": "x", "extra": 1}])));
        assert_eq!(e.param.as_deref(), Some("messages[0].extra"));
        let e = refused(fields(
            json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
        ));
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1]"));
        assert!(e.message.contains("text-only model"), "{}", e.message);
        assert_eq!(refused(fields(json!([]))).param.as_deref(), Some("messages"));
        let cut = json!([{"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Par"}}]}]);
        let e = refused(fields(cut));
        assert_eq!(e.param.as_deref(), Some("messages[0].tool_calls[0].function.arguments"));
        assert!(e.message.contains("cut off by max_tokens"), "{}", e.message);
    }

    #[test]
    fn tools_choices_formats_and_thinking_switches_are_read() {
        let tool = json!({"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}});
        let other = json!({"type": "function", "function": {"name": "x"}});
        let mut f = fields(json!([{"role": "user", "content": "hi"}]));
        f.tools = Some(vec![tool.clone(), other]);
        f.tool_choice = Some(json!({"type": "function", "function": {"name": "w"}}));
        f.response_format = Some(json!({"type": "json_object"}));
        f.chat_template_kwargs = Some(json!({"enable_thinking": false}).as_object().unwrap().clone());
        let inputs = chat_inputs(f).unwrap();
        assert_eq!(inputs.tools, Some(json!([tool])));
        assert_eq!(inputs.tool_choice, ToolChoice::Required);
        assert!(inputs.parse_tool_calls && !inputs.enable_thinking);
        assert_eq!(inputs.json_schema, Some(json!({"type": "object"})));

        let mut f = fields(json!([{"role": "user", "content": "hi"}]));
        f.tools = Some(Vec::new());
        f.reasoning_effort = Some("high".into());
        let inputs = chat_inputs(f).unwrap();
        assert!(inputs.tools.is_none() && inputs.enable_thinking);
        assert_eq!(inputs.kwargs["reasoning_effort"], "high");

        let mut f = fields(json!([{"role": "user", "content": "hi"}]));
        f.reasoning_effort = Some("none".into());
        let inputs = chat_inputs(f).unwrap();
        assert!(!inputs.enable_thinking);
        assert_eq!(inputs.kwargs["reasoning_effort"], "low", "the least thinking where it cannot be turned off");

        let refused_with = |set: fn(&mut ChatFields), param: &str| {
            let mut f = fields(json!([{"role": "user", "content": "hi"}]));
            set(&mut f);
            assert_eq!(refused(f).param.as_deref(), Some(param));
        };
        refused_with(|f| f.tool_choice = Some(json!("required")), "tool_choice");
        refused_with(|f| f.tool_choice = Some(json!("sometimes")), "tool_choice");
        refused_with(|f| f.tools = Some(vec![json!({"type": "retrieval"})]), "tools[0]");
        refused_with(|f| f.response_format = Some(json!({"type": "yaml"})), "response_format");
        refused_with(|f| f.reasoning_effort = Some("max".into()), "reasoning_effort");
    }
}
