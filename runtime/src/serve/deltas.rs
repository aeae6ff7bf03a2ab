//! A chat answer's parsed output as a stream of OpenAI deltas: the generated text is fed to
//! the template family's parser as it grows, and what changed is sent: content,
//! `reasoning_content` and tool-call deltas.

use ggml_sys::{ChatParser, ParsedMessage};
use serde_json::{json, Map, Value};

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

/// Parses a generation's text as it grows and reports what each piece adds. What it streams
/// adds up to the whole message it ends with, also when the whole text does not parse in the
/// template's format (a small model's malformed tool-call markup): then the text the parser held
/// back is sent as content at the end.
pub struct MessageStream {
    parser: ChatParser,
    text: String,
    /// How much of `text` the last partial parse that succeeded read.
    parsed: usize,
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
            parsed: 0,
            sent: ParsedMessage::default(),
            ids: Vec::new(),
            id_prefix: id_prefix.to_string(),
        }
    }

    /// Adds generated text; returns what the message gained.
    pub fn push(&mut self, text: &str) -> Result<MessageDelta, ggml_sys::Error> {
        self.text.push_str(text);
        let now = self.parser.parse(&self.text, true)?;
        self.parsed = self.text.len();
        Ok(self.advance(now))
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Ends the text with `rest`: the last delta and the whole message, which is what all the
    /// deltas add up to.
    pub fn finish(&mut self, rest: &str) -> (MessageDelta, ParsedMessage) {
        self.text.push_str(rest);
        let mut last = self.parser.parse(&self.text, false).unwrap_or_else(|e| {
            log::warn!("the answer does not parse as the chat format says ({e}); it is returned as plain content");
            self.unparsed()
        });
        let delta = self.advance(last.clone());
        for (call, id) in last.tool_calls.iter_mut().zip(&self.ids) {
            call.id.clone_from(id);
        }
        (delta, last)
    }

    /// The message of a text that does not parse: all of it as content when only content that
    /// begins it was sent; else what was sent (thinking and calls cannot be taken back), its
    /// content followed by the text after what the parser last read.
    fn unparsed(&self) -> ParsedMessage {
        let sent = &self.sent;
        if sent.reasoning_content.is_empty() && sent.tool_calls.is_empty() && self.text.starts_with(&sent.content) {
            return ParsedMessage { content: self.text.clone(), ..ParsedMessage::default() };
        }
        let mut message = sent.clone();
        message.content.push_str(self.text.get(self.parsed..).unwrap_or_default());
        message
    }

    fn advance(&mut self, now: ParsedMessage) -> MessageDelta {
        let mut delta = MessageDelta {
            content: grow(&mut self.sent.content, now.content),
            reasoning: grow(&mut self.sent.reasoning_content, now.reasoning_content),
            tool_calls: Vec::new(),
        };
        for (index, call) in now.tool_calls.into_iter().enumerate() {
            if call.name.is_empty() {
                break;
            }
            match self.sent.tool_calls.get_mut(index) {
                Some(old) => {
                    let more = grow(&mut old.arguments, call.arguments);
                    if !more.is_empty() {
                        delta.tool_calls.push(ToolCallDelta { index, id: None, name: None, arguments: more });
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

/// What `now` adds to the text `sent` so far, which becomes `now`. Text already sent cannot be
/// taken back: when the parser reads the text differently than before (a partial parse of
/// malformed markup), nothing is sent and `sent` stays what the client has.
fn grow(sent: &mut String, now: String) -> String {
    match now.strip_prefix(sent.as_str()) {
        Some(more) => {
            let more = more.to_string();
            *sent = now;
            more
        }
        None => {
            log::debug!("the chat parser revised text it had returned; nothing of that field is sent until it grows");
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use ggml_sys::ChatInputs;

    use super::*;

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
