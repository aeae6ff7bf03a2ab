//! A request's prompt against the context: tokenized and refused when it and its answer do
//! not fit, or, asked so ([`Truncation`], Ollama's way), cut to fit: the oldest messages go (the
//! system's stay, and the last one), and a prompt still too long loses the tokens after its
//! first `keep`. Ollama's clients (Home Assistant, Open WebUI) send whole conversations and
//! rely on it.

use std::sync::atomic::AtomicBool;

use ggml_sys::{ChatInputs, Token};
use serde_json::Value;

use super::answer::Answer;
use super::prompt::{Prepared, TokenizeError};
use super::Engine;
use crate::generate::Sampler;
use crate::serve::error::ApiError;
use crate::serve::job::{GenerationRequest, PromptBound, PromptInput, Truncation};

/// The positions left for the answer when a prompt is cut: `num_predict`'s tokens, at most half
/// the context; without it an eighth of the context.
fn answer_room(context: usize, asked: Option<u32>) -> usize {
    asked.map_or(context / 8, |a| (a as usize).min(context / 2)).max(1)
}

impl Engine<'_, '_> {
    /// The request's prompt tokenized and checked against the context, with its sampler and
    /// answer; else the error for its client (an abandoned tokenization counts as cancelled).
    pub(super) fn admit(
        &mut self,
        request: GenerationRequest,
        cancel: &AtomicBool,
    ) -> Result<(Vec<ggml_sys::Token>, u32, Sampler, Answer), ApiError> {
        let GenerationRequest { prompt, max_tokens: asked, sampling, stop, truncate, .. } = request;
        // A request cut to fit (Ollama's) has its own context, at most the server's.
        let n_ctx = truncate.map_or(self.n_ctx, |t| t.context.clamp(1, self.n_ctx)) as usize;
        let prepared = match truncate {
            None => self.tokenizer.tokenize(prompt, self.shared.prompt_bound(), self.shared, cancel),
            Some(t) => self.fitted(prompt, t, n_ctx, asked, cancel),
        };
        let prompt = match prepared {
            Ok(p) => p,
            Err(TokenizeError::Invalid(e)) => return Err(e),
            Err(TokenizeError::Interrupted) => {
                self.shared.metrics.cancelled();
                log::info!("a prompt's tokenization was abandoned: its client went away or the server is stopping");
                return Err(ApiError::new(503, "server_error", "the generation was cancelled"));
            }
        };
        let tokens = prompt.tokens;
        let room = n_ctx.saturating_sub(tokens.len());
        // A prompt cut to fit leaves room for an answer, which ends where the context does.
        let max_tokens = asked.map_or(room, |m| if truncate.is_some() { room.min(m as usize) } else { m as usize });
        if max_tokens == 0 || tokens.len() + max_tokens > n_ctx {
            let param = if asked.is_some() { "max_tokens" } else { "messages" };
            return Err(ApiError::invalid(
                    format!(
                        "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion). Please reduce the prompt or max_tokens.",
                        n_ctx,
                        tokens.len() + max_tokens.max(1),
                        tokens.len(),
                        max_tokens.max(1)
                    ),
                    Some(param),
                )
                .with_code("context_length_exceeded"));
        }
        let (sampler, answer) = Answer::new(self.session.model(), sampling, stop, prompt.chat)?;
        Ok((tokens, max_tokens as u32, sampler, answer))
    }

    /// `prompt` prepared to fit `context` positions less its answer's room (`asked`, the
    /// answer's tokens asked for), cut as `t` says.
    fn fitted(
        &self,
        prompt: PromptInput,
        t: Truncation,
        context: usize,
        asked: Option<u32>,
        cancel: &AtomicBool,
    ) -> Result<Prepared, TokenizeError> {
        let target = context.saturating_sub(answer_room(context, asked)).max(1);
        let bound = self.shared.prompt_bound();
        let mut prepared = match prompt {
            PromptInput::Chat(inputs) => self.fewer_messages(*inputs, target, cancel)?,
            PromptInput::Text(text) => {
                let text = tail(text, bound.bytes());
                self.tokenizer.tokenize(PromptInput::Text(text), bound, self.shared, cancel)?
            }
        };
        cut(&mut prepared.tokens, target, t.keep as usize);
        Ok(prepared)
    }

    /// The chat with the fewest of its oldest messages left out (never a system message, never
    /// the last) whose prompt has at most `target` tokens; with only the system messages and
    /// the last when none does.
    fn fewer_messages(
        &self,
        inputs: ChatInputs,
        target: usize,
        cancel: &AtomicBool,
    ) -> Result<Prepared, TokenizeError> {
        let messages = inputs.messages.as_array().cloned().unwrap_or_default();
        let droppable: Vec<usize> = (0..messages.len())
            .filter(|&i| messages[i].get("role").and_then(Value::as_str) != Some("system"))
            .collect();
        let most = droppable.len().saturating_sub(1);
        let without = |k: usize| {
            let gone = &droppable[..k]; // ascending
            let kept =
                messages.iter().enumerate().filter(|(i, _)| gone.binary_search(i).is_err()).map(|(_, m)| m.clone());
            ChatInputs { messages: Value::Array(kept.collect()), ..inputs.clone() }
        };
        let bound = self.shared.prompt_bound();
        // A rendering over the bound in bytes is refused before it is tokenized: it cannot fit.
        let fitting = |k: usize| -> Result<Option<Prepared>, TokenizeError> {
            match self.tokenizer.tokenize(PromptInput::Chat(Box::new(without(k))), bound, self.shared, cancel) {
                Ok(p) if p.tokens.len() <= target => Ok(Some(p)),
                Ok(_) | Err(TokenizeError::Invalid(_)) => Ok(None),
                Err(e) => Err(e),
            }
        };
        if let Some(p) = fitting(0)? {
            return Ok(p);
        }
        // The fewest left out, by halves: a shorter conversation renders shorter.
        let (mut low, mut high, mut best) = (1, most, None);
        while low <= high {
            let mid = (low + high) / 2;
            match fitting(mid)? {
                Some(p) => {
                    best = Some((mid, p));
                    high = mid - 1;
                }
                None => low = mid + 1,
            }
        }
        if let Some((k, p)) = best {
            log::info!(
                "truncating input messages which exceed the context: the oldest {k} of {} left out",
                messages.len()
            );
            return Ok(p);
        }
        // The last message alone is too long: its prompt is cut token by token, after its text
        // is cut to what could fit (the end of it stays), so that no more is tokenized than a
        // prompt that fits.
        let mut last = without(most);
        if let Some(m) = last.messages.as_array_mut().and_then(|all| all.last_mut()) {
            if let Some(Value::String(text)) = m.get_mut("content") {
                *text = tail(std::mem::take(text), bound.bytes());
            }
        }
        let widened = PromptBound { n_ctx: bound.n_ctx.saturating_mul(FIT_SPAN), ..bound };
        self.tokenizer.tokenize(PromptInput::Chat(Box::new(last)), widened, self.shared, cancel)
    }
}

/// How many contexts' worth of rendered text a prompt cut to fit may be: the template's markup
/// around a message cut to what could fit, and messages that are not text.
const FIT_SPAN: u32 = 4;

/// The end of `text`: at most `bytes` of it (at a character's start), or all of it.
fn tail(text: String, bytes: Option<usize>) -> String {
    match bytes {
        Some(b) if text.len() > b => {
            let mut start = text.len() - b;
            while !text.is_char_boundary(start) {
                start += 1;
            }
            text[start..].to_string()
        }
        _ => text,
    }
}

/// Cuts `tokens` to `target`, as Ollama's runner does: the first `keep` stay, then the last.
fn cut(tokens: &mut Vec<Token>, target: usize, keep: usize) {
    let before = tokens.len();
    if before <= target {
        return;
    }
    let keep = keep.min(target);
    tokens.drain(keep..before - (target - keep));
    log::warn!("truncating input prompt: limit={target} prompt={before} keep={keep} new={}", tokens.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_keeps_the_first_tokens_and_the_last() {
        let mut t: Vec<Token> = (0..10).collect();
        cut(&mut t, 6, 2);
        assert_eq!(t, [0, 1, 6, 7, 8, 9]);
        let mut short: Vec<Token> = (0..4).collect();
        cut(&mut short, 6, 2);
        assert_eq!(short, [0, 1, 2, 3]);
        let mut all_kept: Vec<Token> = (0..10).collect();
        cut(&mut all_kept, 3, 5);
        assert_eq!(all_kept, [0, 1, 2]);
    }

    #[test]
    fn a_text_s_tail_starts_at_a_character() {
        assert_eq!(tail("abcdef".into(), Some(3)), "def");
        assert_eq!(tail("abc".into(), Some(3)), "abc");
        assert_eq!(tail("abc".into(), None), "abc");
        // 'é' is two bytes: a cut inside it moves to the next character.
        assert_eq!(tail("aébc".into(), Some(4)), "ébc");
        assert_eq!(tail("aébc".into(), Some(3)), "bc");
    }

    #[test]
    fn the_answer_keeps_its_room_within_half_the_context() {
        assert_eq!(answer_room(4096, None), 512);
        assert_eq!(answer_room(4096, Some(100)), 100);
        assert_eq!(answer_room(4096, Some(100_000)), 2048);
        assert_eq!(answer_room(4, None), 1);
    }
}
