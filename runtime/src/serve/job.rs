//! The engine's contract with the HTTP front: a checked [`GenerationRequest`] (within the
//! [`PromptBound`]) queued as a [`Job`], and the [`Event`]s it answers with over a channel whose
//! unread bytes are bounded.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ggml_sys::{ChatInputs, ParsedMessage, SamplerParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::deltas::MessageDelta;
use super::error::ApiError;
use super::logprobs::TokenLogprob;

/// What a generation request asks for, checked.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Tokens to generate at most; `None`: what the context leaves.
    pub max_tokens: Option<u32>,
    /// How tokens are chosen (a chat's grammar is added when its template is applied).
    pub sampling: SamplerParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Server-sent events.
    pub stream: bool,
    /// Whether a streamed response ends with a usage chunk.
    pub include_usage: bool,
    /// Log probabilities of the chosen tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
    /// Whether the prompt may reuse the memory a slot holds of the same first tokens.
    pub cache_prompt: bool,
    /// Whose request it is: a slot's memory is reused only for the client that wrote it.
    pub owner: Owner,
    /// How a prompt over the context is cut to fit (Ollama's API); `None`: it is refused.
    pub truncate: Option<Truncation>,
    /// Whether the model is unloaded once this request ends and none other runs or waits
    /// (Ollama's `keep_alive: 0`).
    pub unload_after: bool,
    /// The model it runs on, when it named one the server has (the one loaded, or another stored
    /// model it loads first); `None`: whichever is loaded.
    pub model: Option<crate::serve::shelf::ModelChoice>,
}

/// How a prompt over the context is cut to fit, as Ollama cuts it: the oldest messages go (the
/// system's stay, and the last one), then, when the prompt is still too long, the tokens after
/// its first `keep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// The context the prompt and its answer must fit (`num_ctx`, at most the server's).
    pub context: u32,
    /// The tokens at the prompt's start that are never cut (`num_keep`).
    pub keep: u32,
}

/// The client a request comes from, as reuse is scoped: its named key (`--api-keys-file`), else
/// its address. What one client's prompts left in a slot (or a saved slot) is reused for that
/// client alone, so no client can learn another's prompt from what is reused (the counts in
/// `usage`, the time to the first token).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Owner(pub String);

impl Owner {
    /// The owner of a request authorized with the named key `key`, else from `address`.
    pub fn of(key: Option<&str>, address: Option<std::net::IpAddr>) -> Owner {
        match (key, address) {
            (Some(name), _) => Owner(format!("key {name}")),
            (None, Some(ip)) => Owner(format!("address {ip}")),
            (None, None) => Owner::default(),
        }
    }
}

/// The prompt of a request.
#[derive(Debug, Clone)]
pub enum PromptInput {
    /// Completion text, tokenized as is (with BOS).
    Text(String),
    /// Chat messages and options, for the model's template.
    Chat(Box<ChatInputs>),
}

/// The most bytes of text a prompt can have and still fit the context: every token stands for
/// at most `max_token_bytes` bytes, so a longer text needs more than `n_ctx` tokens. A prompt
/// over it is refused before it is tokenized (tokenizing megabytes takes long).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptBound {
    /// Context positions; 0 until the model is loaded (no bound).
    pub n_ctx: u32,
    /// The longest text any token stands for, in bytes.
    pub max_token_bytes: usize,
}

impl PromptBound {
    /// The bound in bytes, if known.
    pub fn bytes(&self) -> Option<usize> {
        (self.n_ctx > 0).then(|| (self.n_ctx as usize).saturating_mul(self.max_token_bytes.max(1)))
    }

    /// 400 `context_length_exceeded` when `request`'s prompt text is over the bound.
    pub fn check(&self, request: &GenerationRequest) -> Result<(), ApiError> {
        let Some(limit) = self.bytes() else { return Ok(()) };
        if request.truncate.is_some() {
            // It is cut to fit (its size is the body limit's).
            return Ok(());
        }
        let (bytes, param) = match &request.prompt {
            PromptInput::Text(t) => (t.len(), "prompt"),
            // Tools and schemas are rendered into the prompt or its grammar: they count too.
            PromptInput::Chat(c) => {
                let text = |v: &Option<serde_json::Value>| v.as_ref().map_or(0, |v| v.to_string().len());
                (c.messages.to_string().len() + text(&c.tools) + text(&c.json_schema), "messages")
            }
        };
        if bytes <= limit {
            return Ok(());
        }
        Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {} tokens. However, your prompt of {bytes} bytes needs more than that (no token of this model stands for more than {} bytes). Please reduce the prompt.",
                self.n_ctx, self.max_token_bytes
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"))
    }
}

impl PromptBound {
    /// 400 `context_length_exceeded` when the chat template rendered the request into a prompt
    /// of more than the bound's bytes: refused before the tokenizer spends seconds on it.
    pub fn check_rendered(&self, bytes: usize) -> Result<(), ApiError> {
        match self.bytes() {
            Some(limit) if bytes > limit => Err(ApiError::invalid(
                format!(
                    "This model's maximum context length is {} tokens. However, the model's chat template rendered this request into a prompt of {bytes} bytes, which needs more than that (no token of this model stands for more than {} bytes). Please reduce the messages.",
                    self.n_ctx, self.max_token_bytes
                ),
                Some("messages"),
            )
            .with_code("context_length_exceeded")),
            _ => Ok(()),
        }
    }
}

/// A generation's token counts, as OpenAI's `usage` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenUsage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Prompt tokens whose memory a slot already held (`prompt_tokens_details.cached_tokens`).
    pub cached: usize,
    /// Generated tokens.
    pub completion: usize,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The answer calls tools.
    ToolCalls,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// Output that is final.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Completion text.
    Text(String),
    /// What a chat answer gained.
    Delta(MessageDelta),
}

/// What the engine tells the request's handler, in order: `Started`, any `Output`, then `Done`;
/// or `Failed` at any point.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt fits and generation begins.
    Started {
        /// The prompt's tokens.
        prompt_tokens: usize,
    },
    /// Output that is final, and the log probabilities of the tokens behind it (when asked).
    Output {
        /// The text or message delta.
        piece: Piece,
        /// Chosen tokens not reported before.
        logprobs: Vec<TokenLogprob>,
    },
    /// The generation ended.
    Done {
        /// Why.
        finish: Finish,
        /// What it counted.
        usage: TokenUsage,
        /// A chat's whole answer, parsed.
        message: Option<ParsedMessage>,
        /// The stop sequence that ended the text, if one did (the request's, or the template's).
        stop_sequence: Option<String>,
    },
    /// The request failed.
    Failed(ApiError),
}

impl Event {
    /// About how many bytes the event holds until its client reads it.
    fn weight(&self) -> usize {
        const OVERHEAD: usize = 64;
        match self {
            Event::Output { piece, logprobs } => {
                let text = match piece {
                    Piece::Text(t) => t.len(),
                    Piece::Delta(d) => {
                        d.content.len()
                            + d.reasoning.len()
                            + d.tool_calls.iter().map(|c| c.arguments.len() + OVERHEAD).sum::<usize>()
                    }
                };
                OVERHEAD + text + logprobs.iter().map(TokenLogprob::weight).sum::<usize>()
            }
            _ => OVERHEAD,
        }
    }
}

/// The most output a client may leave unread before its generation is cancelled: the events
/// wait in memory until the connection takes them, so a client that stops reading must not make
/// the server keep a whole answer for it.
pub const MAX_UNREAD_BYTES: usize = 1 << 20;

/// Why an event was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsent {
    /// The request's handler is gone (its client left).
    Gone,
    /// The client left more than [`MAX_UNREAD_BYTES`] unread.
    Unread,
}

/// Where a job's events go: a channel whose unread bytes are counted.
#[derive(Debug)]
pub struct EventSender {
    tx: UnboundedSender<Event>,
    unread: Arc<AtomicUsize>,
}

/// The request handler's end of a job's events.
#[derive(Debug)]
pub struct EventReceiver {
    rx: UnboundedReceiver<Event>,
    unread: Arc<AtomicUsize>,
}

/// A job's event channel.
pub fn event_channel() -> (EventSender, EventReceiver) {
    let (tx, rx) = unbounded_channel();
    let unread = Arc::new(AtomicUsize::new(0));
    (EventSender { tx, unread: Arc::clone(&unread) }, EventReceiver { rx, unread })
}

impl EventSender {
    /// Sends `event`, unless the handler is gone or its client has left too much unread.
    pub fn send(&self, event: Event) -> Result<(), Unsent> {
        let weight = event.weight();
        if self.unread.load(Ordering::Relaxed) + weight > MAX_UNREAD_BYTES {
            return Err(Unsent::Unread);
        }
        self.unread.fetch_add(weight, Ordering::Relaxed);
        self.tx.send(event).map_err(|_| Unsent::Gone)
    }
}

impl EventReceiver {
    /// The next event; `None` when the engine dropped the job.
    pub async fn recv(&mut self) -> Option<Event> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Polls for the next event.
    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Event>> {
        self.rx.poll_recv(cx).map(|e| {
            // Every event was counted before it was sent, so this never goes below zero.
            if let Some(e) = &e {
                self.unread.fetch_sub(e.weight(), Ordering::Relaxed);
            }
            e
        })
    }
}

/// A queued generation request.
#[derive(Debug)]
pub struct Job {
    /// What to generate.
    pub request: GenerationRequest,
    /// Where the events go.
    pub events: EventSender,
    /// Set when the client goes away (or the server stops): the generation ends at the next
    /// graph node.
    pub cancel: Arc<AtomicBool>,
    /// Its place among the requests the server admitted, given back when the job is dropped.
    pub admission: Admission,
}

/// A request's place among those admitted (running or waiting): taken while fewer than the limit
/// are held, given back on drop, however the job ends.
#[derive(Debug)]
pub struct Admission(Arc<AtomicUsize>);

impl Admission {
    /// A place, unless `limit` are held.
    pub fn take(held: &Arc<AtomicUsize>, limit: usize) -> Option<Admission> {
        held.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < limit).then_some(n + 1))
            .ok()
            .map(|_| Admission(Arc::clone(held)))
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_that_leaves_its_answer_unread_is_cut_off_at_the_bound() {
        let (tx, mut rx) = event_channel();
        let piece = || Event::Output { piece: Piece::Text("x".repeat(1000)), logprobs: Vec::new() };
        let mut sent = 0;
        let why = loop {
            match tx.send(piece()) {
                Ok(()) => sent += 1,
                Err(why) => break why,
            }
            assert!(sent < 10_000, "never bounded");
        };
        assert_eq!(why, Unsent::Unread);
        assert!(sent * 1000 <= MAX_UNREAD_BYTES && (sent + 2) * 1064 > MAX_UNREAD_BYTES, "{sent} events");
        // What the client reads makes room again.
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(matches!(rx.poll_recv(&mut cx), std::task::Poll::Ready(Some(Event::Output { .. }))));
        assert_eq!(tx.send(piece()), Ok(()));
        let (tx, rx) = event_channel();
        drop(rx);
        assert_eq!(tx.send(Event::Started { prompt_tokens: 1 }), Err(Unsent::Gone));
    }
}
