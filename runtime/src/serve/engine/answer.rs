//! One generation's answer as the client gets it: its sampler (with a chat template's grammar),
//! its text (stop sequences, whole UTF-8 characters), a chat's message parsed as it grows, and the
//! log probabilities not sent yet.

use std::sync::atomic::Ordering;

use ggml_sys::{GrammarKind, Model, ParsedMessage, SamplerParams};

use super::prompt::ChatSetup;
use crate::generate::{Chosen, Sampler};
use crate::serve::deltas::{MessageDelta, MessageStream};
use crate::serve::error::ApiError;
use crate::serve::job::{Event, Piece};
use crate::serve::logprobs::TokenLogprob;
use crate::serve::text::ResponseText;

/// A prefix for the ids of one answer's tool calls that no other answer of this server uses.
fn tool_call_prefix() -> String {
    static ANSWERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("call_{:x}{:04x}", t.as_secs(), ANSWERS.fetch_add(1, Ordering::Relaxed))
}

/// One generation's answer: its text (stops, UTF-8), a chat's parsed message, and the log
/// probabilities not sent yet.
pub(super) struct Answer {
    text: ResponseText,
    message: Option<MessageStream>,
    logprobs: Vec<TokenLogprob>,
    /// The request field the grammar comes from.
    grammar_param: &'static str,
}

impl Answer {
    /// The sampler and answer of a request's `params` and `stops`, with a chat template's
    /// grammar, stops and parser. A grammar llama.cpp cannot enforce, or a biased token outside
    /// the vocabulary, is a 400.
    pub(super) fn new(
        model: &Model,
        mut params: SamplerParams,
        mut stops: Vec<String>,
        chat: Option<ChatSetup>,
    ) -> Result<(Sampler, Answer), ApiError> {
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
        let grammar_param = if params.grammar_kind == GrammarKind::Output { "response_format" } else { "tools" };
        let mut sampler = Sampler::new(model, &params).map_err(|e| {
            let e = e.to_string();
            if e.contains("logit_bias") {
                return ApiError::invalid(e, Some("logit_bias"));
            }
            ApiError::invalid(format!("the answer's grammar cannot be enforced: {e}"), Some(grammar_param))
        })?;
        sampler.show_special(shown);
        Ok((sampler, Answer { text: ResponseText::new(&stops), message, logprobs: Vec::new(), grammar_param }))
    }

    /// The request field the answer's grammar comes from (`response_format` or `tools`).
    pub(super) fn grammar_param(&self) -> &'static str {
        self.grammar_param
    }

    /// Takes a chosen token; returns the event to send, if there is news.
    pub(super) fn take(&mut self, model: &Model, chosen: &Chosen<'_>, logprobs: Option<usize>) -> Option<Event> {
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
    pub(super) fn finish(&mut self) -> (Option<Event>, Option<ParsedMessage>) {
        let rest = self.text.finish();
        let Some(m) = &mut self.message else {
            return (self.event(Piece::Text(rest)), None);
        };
        log::trace!("the chat answer as generated: {:?}{rest:?}", m.text());
        let (delta, message) = m.finish(&rest);
        (self.event(Piece::Delta(delta)), Some(message))
    }

    /// Whether a stop sequence ended the text.
    pub(super) fn stopped(&self) -> bool {
        self.text.stopped().is_some()
    }

    /// The stop sequence that ended the text, if one did.
    pub(super) fn stop_sequence(&self) -> Option<&str> {
        self.text.stopped()
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
