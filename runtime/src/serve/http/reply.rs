//! The JSON shapes of completion and chat responses, whole and streamed.

use serde_json::{json, Value};

use crate::serve::engine::Finish;

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
}

impl Reply {
    /// The whole response.
    pub fn full(&self, text: &str, finish: Finish, prompt_tokens: usize, completion_tokens: usize) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({ "text": text, "index": 0, "logprobs": null, "finish_reason": finish.as_str() }),
            Kind::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": null,
                "finish_reason": finish.as_str()
            }),
        };
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens
            }
        })
    }

    /// One streamed chunk: `text` so far (`delta` for chat), or the end with `finish`.
    pub fn chunk(&self, delta: Value, text: Option<&str>, finish: Option<Finish>) -> Value {
        let finish = finish.map(Finish::as_str);
        let choice = match self.kind {
            Kind::Completion => {
                json!({ "text": text.unwrap_or(""), "index": 0, "logprobs": null, "finish_reason": finish })
            }
            Kind::Chat => json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }),
        };
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
            "created": self.created,
            "model": self.model,
            "choices": [choice]
        })
    }
}
