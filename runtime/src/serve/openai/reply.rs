//! The JSON shapes of completion and chat responses, whole and streamed.

use ggml_sys::ParsedMessage;
use serde_json::{json, Value};

use crate::serve::job::{Finish, Piece, TokenUsage};
use crate::serve::logprobs::{self, TokenLogprob};

/// Which generation endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `POST /v1/completions`.
    Completion,
    /// `POST /v1/chat/completions`.
    Chat,
}

impl Kind {
    /// The prefix of a response id.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }
    }
}

/// The fields every response of one request shares.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The endpoint.
    pub kind: Kind,
    /// The response id.
    pub id: String,
    /// Unix time of the request.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// Whether log probabilities were asked for.
    pub logprobs: bool,
    /// Whether a streamed response ends with a usage chunk.
    pub include_usage: bool,
}

/// A whole generation, gathered from the engine's events.
#[derive(Debug, Default)]
pub struct Gathered {
    /// Completion text.
    pub text: String,
    /// A chat's answer.
    pub message: Option<ParsedMessage>,
    /// The chosen tokens' log probabilities (when asked).
    pub logprobs: Vec<TokenLogprob>,
}

impl Reply {
    /// The whole response.
    pub fn full(&self, out: &Gathered, finish: Finish, counts: &TokenUsage) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "text": out.text,
                "index": 0,
                "logprobs": self.logprobs_json(&out.logprobs, 0),
                "finish_reason": finish.as_str()
            }),
            Kind::Chat => json!({
                "index": 0,
                "message": message_json(out.message.as_ref().unwrap_or(&ParsedMessage::default())),
                "logprobs": self.logprobs_json(&out.logprobs, 0),
                "finish_reason": finish.as_str()
            }),
        };
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(counts)
        })
    }

    /// The first chunk of a streamed chat: the assistant's role.
    pub fn role_chunk(&self) -> Value {
        self.chunk_with(json!({ "index": 0, "delta": { "role": "assistant", "content": "" }, "logprobs": null, "finish_reason": null }))
    }

    /// One streamed chunk of output, its log probabilities' text offsets counted from `offset`.
    pub fn chunk(&self, piece: &Piece, logprobs: &[TokenLogprob], offset: usize) -> Value {
        let lp = self.logprobs_json(logprobs, offset);
        let choice = match piece {
            Piece::Text(t) => json!({ "text": t, "index": 0, "logprobs": lp, "finish_reason": null }),
            Piece::Delta(d) => json!({ "index": 0, "delta": d.to_json(), "logprobs": lp, "finish_reason": null }),
        };
        self.chunk_with(choice)
    }

    /// The streamed chunk that says why the generation ended.
    pub fn finish_chunk(&self, finish: Finish) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({ "text": "", "index": 0, "logprobs": null, "finish_reason": finish.as_str() }),
            Kind::Chat => json!({ "index": 0, "delta": {}, "logprobs": null, "finish_reason": finish.as_str() }),
        };
        self.chunk_with(choice)
    }

    /// The last streamed chunk when usage was asked for: no choices, the usage.
    pub fn usage_chunk(&self, counts: &TokenUsage) -> Value {
        let mut c = self.chunk_with(Value::Null);
        c["choices"] = json!([]);
        c["usage"] = usage(counts);
        c
    }

    fn chunk_with(&self, choice: Value) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
            "created": self.created,
            "model": self.model,
            "choices": [choice]
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn logprobs_json(&self, tokens: &[TokenLogprob], offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Completion => logprobs::completion_json(tokens, offset),
            Kind::Chat => logprobs::chat_json(tokens),
        }
    }
}

fn usage(counts: &TokenUsage) -> Value {
    json!({
        "prompt_tokens": counts.prompt,
        "completion_tokens": counts.completion,
        "total_tokens": counts.prompt + counts.completion,
        "prompt_tokens_details": { "cached_tokens": counts.cached }
    })
}

/// A chat answer as OpenAI's `message`: `content` (null when the answer only calls tools),
/// `reasoning_content` when the model thought, `tool_calls` when it called tools.
pub(super) fn message_json(m: &ParsedMessage) -> Value {
    let mut msg = json!({ "role": "assistant", "content": m.content });
    if m.content.is_empty() && !m.tool_calls.is_empty() {
        msg["content"] = Value::Null;
    }
    if !m.reasoning_content.is_empty() {
        msg["reasoning_content"] = json!(m.reasoning_content);
    }
    if !m.tool_calls.is_empty() {
        msg["tool_calls"] = m
            .tool_calls
            .iter()
            .map(
                |c| json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } }),
            )
            .collect();
    }
    msg
}
