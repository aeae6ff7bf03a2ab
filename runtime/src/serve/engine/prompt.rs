//! Prompts made ready on a thread of their own: completion text tokenized, chat messages rendered
//! by the model's Jinja template (with the grammar, stops and parser the template's family
//! wants for the answer) and then tokenized.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use ggml_sys::{ChatInputs, ChatParser, ChatPrompt, ChatTemplates, GrammarKind, Model, Token};

use super::message_text::{self, ControlTexts};
use super::questions::answer;
use crate::serve::error::ApiError;
use crate::serve::job::{PromptBound, PromptInput};
use crate::serve::messages::{TextTools, ToolJob};
use crate::serve::shared::{Shared, IDLE_BEAT};

/// A prompt ready to generate from.
pub(super) struct Prepared {
    /// Its tokens.
    pub(super) tokens: Vec<Token>,
    /// For a chat: how the template wants the answer generated and parsed.
    pub(super) chat: Option<ChatSetup>,
}

/// What a chat template asks of its answer's generation.
pub(super) struct ChatSetup {
    /// The rendered prompt, with its grammar, stops and thinking tags.
    pub(super) prompt: ChatPrompt,
    /// The parser of the answer.
    pub(super) parser: ChatParser,
    /// Where the grammar comes from.
    pub(super) grammar_kind: GrammarKind,
    /// The special tokens whose text the parser needs (the template's preserved tokens).
    pub(super) shown: Vec<Token>,
}

/// The stack of the thread that renders templates, converts schemas to grammars and tokenizes:
/// llama.cpp recurses there as deep as a schema's nesting and an object's optional properties
/// (bounded by [`crate::serve::limits`]) and a template's calls. Only the pages touched are
/// committed.
const PREPARE_STACK: usize = 64 << 20;

/// A prompt to prepare, the flag that abandons it, and where the result goes.
type TokenizeJob = (PromptInput, PromptBound, Arc<AtomicBool>, Sender<Result<Prepared, ApiError>>);

/// What the thread takes: the engine's prompts, and the HTTP front's text questions.
pub(super) enum ThreadJob {
    /// A prompt to generate from.
    Prompt(TokenizeJob),
    /// A question of [`TextTools`].
    Tool(ToolJob),
}

/// Renders chat prompts and tokenizes prompts on a thread of its own, so that the engine keeps
/// beating and notices a cancelled request or a stop while a long prompt is tokenized. A prompt
/// abandoned that way stops: llama.cpp's tokenizers check the job's flag as they go (vendor
/// patch 0011), and the thread takes the next prompt.
pub(super) struct Tokenizer {
    jobs: Sender<ThreadJob>,
    thinks: bool,
}

/// Why a prompt has no tokens.
pub(super) enum TokenizeError {
    /// The prompt cannot be rendered or tokenized.
    Invalid(ApiError),
    /// The request was cancelled, or the server is stopping, while it was tokenized.
    Interrupted,
}

/// What the trial renderings tell of a model's chat templates.
struct TemplateCaps {
    /// They render a thinking block (their format has a thinking start tag).
    thinks: bool,
    /// They take an assistant turn with several tool calls (some refuse it: "only supports
    /// single tool-calls at once"), so an answer may make several.
    parallel_calls: bool,
}

/// The description of the model at `path` without loading it (its metadata and templates
/// alone): what `/api/show` says of a stored model the server may switch to; `context` is the
/// served context, capped by the model's own.
pub fn describe(path: &std::path::Path, context: u32) -> Result<crate::serve::model_card::ModelCard> {
    let model = Model::load(path, &ggml_sys::ModelParams { metadata_only: true, ..Default::default() })?;
    let thinks = chat_templates(&model).is_ok_and(|(_, caps)| caps.thinks);
    let context = context.min(model.n_ctx_train()).max(1);
    Ok(crate::serve::model_card::ModelCard::of(&model, context, thinks))
}

/// The model's chat templates; ChatML (llama.cpp's default) when they cannot be parsed or
/// cannot render a plain conversation within the template bounds (a template that recurses or
/// loops without end would fail every request). With them, what the trial renderings tell.
fn chat_templates(model: &Model) -> Result<(ChatTemplates, TemplateCaps)> {
    let trial = ChatInputs::new(serde_json::json!([{"role": "user", "content": "hello"}]));
    let usable = ChatTemplates::of_model(model)
        .and_then(|t| t.apply(&trial).map(|(p, _)| (t, !p.thinking_start_tag.is_empty())));
    match usable {
        Ok((t, thinks)) => {
            let call = |id: &str| serde_json::json!({"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}});
            let two_calls = ChatInputs::new(serde_json::json!([
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
                {"role": "tool", "tool_call_id": "b", "content": "2"},
            ]));
            let parallel_calls = t.apply(&two_calls).is_ok();
            if !parallel_calls {
                log::info!("the chat template takes one tool call a turn: answers make one call at most");
            }
            Ok((t, TemplateCaps { thinks, parallel_calls }))
        }
        Err(e) => {
            log::warn!(
                "the chat template in {} cannot be used ({}); chats are formatted as ChatML",
                model.path().display(),
                crate::text::excerpt(&e.to_string(), 1000)
            );
            let chatml = ChatTemplates::from_source(Some(model), "chatml", "", "")?;
            Ok((chatml, TemplateCaps { thinks: false, parallel_calls: true }))
        }
    }
}

/// Tokenizes `text` (a completion prompt, or a template's rendering with `field` "messages")
/// until `abandon` is set.
fn tokenize(model: &Model, text: &str, abandon: &AtomicBool, field: &str) -> Result<Vec<Token>, ApiError> {
    model
        .tokenize_cancellable(text, true, true, abandon)
        .map_err(|e| ApiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some(field)))
}

/// Renders `inputs` with the model's template and tokenizes the prompt (until `abandon` is set),
/// the control tokens' text its messages carry as text; a rendering over `bound` is refused
/// before it is tokenized (a template can make a prompt far longer than the request).
fn prepare_chat(
    model: &Model,
    (templates, caps): (&ChatTemplates, &TemplateCaps),
    controls: &ControlTexts,
    inputs: &ChatInputs,
    bound: PromptBound,
    abandon: &AtomicBool,
) -> Result<Prepared, ApiError> {
    // Calls the template could not take back in the next turn are not made.
    let single;
    let inputs = if inputs.parallel_tool_calls && !caps.parallel_calls {
        single = ChatInputs { parallel_tool_calls: false, ..inputs.clone() };
        &single
    } else {
        inputs
    };
    let rendered = message_text::render(templates, controls, inputs).map_err(|e| {
        let text = e.to_string();
        let param =
            if inputs.json_schema.is_some() && text.contains("schema") { "response_format" } else { "messages" };
        ApiError::invalid(format!("the model's chat template cannot take this request: {text}"), Some(param))
    })?;
    let prompt = &rendered.prompt;
    log::debug!("chat prompt rendered in llama.cpp's {} format", prompt.format);
    if prompt.generic_tools {
        log::debug!("the template has no tool-call syntax: tools offered as generic JSON calls");
    }
    bound.check_rendered(prompt.prompt.len())?;
    let tokens = rendered
        .tokenize(model, abandon)
        .map_err(|e| ApiError::invalid(format!("the prompt cannot be tokenized: {e}"), Some("messages")))?;
    let message_text::Rendered { prompt, parser, .. } = rendered;
    let shown = prompt
        .preserved_tokens
        .iter()
        .filter_map(|t| match model.tokenize_with(t, false, true).as_deref() {
            Ok([one]) => Some(*one),
            _ => None,
        })
        .collect();
    let grammar_kind =
        if inputs.json_schema.is_some() && inputs.tools.is_none() { GrammarKind::Output } else { GrammarKind::Tools };
    Ok(Prepared { tokens, chat: Some(ChatSetup { prompt, parser, grammar_kind, shown }) })
}

impl Tokenizer {
    /// Starts the tokenizer thread for `model` (with its own chat templates).
    /// The templates are parsed there too (with the capability probes that render them), on
    /// its large stack and within the template bounds; this returns once they are ready.
    pub(super) fn start(model: Arc<Model>) -> Result<Tokenizer> {
        let (jobs, rx) = channel::<ThreadJob>();
        let (ready, parsed) = channel::<Result<bool>>();
        std::thread::Builder::new().name("sluice-tokenize".into()).stack_size(PREPARE_STACK).spawn(move || {
            let controls = ControlTexts::of(&model);
            let (templates, caps) = match chat_templates(&model) {
                Ok((t, caps)) => {
                    let _ = ready.send(Ok(caps.thinks));
                    (t, caps)
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            for job in rx {
                let (prompt, bound, abandon, reply) = match job {
                    ThreadJob::Prompt(p) => p,
                    ThreadJob::Tool((question, bound, reply)) => {
                        let _ = reply.send(answer(&model, &templates, &controls, question, bound));
                        continue;
                    }
                };
                let t0 = Instant::now();
                let prepared = match &prompt {
                    // Control tokens' text is parsed, as llama-server does: the client writes the whole prompt.
                    PromptInput::Text(t) => {
                        tokenize(&model, t, &abandon, "prompt").map(|tokens| Prepared { tokens, chat: None })
                    }
                    PromptInput::Chat(inputs) => {
                        prepare_chat(&model, (&templates, &caps), &controls, inputs, bound, &abandon)
                    }
                };
                match &prepared {
                    Ok(p) => {
                        log::debug!("prompt prepared: {} tokens in {:.3} s", p.tokens.len(), t0.elapsed().as_secs_f64())
                    }
                    Err(_) if abandon.load(Ordering::Relaxed) => {
                        log::info!(
                            "an abandoned prompt's tokenization stopped after {:.3} s",
                            t0.elapsed().as_secs_f64()
                        )
                    }
                    Err(_) => {}
                }
                let _ = reply.send(prepared);
            }
        })?;
        let thinks = parsed
            .recv()
            .map_err(|_| anyhow::anyhow!("the tokenizer thread stopped while parsing the chat template"))??;
        Ok(Tokenizer { jobs, thinks })
    }

    /// Whether the model's template has a thinking block.
    pub(super) fn thinks(&self) -> bool {
        self.thinks
    }

    /// A handle for the HTTP front's questions, answered on the same thread.
    pub(super) fn tools(&self) -> TextTools {
        let jobs = self.jobs.clone();
        TextTools::new(move |job| jobs.send(ThreadJob::Tool(job)).is_ok())
    }

    /// The prompt, prepared within `bound` (a rendered chat over it is refused before it is
    /// tokenized). While it is computed the engine beats, and gives up when `cancel` is set or
    /// the server cancels everything.
    pub(super) fn tokenize(
        &self,
        prompt: PromptInput,
        bound: PromptBound,
        shared: &Shared,
        cancel: &AtomicBool,
    ) -> Result<Prepared, TokenizeError> {
        let (reply, prepared) = channel();
        let gone = || TokenizeError::Invalid(ApiError::new(500, "server_error", "the tokenizer thread stopped"));
        let abandon = Arc::new(AtomicBool::new(false));
        self.jobs.send(ThreadJob::Prompt((prompt, bound, Arc::clone(&abandon), reply))).map_err(|_| gone())?;
        loop {
            match prepared.recv_timeout(IDLE_BEAT) {
                Ok(t) => return t.map_err(TokenizeError::Invalid),
                Err(RecvTimeoutError::Timeout) => {
                    shared.beat();
                    if cancel.load(Ordering::Relaxed) || shared.cancelling() {
                        abandon.store(true, Ordering::Relaxed);
                        return Err(TokenizeError::Interrupted);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(gone()),
            }
        }
    }
}
