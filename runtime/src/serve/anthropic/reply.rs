//! A chat answer in the Messages API's shapes: the whole message (thinking, text and `tool_use`
//! blocks, `stop_reason`, `usage`), or its stream of typed events (`message_start`, a
//! `content_block_start`/`_delta`/`_stop` run per block, `message_delta`, `message_stop`).

use ggml_sys::ParsedMessage;
use serde_json::{json, Value};

use super::request::MessagesSetup;
use crate::serve::deltas::MessageDelta;
use crate::serve::job::{Finish, TokenUsage};

/// The kind of content block a stream has open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
    ToolUse,
}

/// One answer being written in the Messages API's shapes.
#[derive(Debug)]
pub struct MessageReply {
    id: String,
    model: String,
    setup: MessagesSetup,
    /// The prompt's tokens (`message_start` reports them).
    prompt_tokens: usize,
    /// Blocks started so far, and the kind of the last one while it is open.
    blocks: usize,
    open: Option<Open>,
}

impl MessageReply {
    /// The reply `id` of `model` to a request with `setup` and a prompt of `prompt_tokens`.
    pub fn new(id: String, model: String, setup: MessagesSetup, prompt_tokens: usize) -> MessageReply {
        MessageReply { id, model, setup, prompt_tokens, blocks: 0, open: None }
    }

    /// The events that open a stream: `message_start` (with the prompt's tokens) and a `ping`.
    pub fn start_events(&self) -> Vec<Value> {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        });
        vec![json!({"type": "message_start", "message": message}), json!({"type": "ping"})]
    }

    /// The events for what the answer gained: thinking, then text, then tool uses.
    pub fn push(&mut self, d: &MessageDelta) -> Vec<Value> {
        let mut out = Vec::new();
        if !d.reasoning.is_empty() && self.setup.thinking {
            self.ensure(Open::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}), &mut out);
            out.push(self.delta(json!({"type": "thinking_delta", "thinking": d.reasoning})));
        }
        if !d.content.is_empty() {
            self.ensure(Open::Text, json!({"type": "text", "text": ""}), &mut out);
            out.push(self.delta(json!({"type": "text_delta", "text": d.content})));
        }
        for call in &d.tool_calls {
            if let (Some(id), Some(name)) = (&call.id, &call.name) {
                self.close(&mut out);
                self.start(Open::ToolUse, json!({"type": "tool_use", "id": id, "name": name, "input": {}}), &mut out);
            }
            if !call.arguments.is_empty() && self.open == Some(Open::ToolUse) {
                out.push(self.delta(json!({"type": "input_json_delta", "partial_json": call.arguments})));
            }
        }
        out
    }

    /// The events that end a stream: the open block's stop, `message_delta`, `message_stop`.
    pub fn finish(&mut self, finish: Finish, stop: Option<&str>, usage: &TokenUsage) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (reason, sequence) = self.stop_reason(finish, stop);
        out.push(json!({
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_json(usage)
        }));
        out.push(json!({"type": "message_stop"}));
        out
    }

    /// The whole message.
    pub fn whole(&self, m: &ParsedMessage, finish: Finish, stop: Option<&str>, usage: &TokenUsage) -> Value {
        let mut content = Vec::new();
        if !m.reasoning_content.is_empty() && self.setup.thinking {
            content.push(json!({"type": "thinking", "thinking": m.reasoning_content, "signature": ""}));
        }
        if !m.content.is_empty() {
            content.push(json!({"type": "text", "text": m.content}));
        }
        for c in &m.tool_calls {
            // A call cut off by max_tokens has arguments that are not JSON yet: its input is empty.
            let input = serde_json::from_str::<Value>(&c.arguments).ok().filter(Value::is_object).unwrap_or(json!({}));
            content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
        }
        let (reason, sequence) = self.stop_reason(finish, stop);
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_json(usage)
        })
    }

    fn stop_reason(&self, finish: Finish, stop: Option<&str>) -> (&'static str, Value) {
        match finish {
            Finish::Length => ("max_tokens", Value::Null),
            Finish::ToolCalls => ("tool_use", Value::Null),
            Finish::Stop => match stop.filter(|s| self.setup.stop_sequences.iter().any(|own| own == s)) {
                Some(s) => ("stop_sequence", json!(s)),
                None => ("end_turn", Value::Null),
            },
        }
    }

    fn ensure(&mut self, kind: Open, block: Value, out: &mut Vec<Value>) {
        if self.open != Some(kind) {
            self.close(out);
            self.start(kind, block, out);
        }
    }

    fn start(&mut self, kind: Open, block: Value, out: &mut Vec<Value>) {
        out.push(json!({"type": "content_block_start", "index": self.blocks, "content_block": block}));
        self.open = Some(kind);
        self.blocks += 1;
    }

    fn close(&mut self, out: &mut Vec<Value>) {
        if self.open.take().is_some() {
            out.push(json!({"type": "content_block_stop", "index": self.blocks - 1}));
        }
    }

    fn delta(&self, delta: Value) -> Value {
        json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})
    }
}

/// `usage`: input tokens not read from a slot's memory, those that were, and the output.
fn usage_json(u: &TokenUsage) -> Value {
    json!({
        "input_tokens": u.prompt - u.cached.min(u.prompt),
        "cache_read_input_tokens": u.cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::deltas::ToolCallDelta;

    #[test]
    fn a_stream_opens_one_block_per_kind_and_closes_it_before_the_next() {
        let setup = MessagesSetup { stop_sequences: vec!["END".into()], thinking: true };
        let mut r = MessageReply::new("msg_1".into(), "m".into(), setup, 7);
        let mut events = r.start_events();
        let d = |reasoning: &str, content: &str| MessageDelta {
            content: content.into(),
            reasoning: reasoning.into(),
            ..Default::default()
        };
        events.extend(r.push(&d("hm", "")));
        events.extend(r.push(&d("m", "Hi")));
        events.extend(r.push(&MessageDelta {
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("c0".into()),
                name: Some("w".into()),
                arguments: "{\"a\"".into(),
            }],
            ..Default::default()
        }));
        events.extend(r.push(&MessageDelta {
            tool_calls: vec![ToolCallDelta { index: 0, id: None, name: None, arguments: ": 1}".into() }],
            ..Default::default()
        }));
        events.extend(r.finish(Finish::ToolCalls, None, &TokenUsage { prompt: 7, cached: 2, completion: 9 }));
        let kinds: Vec<String> = events
            .iter()
            .map(|e| {
                format!(
                    "{}{}",
                    e["type"].as_str().unwrap(),
                    e["index"].as_u64().map_or(String::new(), |i| format!("@{i}"))
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "message_start",
                "ping",
                "content_block_start@0",
                "content_block_delta@0",
                "content_block_delta@0",
                "content_block_stop@0",
                "content_block_start@1",
                "content_block_delta@1",
                "content_block_stop@1",
                "content_block_start@2",
                "content_block_delta@2",
                "content_block_delta@2",
                "content_block_stop@2",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(events[10]["delta"], json!({"type": "input_json_delta", "partial_json": "{\"a\""}));
        assert_eq!(events[13]["delta"]["stop_reason"], "tool_use");
        assert_eq!(events[13]["usage"]["input_tokens"], 5);
        assert_eq!(events[13]["usage"]["cache_read_input_tokens"], 2);
    }

    #[test]
    fn only_the_requests_own_stop_sequence_is_reported() {
        let r = MessageReply::new(
            "m".into(),
            "m".into(),
            MessagesSetup { stop_sequences: vec!["END".into()], thinking: true },
            0,
        );
        let m = ParsedMessage { content: "a".into(), ..Default::default() };
        let u = TokenUsage::default();
        let own = r.whole(&m, Finish::Stop, Some("END"), &u);
        assert_eq!((own["stop_reason"].as_str(), own["stop_sequence"].as_str()), (Some("stop_sequence"), Some("END")));
        let template = r.whole(&m, Finish::Stop, Some("<|im_end|>"), &u);
        assert_eq!((template["stop_reason"].as_str(), &template["stop_sequence"]), (Some("end_turn"), &Value::Null));
        assert_eq!(r.whole(&m, Finish::Length, None, &u)["stop_reason"], "max_tokens");
    }
}
