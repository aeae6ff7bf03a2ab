//! A `/v1/responses` answer as OpenAI's Responses API shapes it: output items (reasoning, the
//! message, function calls) built from the chat answer's deltas, the typed events a streamed
//! response sends as they grow, and the response object.

use serde_json::{json, Map, Value};

use super::ResponseSetup;
use crate::serve::deltas::MessageDelta;
use crate::serve::job::{Finish, TokenUsage};

/// What an output item is.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Reasoning,
    Message,
    Call { index: usize, call_id: String, name: String },
}

/// One output item, as far as it has grown.
#[derive(Debug, Clone)]
struct Item {
    kind: Kind,
    id: String,
    text: String,
    done: bool,
}

impl Item {
    /// The item as the API shows it (`done`: its final form).
    fn to_json(&self) -> Value {
        let status = if self.done { "completed" } else { "in_progress" };
        match &self.kind {
            Kind::Reasoning => {
                let content =
                    if self.done { json!([{ "type": "reasoning_text", "text": self.text }]) } else { json!([]) };
                json!({ "type": "reasoning", "id": self.id, "summary": [], "content": content, "status": status })
            }
            Kind::Message => {
                let content = if self.done { json!([text_part(&self.text)]) } else { json!([]) };
                json!({ "type": "message", "id": self.id, "status": status, "role": "assistant", "content": content })
            }
            Kind::Call { call_id, name, .. } => json!({
                "type": "function_call", "id": self.id, "call_id": call_id, "name": name,
                "arguments": self.text, "status": status
            }),
        }
    }
}

fn text_part(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

/// One response being built: its items and the events that report them.
#[derive(Debug)]
pub struct ResponseBuilder {
    id: String,
    created: u64,
    model: String,
    setup: ResponseSetup,
    items: Vec<Item>,
    seq: u64,
}

impl ResponseBuilder {
    /// A response `id` of `model`, made at `created` for a request set up as `setup`.
    pub fn new(id: String, created: u64, model: String, setup: ResponseSetup) -> ResponseBuilder {
        ResponseBuilder { id, created, model, setup, items: Vec::new(), seq: 0 }
    }

    /// The response's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// How the request was set up.
    pub fn setup(&self) -> &ResponseSetup {
        &self.setup
    }

    /// The first events of a stream: the response created and in progress.
    pub fn opening(&mut self) -> Vec<Value> {
        let r = self.response("in_progress", None, None);
        vec![
            self.event("response.created", json!({ "response": r.clone() })),
            self.event("response.in_progress", json!({ "response": r })),
        ]
    }

    /// Takes what a piece of output adds; returns the events that report it.
    pub fn push(&mut self, d: &MessageDelta) -> Vec<Value> {
        let mut out = Vec::new();
        if !d.reasoning.is_empty() {
            self.open(Kind::Reasoning, &mut out);
            out.push(self.text_delta("response.reasoning_text.delta", &d.reasoning));
        }
        if !d.content.is_empty() {
            self.open(Kind::Message, &mut out);
            out.push(self.text_delta("response.output_text.delta", &d.content));
        }
        for c in &d.tool_calls {
            let current = matches!(self.items.last(), Some(Item { kind: Kind::Call { index, .. }, done: false, .. }) if *index == c.index);
            if !current {
                let kind = Kind::Call {
                    index: c.index,
                    call_id: c.id.clone().unwrap_or_default(),
                    name: c.name.clone().unwrap_or_default(),
                };
                self.open(kind, &mut out);
            }
            out.push(self.text_delta("response.function_call_arguments.delta", &c.arguments));
        }
        out
    }

    /// The last events of a stream (the open item done, the response completed or incomplete)
    /// and the whole response.
    pub fn finish(&mut self, finish: Finish, counts: &TokenUsage) -> (Vec<Value>, Value) {
        let mut out = Vec::new();
        self.close(&mut out);
        let usage = json!({
            "input_tokens": counts.prompt,
            "input_tokens_details": { "cached_tokens": counts.cached },
            "output_tokens": counts.completion,
            "output_tokens_details": { "reasoning_tokens": 0 },
            "total_tokens": counts.prompt + counts.completion
        });
        let (status, kind) = if finish == Finish::Length {
            ("incomplete", "response.incomplete")
        } else {
            ("completed", "response.completed")
        };
        let r = self.response(status, Some(finish), Some(usage));
        out.push(self.event(kind, json!({ "response": r.clone() })));
        (out, r)
    }

    /// A failure's event in a stream.
    pub fn failed(&mut self, message: &str, code: Option<&str>) -> Value {
        self.event("error", json!({ "code": code, "message": message, "param": null }))
    }

    /// Opens an item of `kind` unless the last one is of it (closing the last one).
    fn open(&mut self, kind: Kind, out: &mut Vec<Value>) {
        if self.items.last().is_some_and(|i| !i.done && i.kind == kind) {
            return;
        }
        self.close(out);
        let prefix = match kind {
            Kind::Reasoning => "rs",
            Kind::Message => "msg",
            Kind::Call { .. } => "fc",
        };
        let id = format!("{prefix}_{}_{}", self.id.trim_start_matches("resp_"), self.items.len());
        self.items.push(Item { kind, id, text: String::new(), done: false });
        let (index, item) = (self.items.len() - 1, self.items[self.items.len() - 1].to_json());
        out.push(self.event("response.output_item.added", json!({ "output_index": index, "item": item })));
        if self.items[index].kind == Kind::Message {
            let id = self.items[index].id.clone();
            let part = json!({ "item_id": id, "output_index": index, "content_index": 0, "part": text_part("") });
            out.push(self.event("response.content_part.added", part));
        }
    }

    /// Closes the last item, if open, with its done events.
    fn close(&mut self, out: &mut Vec<Value>) {
        let Some(index) = self.items.len().checked_sub(1).filter(|&i| !self.items[i].done) else { return };
        self.items[index].done = true;
        let item = self.items[index].clone();
        let at = json!({ "item_id": item.id, "output_index": index });
        let with = |extra: Value| {
            let mut v = at.clone();
            v.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
            v
        };
        match &item.kind {
            Kind::Reasoning => {
                out.push(
                    self.event("response.reasoning_text.done", with(json!({ "content_index": 0, "text": item.text }))),
                );
            }
            Kind::Message => {
                let text = with(json!({ "content_index": 0, "text": item.text, "logprobs": [] }));
                out.push(self.event("response.output_text.done", text));
                let part = with(json!({ "content_index": 0, "part": text_part(&item.text) }));
                out.push(self.event("response.content_part.done", part));
            }
            Kind::Call { name, .. } => {
                let done = with(json!({ "name": name, "arguments": item.text }));
                out.push(self.event("response.function_call_arguments.done", done));
            }
        }
        out.push(self.event("response.output_item.done", json!({ "output_index": index, "item": item.to_json() })));
    }

    /// A text delta of the last item.
    fn text_delta(&mut self, kind: &str, delta: &str) -> Value {
        let index = self.items.len() - 1;
        self.items[index].text.push_str(delta);
        let mut v = json!({ "item_id": self.items[index].id, "output_index": index, "delta": delta });
        if !kind.starts_with("response.function_call") {
            v["content_index"] = json!(0);
        }
        if kind == "response.output_text.delta" {
            v["logprobs"] = json!([]);
        }
        self.event(kind, v)
    }

    /// An event of `kind` with `fields` and the next sequence number.
    fn event(&mut self, kind: &str, fields: Value) -> Value {
        let mut v = json!({ "type": kind, "sequence_number": self.seq });
        self.seq += 1;
        v.as_object_mut().expect("an object").extend(fields.as_object().cloned().unwrap_or_default());
        v
    }

    /// The response object.
    fn response(&self, status: &str, finish: Option<Finish>, usage: Option<Value>) -> Value {
        let mut r = Map::new();
        r.insert("id".into(), json!(self.id));
        r.insert("object".into(), json!("response"));
        r.insert("created_at".into(), json!(self.created));
        r.insert("status".into(), json!(status));
        r.insert("model".into(), json!(self.model));
        r.insert("output".into(), self.items.iter().map(Item::to_json).collect());
        r.insert("usage".into(), usage.unwrap_or(Value::Null));
        r.insert("error".into(), Value::Null);
        let incomplete = (finish == Some(Finish::Length)).then(|| json!({ "reason": "max_output_tokens" }));
        r.insert("incomplete_details".into(), incomplete.unwrap_or(Value::Null));
        r.extend(self.setup.echo.clone());
        Value::Object(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::deltas::ToolCallDelta;

    fn builder() -> ResponseBuilder {
        let setup = ResponseSetup { echo: Map::new(), store: true, history: Vec::new(), input_items: Vec::new() };
        ResponseBuilder::new("resp_7".into(), 1, "m".into(), setup)
    }

    #[test]
    fn deltas_open_and_close_items_in_order() {
        let mut b = builder();
        let mut events = b.opening();
        let think = MessageDelta { reasoning: "hm".into(), ..MessageDelta::default() };
        let say = MessageDelta { content: "Hi".into(), ..MessageDelta::default() };
        let call = |id: Option<&str>, args: &str| MessageDelta {
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: id.map(str::to_string),
                name: id.map(|_| "f".to_string()),
                arguments: args.into(),
            }],
            ..MessageDelta::default()
        };
        for d in [think.clone(), think, say, call(Some("call_1"), "{\"a\""), call(None, ":1}")] {
            events.extend(b.push(&d));
        }
        let (end, r) = b.finish(Finish::ToolCalls, &TokenUsage { prompt: 5, cached: 0, completion: 7 });
        events.extend(end);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert!(events.iter().enumerate().all(|(i, e)| e["sequence_number"] == i as u64));
        assert_eq!(r["status"], "completed");
        assert_eq!(r["output"][0]["content"][0]["text"], "hmhm");
        assert_eq!(r["output"][1]["content"][0]["text"], "Hi");
        assert_eq!(r["output"][2]["call_id"], "call_1");
        assert_eq!(r["output"][2]["arguments"], "{\"a\":1}");
        assert_eq!(r["usage"]["total_tokens"], 12);
        assert_eq!(
            b.finish(Finish::Length, &TokenUsage { prompt: 1, cached: 0, completion: 1 }).1["incomplete_details"]
                ["reason"],
            "max_output_tokens"
        );
    }
}
