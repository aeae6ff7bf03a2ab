//! A completion or chat streamed as OpenAI's chunks: a chat opens with the role's chunk, each
//! piece of output is a chunk (log probabilities' text offsets counted from the text sent), the
//! end is the finish chunk, the usage chunk when asked, and `data: [DONE]`.

use bytes::Bytes;
use serde_json::Value;

use super::reply::{Kind, Reply};
use crate::serve::http::Translate;
use crate::serve::job::{Event, Piece};

/// OpenAI's chunks of one generation.
pub struct ChatStream {
    reply: Reply,
    /// Bytes of completion text sent (log probabilities' text offsets count from it).
    sent: usize,
}

impl ChatStream {
    /// The chunks of a generation answered as `reply`.
    pub fn new(reply: Reply) -> ChatStream {
        ChatStream { reply, sent: 0 }
    }
}

impl Translate for ChatStream {
    fn opening(&mut self) -> Vec<Value> {
        if self.reply.kind == Kind::Chat {
            vec![self.reply.role_chunk()]
        } else {
            Vec::new()
        }
    }

    fn event(&mut self, e: Event) -> Vec<Value> {
        match e {
            Event::Output { piece, logprobs } => {
                let chunk = self.reply.chunk(&piece, &logprobs, self.sent);
                if let Piece::Text(t) = &piece {
                    self.sent += t.len();
                }
                vec![chunk]
            }
            Event::Done { finish, usage, .. } => std::iter::once(self.reply.finish_chunk(finish))
                .chain(self.reply.include_usage.then(|| self.reply.usage_chunk(&usage)))
                .collect(),
            Event::Failed(e) => vec![e.body_json()],
            Event::Started { .. } => Vec::new(),
        }
    }

    fn frames(&self, values: &[Value]) -> Bytes {
        Bytes::from(values.iter().map(|v| format!("data: {v}\n\n")).collect::<String>())
    }

    fn closing(&self) -> &'static str {
        "data: [DONE]\n\n"
    }
}
