//! The engine thread: loads the model once, then runs queued generation requests one at a time.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use ggml_sys::{ChatInputs, ChatParser, ChatPrompt, ChatTemplates, GrammarKind, Model, ParsedMessage, Token};

use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, GenerationRequest, PromptBound, PromptInput};
use super::chat::{MessageDelta, MessageStream};
use super::logprobs::TokenLogprob;
use super::heat::{self, ModelIdentity};
use super::metrics::GenerationCounts;
use super::text::ResponseText;
use super::Shared;
use crate::board::resolve::Sourced;
use crate::budget::{self, PlanRequest};
use crate::generate::{Chosen, GenerateError, Sampler};
use crate::stream::{self, ExpertIndex, StreamConfig, StreamedSession};

/// Context length when `--ctx` is not given (or the model's, if shorter).
pub const DEFAULT_CTX: u32 = 4096;
/// How long the engine waits for a request before it reports that it is alive.
const IDLE_BEAT: Duration = Duration::from_millis(250);

/// What the engine serves, and how.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The model's first file.
    pub model: PathBuf,
    /// Streaming settings (the cache size is set from the memory plan).
    pub stream: StreamConfig,
    /// A fixed expert cache in bytes; `None`: what the budget leaves.
    pub cache_bytes: Option<u64>,
    /// Compute threads.
    pub threads: ggml_sys::Threads,
    /// The memory budget.
    pub budget: Sourced<u64>,
    /// Context positions shared by prompt and completion; `None`: [`DEFAULT_CTX`] or the
    /// model's own length if shorter.
    pub ctx: Option<u32>,
    /// Where the heat map is kept; `None`: no warm restarts.
    pub state_dir: Option<PathBuf>,
    /// How often the heat map is saved while serving.
    pub save_every: Duration,
    /// N-gram drafting: the most tokens drafted per decode (`None`: off).
    pub draft: Option<usize>,
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
        /// Prompt tokens.
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
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// A chat's whole answer, parsed.
        message: Option<ParsedMessage>,
    },
    /// The request failed.
    Failed(ApiError),
}

/// A queued generation request.
#[derive(Debug)]
pub struct Job {
    /// What to generate.
    pub request: GenerationRequest,
    /// Where the events go.
    pub events: UnboundedSender<Event>,
    /// Set when the client goes away (or the server stops): the generation ends at the next
    /// graph node.
    pub cancel: Arc<AtomicBool>,
}

/// Loads the model, reports ready, and serves `jobs` until every sender is gone; saves the heat
/// map at the end. Errors are load failures.
pub fn run(cfg: EngineConfig, shared: &Shared, jobs: Receiver<Job>) -> Result<()> {
    shared.loading_step("indexing the model's experts");
    let index = Arc::new(ExpertIndex::open(&cfg.model)?);
    let mut config = cfg.stream.clone();
    shared.loading_step("loading the model's metadata and vocabulary");
    let model = Arc::new(stream::load_streamed_model(&cfg.model, &index, config.dense, config.gpu_layers)?);
    // A --ctx beyond the model's own length is refused by the plan (BudgetError::ContextTooLong).
    let n_ctx = cfg.ctx.unwrap_or_else(|| model.n_ctx_train().min(DEFAULT_CTX));
    shared.set_prompt_bound(PromptBound { n_ctx, max_token_bytes: model.max_token_bytes() });
    shared.loading_step("planning memory");
    let ledger = budget::plan_within_budget(&PlanRequest {
        model: &cfg.model,
        index: &index,
        positions: n_ctx,
        dense: config.dense,
        cache_bytes: cfg.cache_bytes,
        budget: cfg.budget.clone(),
    })?;
    log::info!("{}", ledger.describe());
    shared.metrics.set_ledger(&ledger);
    config.cache_bytes = ledger.cache_bytes();
    shared.loading_step("reading dense weights and warming up");
    let mut session = StreamedSession::open(&model, Arc::clone(&index), &config, n_ctx, &cfg.threads)?;
    session.set_draft(cfg.draft);
    let identity = ModelIdentity::of(&index);
    let heat_path = cfg.state_dir.as_deref().map(heat::path_in);
    let tokenizer = Tokenizer::start(Arc::clone(&model))?;
    let mut engine = Engine { tokenizer, session, shared, n_ctx, identity, heat_path, heat_dirty: false };
    engine.warm_start(&index);
    shared.set_ready(&format!(
        "ready: {} ({} positions, expert cache {} MiB of {} MiB)",
        cfg.model.display(),
        n_ctx,
        config.cache_bytes.min(index.all_expert_window_bytes()) >> 20,
        index.all_expert_window_bytes() >> 20
    ));
    let mut last_save = Instant::now();
    loop {
        shared.beat();
        match jobs.recv_timeout(IDLE_BEAT) {
            Ok(job) => engine.handle(job),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if last_save.elapsed() >= cfg.save_every {
            engine.save_heat();
            last_save = Instant::now();
        }
    }
    engine.save_heat();
    Ok(())
}

/// A prompt ready to generate from.
struct Prepared {
    /// Its tokens.
    tokens: Vec<Token>,
    /// For a chat: how the template wants the answer generated and parsed.
    chat: Option<ChatSetup>,
}

/// What a chat template asks of its answer's generation.
struct ChatSetup {
    prompt: ChatPrompt,
    parser: ChatParser,
    grammar_kind: GrammarKind,
    /// The special tokens whose text the parser needs (the template's preserved tokens).
    shown: Vec<Token>,
}

/// A prompt to prepare, and where the result goes.
type TokenizeJob = (PromptInput, Sender<Result<Prepared, ApiError>>);

/// Renders chat prompts and tokenizes prompts on a thread of its own, so that the engine keeps
/// beating and notices a cancelled request or a stop while a long prompt is tokenized
/// (llama.cpp's tokenizer cannot be interrupted). A prompt abandoned that way finishes in the
/// background.
struct Tokenizer {
    jobs: Sender<TokenizeJob>,
}

/// Why a prompt has no tokens.
enum TokenizeError {
    /// The prompt cannot be rendered or tokenized.
    Invalid(ApiError),
    /// The request was cancelled, or the server is stopping, while it was tokenized.
    Interrupted,
}

/// The model's chat templates; ChatML (llama.cpp's default) when they cannot be parsed.
fn chat_templates(model: &Model) -> Result<ChatTemplates> {
    match ChatTemplates::of_model(model) {
        Ok(t) => Ok(t),
        Err(e) => {
            log::warn!(
                "the chat template in {} cannot be used ({e}); chats are formatted as ChatML",
                model.path().display()
            );
            Ok(ChatTemplates::from_source(Some(model), "chatml", "", "")?)
        }
    }
}

/// Renders `inputs` with the model's template and tokenizes the prompt.
fn prepare_chat(model: &Model, templates: &ChatTemplates, inputs: &ChatInputs) -> Result<Prepared, ApiError> {
    if inputs.tools.is_some() && !templates.supports_tool_calls() {
        return Err(ApiError::invalid(
            "tools: this model's chat template has no tool calls (its model was not taught a tool-call format); leave tools out",
            Some("tools"),
        ));
    }
    let (prompt, parser) = templates.apply(inputs).map_err(|e| {
        let text = e.to_string();
        let param = if inputs.json_schema.is_some() && text.contains("schema") { "response_format" } else { "messages" };
        ApiError::invalid(format!("the model's chat template cannot take this request: {text}"), Some(param))
    })?;
    log::debug!("chat prompt rendered in llama.cpp's {} format", prompt.format);
    let tokens = model
        .tokenize_with(&prompt.prompt, true, true)
        .map_err(|e| ApiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some("messages")))?;
    let shown = prompt
        .preserved_tokens
        .iter()
        .filter_map(|t| match model.tokenize_with(t, false, true).as_deref() {
            Ok([one]) => Some(*one),
            _ => None,
        })
        .collect();
    let grammar_kind = if inputs.json_schema.is_some() && inputs.tools.is_none() {
        GrammarKind::Output
    } else {
        GrammarKind::Tools
    };
    Ok(Prepared { tokens, chat: Some(ChatSetup { prompt, parser, grammar_kind, shown }) })
}

impl Tokenizer {
    /// Starts the tokenizer thread for `model` (with its own chat templates).
    fn start(model: Arc<Model>) -> Result<Tokenizer> {
        let (jobs, rx) = channel::<TokenizeJob>();
        let templates = chat_templates(&model)?;
        std::thread::Builder::new().name("sluice-tokenize".into()).spawn(move || {
            for (prompt, reply) in rx {
                let t0 = Instant::now();
                let prepared = match &prompt {
                    PromptInput::Text(t) => model
                        .tokenize(t, true)
                        .map(|tokens| Prepared { tokens, chat: None })
                        .map_err(|e| ApiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some("prompt"))),
                    PromptInput::Chat(inputs) => prepare_chat(&model, &templates, inputs),
                };
                if let Ok(p) = &prepared {
                    log::debug!("prompt prepared: {} tokens in {:.3} s", p.tokens.len(), t0.elapsed().as_secs_f64());
                }
                let _ = reply.send(prepared);
            }
        })?;
        Ok(Tokenizer { jobs })
    }

    /// The prompt, prepared. While it is computed the engine beats, and gives up when `cancel`
    /// is set or the server cancels everything.
    fn tokenize(&self, prompt: PromptInput, shared: &Shared, cancel: &AtomicBool) -> Result<Prepared, TokenizeError> {
        let (reply, prepared) = channel();
        let gone = || TokenizeError::Invalid(ApiError::new(500, "server_error", "the tokenizer thread stopped"));
        self.jobs.send((prompt, reply)).map_err(|_| gone())?;
        loop {
            match prepared.recv_timeout(IDLE_BEAT) {
                Ok(t) => return t.map_err(TokenizeError::Invalid),
                Err(RecvTimeoutError::Timeout) => {
                    shared.beat();
                    if cancel.load(Ordering::Relaxed) || shared.cancelling() {
                        return Err(TokenizeError::Interrupted);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(gone()),
            }
        }
    }
}

/// The loaded model and its session.
struct Engine<'m, 's> {
    tokenizer: Tokenizer,
    session: StreamedSession<'m>,
    shared: &'s Shared,
    n_ctx: u32,
    identity: ModelIdentity,
    heat_path: Option<PathBuf>,
    heat_dirty: bool,
}

impl Engine<'_, '_> {
    /// Reads the saved heat map (if any) and fills the cache with its hottest experts.
    fn warm_start(&mut self, index: &ExpertIndex) {
        let Some(path) = &self.heat_path else { return };
        let counts = match heat::load(path, &self.identity) {
            Ok(Some(c)) => c,
            Ok(None) => {
                log::info!("no heat map at {}: the cache starts cold", path.display());
                return;
            }
            Err(e) => {
                log::warn!("{e}");
                return;
            }
        };
        self.shared.loading_step("pre-filling the expert cache from the saved heat map");
        let order = heat::warm_order(&counts, index.n_expert);
        let mut streamer = self.session.streamer();
        streamer.add_heat(&counts);
        match streamer.prefill(&order) {
            Ok(p) => {
                log::info!(
                    "warm start: {} experts ({:.1} MiB) read from the heat map at {}",
                    p.experts,
                    p.bytes as f64 / (1 << 20) as f64,
                    path.display()
                );
                self.shared.metrics.warm_start(p.bytes);
            }
            Err(e) => log::warn!("warm start stopped: {e}; serving with what was read"),
        }
    }

    /// Saves the heat map if it changed.
    fn save_heat(&mut self) {
        let Some(path) = &self.heat_path else { return };
        if !self.heat_dirty {
            return;
        }
        let counts = self.session.streamer().heat().to_vec();
        match heat::save(path, &self.identity, &counts) {
            Ok(()) => {
                self.heat_dirty = false;
                log::info!("heat map saved to {}", path.display());
            }
            Err(e) => log::warn!("cannot save the heat map: {e}"),
        }
    }

    /// Runs one request, sending its events.
    fn handle(&mut self, job: Job) {
        let Job { request, events, cancel } = job;
        self.shared.dequeued();
        if cancel.load(Ordering::Relaxed) {
            self.shared.metrics.cancelled();
            return;
        }
        if self.shared.cancelling() {
            let _ = events.send(Event::Failed(ApiError::new(503, "server_error", "the server is shutting down")));
            return;
        }
        let prompt = match self.tokenizer.tokenize(request.prompt.clone(), self.shared, &cancel) {
            Ok(p) => p,
            Err(TokenizeError::Invalid(e)) => {
                let _ = events.send(Event::Failed(e));
                return;
            }
            Err(TokenizeError::Interrupted) => {
                self.shared.metrics.cancelled();
                log::info!("a prompt's tokenization was abandoned: its client went away or the server is stopping");
                let _ = events.send(Event::Failed(ApiError::new(503, "server_error", "the generation was cancelled")));
                return;
            }
        };
        let tokens = &prompt.tokens;
        let room = (self.n_ctx as usize).saturating_sub(tokens.len());
        let max_tokens = request.max_tokens.map_or(room, |m| m as usize);
        if max_tokens == 0 || tokens.len() + max_tokens > self.n_ctx as usize {
            let param = if request.max_tokens.is_some() { "max_tokens" } else { "messages" };
            let e = ApiError::invalid(
                format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion). Please reduce the prompt or max_tokens.",
                    self.n_ctx,
                    tokens.len() + max_tokens.max(1),
                    tokens.len(),
                    max_tokens.max(1)
                ),
                Some(param),
            )
            .with_code("context_length_exceeded");
            let _ = events.send(Event::Failed(e));
            return;
        }
        let (mut sampler, mut output) = match Output::new(self.session.model(), &request, prompt.chat) {
            Ok(o) => o,
            Err(e) => {
                let _ = events.send(Event::Failed(e));
                return;
            }
        };
        let _ = events.send(Event::Started { prompt_tokens: tokens.len() });
        self.shared.set_current(Some(Arc::clone(&cancel)));
        self.session.set_abort_flag(Some(Arc::clone(&cancel)));
        let shared = self.shared;
        let model = self.session.model();
        let result = self.session.generate_with(
            tokens,
            max_tokens as u32,
            &mut sampler,
            |chosen| {
                let event = output.take(model, chosen, request.logprobs);
                if let Some(e) = event {
                    if events.send(e).is_err() {
                        cancel.store(true, Ordering::Relaxed);
                        return ControlFlow::Break(());
                    }
                }
                if output.text.stopped() {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            },
            |row| {
                shared.beat();
                shared.metrics.decode_row(row);
            },
        );
        self.session.set_abort_flag(None);
        self.shared.set_current(None);
        self.heat_dirty = true;
        match result {
            Ok((g, _)) => {
                let (last, message) = output.finish();
                if let Some(e) = last {
                    let _ = events.send(e);
                }
                self.shared.metrics.generation(GenerationCounts {
                    prompt_tokens: tokens.len() as u64,
                    completion_tokens: g.tokens.len() as u64,
                    decode: g.decode,
                    decoded: u64::from(g.decoded),
                });
                if cancel.load(Ordering::Relaxed) {
                    self.shared.metrics.cancelled();
                    return;
                }
                let finish = if !(output.text.stopped() || g.stopped_at_eog) {
                    Finish::Length
                } else if message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()) {
                    Finish::ToolCalls
                } else {
                    Finish::Stop
                };
                let _ = events.send(Event::Done {
                    finish,
                    prompt_tokens: tokens.len(),
                    completion_tokens: g.tokens.len(),
                    message,
                });
            }
            Err(GenerateError::Cancelled) => {
                self.shared.metrics.cancelled();
                log::info!("generation cancelled after its client went away or the server began stopping");
                let _ = events.send(Event::Failed(ApiError::new(503, "server_error", "the generation was cancelled")));
            }
            Err(e) => {
                log::error!("generation failed: {e}");
                let _ =
                    events.send(Event::Failed(ApiError::new(500, "server_error", format!("generation failed: {e}"))));
            }
        }
    }
}

/// A prefix for the ids of one answer's tool calls that no other answer of this server uses.
fn tool_call_prefix() -> String {
    static ANSWERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("call_{:x}{:04x}", t.as_secs(), ANSWERS.fetch_add(1, Ordering::Relaxed))
}

/// One generation's output: its text (stops, UTF-8), a chat's parsed message, and the log
/// probabilities not sent yet.
struct Output {
    text: ResponseText,
    message: Option<MessageStream>,
    logprobs: Vec<TokenLogprob>,
}

impl Output {
    /// The sampler and output of `request`, with a chat template's grammar, stops and parser.
    /// A grammar llama.cpp cannot enforce is a 400.
    fn new(model: &Model, request: &GenerationRequest, chat: Option<ChatSetup>) -> Result<(Sampler, Output), ApiError> {
        let mut params = request.sampling.clone();
        let mut stops = request.stop.clone();
        let mut shown = Vec::new();
        let mut message = None;
        if let Some(c) = chat {
            params.grammar = c.prompt.grammar;
            params.grammar_kind = c.grammar_kind;
            params.grammar_lazy = c.prompt.grammar_lazy;
            params.grammar_triggers = c.prompt.grammar_triggers;
            params.generation_prompt = c.prompt.generation_prompt;
            params.thinking_start_tag = c.prompt.thinking_start_tag;
            params.thinking_end_tags = c.prompt.thinking_end_tags;
            stops.extend(c.prompt.additional_stops);
            shown = c.shown;
            message = Some(MessageStream::new(c.parser, &tool_call_prefix()));
        }
        let mut sampler = Sampler::new(model, &params).map_err(|e| {
            let text = e.to_string();
            match params.grammar_kind {
                _ if text.contains("logit_bias") => ApiError::invalid(text, Some("logit_bias")),
                GrammarKind::Output => ApiError::invalid(format!("the answer's grammar cannot be enforced: {e}"), Some("response_format")),
                _ => ApiError::invalid(format!("the answer's grammar cannot be enforced: {e}"), Some("tools")),
            }
        })?;
        sampler.show_special(shown);
        Ok((sampler, Output { text: ResponseText::new(&stops), message, logprobs: Vec::new() }))
    }

    /// Takes a chosen token; returns the event to send, if there is news.
    fn take(&mut self, model: &Model, chosen: &Chosen<'_>, logprobs: Option<usize>) -> Option<Event> {
        if let Some(top) = logprobs {
            self.logprobs.push(TokenLogprob::of(model, chosen.token, chosen.piece, chosen.logits, top));
        }
        let text = self.text.push(chosen.piece);
        let piece = match &mut self.message {
            None => Piece::Text(text),
            Some(m) => match m.push(&text) {
                Ok(d) => Piece::Delta(d),
                Err(e) => {
                    log::debug!("partial chat output not parsed yet: {e}");
                    Piece::Delta(MessageDelta::default())
                }
            },
        };
        self.event(piece)
    }

    /// The last event (text held back until the end) and a chat's whole message.
    fn finish(&mut self) -> (Option<Event>, Option<ParsedMessage>) {
        let rest = self.text.finish();
        let Some(m) = &mut self.message else {
            return (self.event(Piece::Text(rest)), None);
        };
        let (delta, message) = match m.finish(&rest) {
            Ok((delta, message)) => (delta, message),
            Err(e) => {
                log::warn!("the answer does not parse as the chat format says ({e}); it is returned as plain content");
                (MessageDelta::default(), ParsedMessage { content: m.text().to_string(), ..ParsedMessage::default() })
            }
        };
        (self.event(Piece::Delta(delta)), Some(message))
    }

    fn event(&mut self, piece: Piece) -> Option<Event> {
        let empty = match &piece {
            Piece::Text(t) => t.is_empty(),
            Piece::Delta(d) => d.is_empty(),
        };
        if empty && self.logprobs.is_empty() {
            return None;
        }
        Some(Event::Output { piece, logprobs: std::mem::take(&mut self.logprobs) })
    }
}
