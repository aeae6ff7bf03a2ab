//! A generation in Ollama's shapes: JSON lines (`message` for `/api/chat`, `response` for
//! `/api/generate`; thinking as `thinking`; tool calls with object arguments), then a last object
//! with `done: true`, `done_reason` and the counts and durations Ollama reports.

use std::time::{Instant, SystemTime};

use ggml_sys::ParsedMessage;
use serde_json::{json, Map, Value};

use crate::serve::job::{Finish, Piece, TokenUsage};

/// Which endpoint answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/api/chat`: `message` objects.
    Chat,
    /// `/api/generate`: `response` text.
    Generate,
}

/// An RFC 3339 timestamp, as Ollama writes them.
pub fn timestamp(t: SystemTime) -> String {
    humantime::format_rfc3339_nanos(t).to_string()
}

/// One answer being written in Ollama's shapes.
#[derive(Debug)]
pub struct OllamaReply {
    endpoint: Endpoint,
    model: String,
    begun: Instant,
    first: Option<Instant>,
}

impl OllamaReply {
    /// The answer of `endpoint` for the model the client named `model`, begun at `begun`.
    pub fn new(endpoint: Endpoint, model: String, begun: Instant) -> OllamaReply {
        OllamaReply { endpoint, model, begun, first: None }
    }

    /// The line for a piece of output, if it adds text or thinking.
    pub fn piece(&mut self, piece: &Piece) -> Option<Value> {
        let (content, thinking) = match piece {
            Piece::Text(t) => (t.as_str(), ""),
            Piece::Delta(d) => (d.content.as_str(), d.reasoning.as_str()),
        };
        // The first output starts the evaluation, whether it is text or part of a tool call.
        self.first.get_or_insert_with(Instant::now);
        if content.is_empty() && thinking.is_empty() {
            return None;
        }
        Some(self.line(content, thinking, &[], false))
    }

    /// The line with the answer's tool calls (Ollama sends them whole, once they are).
    pub fn tool_calls(&self, m: &ParsedMessage) -> Option<Value> {
        (!m.tool_calls.is_empty()).then(|| self.line("", "", &tool_calls(m), false))
    }

    /// The last line of a stream: `done`, why, and the counts.
    pub fn done(&self, finish: Finish, usage: &TokenUsage) -> Value {
        self.ended(self.line("", "", &[], true), finish, usage)
    }

    /// The whole answer in one object.
    pub fn whole(&self, text: &str, m: Option<&ParsedMessage>, finish: Finish, usage: &TokenUsage) -> Value {
        let line = match m {
            Some(m) => self.line(&m.content, &m.reasoning_content, &tool_calls(m), true),
            None => self.line(text, "", &[], true),
        };
        self.ended(line, finish, usage)
    }

    /// What a request that only loads or unloads the model is answered with.
    pub fn loaded(&self, unload: bool) -> Value {
        let mut line = self.line("", "", &[], true);
        line["done_reason"] = json!(if unload { "unload" } else { "load" });
        line
    }

    fn line(&self, content: &str, thinking: &str, calls: &[Value], done: bool) -> Value {
        let mut line = json!({"model": self.model, "created_at": timestamp(SystemTime::now())});
        match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if !thinking.is_empty() {
                    message["thinking"] = json!(thinking);
                }
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls.to_vec());
                }
                line["message"] = message;
            }
            Endpoint::Generate => {
                line["response"] = json!(content);
                if !thinking.is_empty() {
                    line["thinking"] = json!(thinking);
                }
            }
        }
        line["done"] = json!(done);
        line
    }

    fn ended(&self, mut line: Value, finish: Finish, usage: &TokenUsage) -> Value {
        let now = Instant::now();
        let first = self.first.unwrap_or(now);
        let ns = |d: std::time::Duration| d.as_nanos() as u64;
        let fields: Map<String, Value> = [
            ("done_reason", json!(if finish == Finish::Length { "length" } else { "stop" })),
            ("total_duration", json!(ns(now - self.begun))),
            ("load_duration", json!(0)),
            ("prompt_eval_count", json!(usage.prompt)),
            ("prompt_eval_duration", json!(ns(first - self.begun))),
            ("eval_count", json!(usage.completion)),
            ("eval_duration", json!(ns(now - first))),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Value::Object(o) = &mut line {
            o.extend(fields);
        }
        line
    }
}

/// Tool calls as Ollama writes them: the arguments as an object.
fn tool_calls(m: &ParsedMessage) -> Vec<Value> {
    m.tool_calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            // A call cut off by num_predict has arguments that are not JSON yet: they are empty.
            let arguments =
                serde_json::from_str::<Value>(&c.arguments).ok().filter(Value::is_object).unwrap_or(json!({}));
            json!({"id": c.id, "function": {"index": i, "name": c.name, "arguments": arguments}})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::deltas::MessageDelta;

    #[test]
    fn chat_lines_carry_text_thinking_and_calls_and_end_with_the_counts() {
        let mut r = OllamaReply::new(Endpoint::Chat, "m:latest".into(), Instant::now());
        let d = MessageDelta { content: "Hi".into(), reasoning: "hm".into(), ..Default::default() };
        let line = r.piece(&Piece::Delta(d)).unwrap();
        assert_eq!(line["message"], json!({"role": "assistant", "content": "Hi", "thinking": "hm"}));
        assert_eq!(line["done"], false);
        assert!(r.piece(&Piece::Delta(MessageDelta::default())).is_none());
        let call = ggml_sys::ToolCall { name: "w".into(), arguments: "{\"city\":\"Oslo\"}".into(), id: "c0".into() };
        let m = ParsedMessage { tool_calls: vec![call], ..Default::default() };
        assert_eq!(
            r.tool_calls(&m).unwrap()["message"]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Oslo"})
        );
        let done = r.done(Finish::ToolCalls, &TokenUsage { prompt: 5, cached: 0, completion: 3 });
        assert_eq!((done["done"].as_bool(), done["done_reason"].as_str()), (Some(true), Some("stop")));
        assert_eq!((done["prompt_eval_count"].as_u64(), done["eval_count"].as_u64()), (Some(5), Some(3)));
        assert!(done["created_at"].as_str().unwrap().ends_with('Z'));
        let g = OllamaReply::new(Endpoint::Generate, "m".into(), Instant::now());
        let whole = g.whole("abc", None, Finish::Length, &TokenUsage::default());
        assert_eq!((whole["response"].as_str(), whole["done_reason"].as_str()), (Some("abc"), Some("length")));
    }
}
