//! Chat requests for llama.cpp's chat layer, and its parsed output as a stream of OpenAI deltas.
//!
//! The request side checks what the OpenAI chat API lets a client send (messages with text,
//! tool calls and tool results; tools; `tool_choice`; `response_format`; thinking switches) and
//! turns it into [`ChatInputs`] for the model's own Jinja template. The output side feeds the
//! generated text to the template family's parser as it grows and sends what changed:
//! content, `reasoning_content` and tool-call deltas.

use ggml_sys::{ChatInputs, ChatParser, ParsedMessage, ToolChoice};
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
    inputs.tool_choice = match &f.tool_choice {
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
    };
    if tools.is_empty() && inputs.tool_choice == ToolChoice::Required {
        return Err(ApiError::invalid("tool_choice: \"required\" needs at least one tool", Some("tool_choice")));
    }
    inputs.parse_tool_calls = !tools.is_empty() && inputs.tool_choice != ToolChoice::None;
    inputs.tools = (!tools.is_empty()).then_some(Value::Array(tools));
    inputs.parallel_tool_calls = f.parallel_tool_calls.unwrap_or(false);
    inputs.json_schema = f.response_format.as_ref().map(response_schema).transpose()?.flatten();
    inputs.kwargs = f.chat_template_kwargs.unwrap_or_default();
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
    match f.reasoning_effort.as_deref() {
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
    Ok(inputs)
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

/// What one piece of output adds to the message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageDelta {
    /// New answer text.
    pub content: String,
    /// New thinking text.
    pub reasoning: String,
    /// New or growing tool calls.
    pub tool_calls: Vec<ToolCallDelta>,
}

impl MessageDelta {
    /// Whether it adds nothing.
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }

    /// OpenAI's streamed `delta`.
    pub fn to_json(&self) -> Value {
        let mut d = Map::new();
        if !self.content.is_empty() {
            d.insert("content".into(), json!(self.content));
        }
        if !self.reasoning.is_empty() {
            d.insert("reasoning_content".into(), json!(self.reasoning));
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self
                .tool_calls
                .iter()
                .map(|c| {
                    let mut f = Map::new();
                    if let Some(name) = &c.name {
                        f.insert("name".into(), json!(name));
                    }
                    f.insert("arguments".into(), json!(c.arguments));
                    let mut call = json!({ "index": c.index, "function": f });
                    if let Some(id) = &c.id {
                        call["id"] = json!(id);
                        call["type"] = json!("function");
                    }
                    call
                })
                .collect();
            d.insert("tool_calls".into(), Value::Array(calls));
        }
        Value::Object(d)
    }
}

/// A tool call's part of a delta: the first names it (id, name), later ones add arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    /// Which call of the message.
    pub index: usize,
    /// Its id, in its first delta.
    pub id: Option<String>,
    /// Its function's name, in its first delta.
    pub name: Option<String>,
    /// More of its arguments' JSON text.
    pub arguments: String,
}

/// Parses a generation's text as it grows and reports what each piece adds.
pub struct MessageStream {
    parser: ChatParser,
    text: String,
    sent: ParsedMessage,
    ids: Vec<String>,
    id_prefix: String,
}

impl MessageStream {
    /// A stream parsed by `parser`; tool calls the model gives no id get `{id_prefix}_{n}`.
    pub fn new(parser: ChatParser, id_prefix: &str) -> MessageStream {
        MessageStream {
            parser,
            text: String::new(),
            sent: ParsedMessage::default(),
            ids: Vec::new(),
            id_prefix: id_prefix.to_string(),
        }
    }

    /// Adds generated text; returns what the message gained.
    pub fn push(&mut self, text: &str) -> Result<MessageDelta, ggml_sys::Error> {
        self.text.push_str(text);
        let now = self.parser.parse(&self.text, true)?;
        Ok(self.advance(now))
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Ends the text with `rest`: the last delta and the whole message.
    pub fn finish(&mut self, rest: &str) -> Result<(MessageDelta, ParsedMessage), ggml_sys::Error> {
        self.text.push_str(rest);
        let mut last = self.parser.parse(&self.text, false)?;
        let delta = self.advance(last.clone());
        for (call, id) in last.tool_calls.iter_mut().zip(&self.ids) {
            call.id.clone_from(id);
        }
        Ok((delta, last))
    }

    fn advance(&mut self, now: ParsedMessage) -> MessageDelta {
        let mut delta = MessageDelta {
            content: grown(&self.sent.content, &now.content),
            reasoning: grown(&self.sent.reasoning_content, &now.reasoning_content),
            tool_calls: Vec::new(),
        };
        self.sent.content = now.content;
        self.sent.reasoning_content = now.reasoning_content;
        for (index, call) in now.tool_calls.into_iter().enumerate() {
            if call.name.is_empty() {
                break;
            }
            match self.sent.tool_calls.get_mut(index) {
                Some(old) => {
                    let more = grown(&old.arguments, &call.arguments);
                    if !more.is_empty() {
                        delta.tool_calls.push(ToolCallDelta { index, id: None, name: None, arguments: more });
                        old.arguments = call.arguments;
                    }
                }
                None => {
                    let id = if call.id.is_empty() { format!("{}_{index}", self.id_prefix) } else { call.id.clone() };
                    self.ids.push(id.clone());
                    delta.tool_calls.push(ToolCallDelta {
                        index,
                        id: Some(id),
                        name: Some(call.name.clone()),
                        arguments: call.arguments.clone(),
                    });
                    self.sent.tool_calls.push(call);
                }
            }
        }
        delta
    }
}

/// What `now` adds to `before`. Text already sent cannot be taken back: when the parser reads
/// the text differently than before (it never should), nothing more is sent of that field.
fn grown(before: &str, now: &str) -> String {
    match now.strip_prefix(before) {
        Some(more) => more.to_string(),
        None => {
            log::debug!("the chat parser revised text it had returned; the rest of that field is not streamed");
            String::new()
        }
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

    #[test]
    fn deltas_grow_and_tool_calls_get_ids_once() {
        let mut sent = MessageStream::new_for_test();
        let d = sent.advance(ParsedMessage { content: "Hel".into(), ..Default::default() });
        assert_eq!(d.content, "Hel");
        let call = |args: &str| ggml_sys::ToolCall { name: "w".into(), arguments: args.into(), id: String::new() };
        let d = sent.advance(ParsedMessage {
            content: "Hello".into(),
            tool_calls: vec![call("{\"ci")],
            ..Default::default()
        });
        assert_eq!(d.content, "lo");
        assert_eq!(d.tool_calls[0].id.as_deref(), Some("call_0"));
        assert_eq!(d.tool_calls[0].arguments, "{\"ci");
        let d = sent.advance(ParsedMessage {
            content: "Hello".into(),
            tool_calls: vec![call("{\"city\": 1}")],
            ..Default::default()
        });
        assert_eq!(d.tool_calls, [ToolCallDelta { index: 0, id: None, name: None, arguments: "ty\": 1}".into() }]);
        assert_eq!(d.to_json(), json!({"tool_calls": [{"index": 0, "function": {"arguments": "ty\": 1}"}}]}));
    }

    impl MessageStream {
        fn new_for_test() -> MessageStream {
            let templates = ggml_sys::ChatTemplates::from_source(None, "chatml", "", "").unwrap();
            let (_, parser) = templates.apply(&ChatInputs::new(json!([{"role": "user", "content": "x"}]))).unwrap();
            MessageStream::new(parser, "call")
        }
    }
}
