//! OpenAI's API: `/v1/completions`, `/v1/chat/completions` (whole or streamed as chunks), the
//! Responses API (`/v1/responses`, its stored responses and their input items) and `/v1/models`.
//! This file holds the request bodies and their checks, which the other APIs' requests are
//! translated into; the chat request it makes is the one every API's generation runs.

use ggml_sys::SamplerParams;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::serve::chat::{chat_inputs, ChatFields};
use crate::serve::error::ApiError;
use crate::serve::job::{GenerationRequest, Owner, PromptInput};
use crate::serve::limits::{MAX_LOGIT_BIAS, MAX_STOP_BYTES};
use crate::serve::model_card::names_served;

/// A prompt: a string, or an array holding one string.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of one string")]
pub enum PromptField {
    /// `"prompt": "text"`.
    One(String),
    /// `"prompt": ["text"]`.
    Many(Vec<String>),
}

/// Stop sequences: a string or an array of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum StopField {
    /// `"stop": "x"`.
    One(String),
    /// `"stop": ["x", "y"]`.
    Many(Vec<String>),
}

/// `logprobs`: a count of alternatives (`/v1/completions`) or a switch (`/v1/chat/completions`).
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "true/false (chat) or a number of alternatives (completions)")]
pub enum LogprobsField {
    /// `"logprobs": true`.
    Switch(bool),
    /// `"logprobs": 3`.
    Count(u32),
}

/// `stream_options`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Whether a last chunk carries the usage.
    include_usage: Option<bool>,
}

/// The body of `POST /v1/completions` (`prompt`) and `POST /v1/chat/completions` (`messages`):
/// the fields OpenAI defines that sluice honours or knowingly ignores. Any other field is a 400.
/// (`/v1/responses` is translated into one.)
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestBody {
    model: Option<String>,
    prompt: Option<PromptField>,
    messages: Option<Vec<Value>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<StopField>,
    seed: Option<i64>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    #[serde(alias = "repeat_penalty")]
    repetition_penalty: Option<f32>,
    logprobs: Option<LogprobsField>,
    top_logprobs: Option<u32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    response_format: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
    reasoning_effort: Option<String>,
    /// llama-server's bound on a thinking block's tokens (-1: none).
    thinking_budget_tokens: Option<i64>,
    logit_bias: Option<Map<String, Value>>,
    /// llama-server's switch for prompt reuse: `false` computes the whole prompt in an empty slot.
    cache_prompt: Option<bool>,
    // Known OpenAI fields that do not change what sluice generates: accepted, logged at debug.
    user: Option<IgnoredAny>,
    store: Option<IgnoredAny>,
    metadata: Option<IgnoredAny>,
    service_tier: Option<IgnoredAny>,
    prediction: Option<IgnoredAny>,
    safety_identifier: Option<IgnoredAny>,
    prompt_cache_key: Option<IgnoredAny>,
}

/// Tokens a completion generates when `max_tokens` is absent (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: u32 = 16;
/// Most stop sequences a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// Most alternatives `logprobs` may ask for on `/v1/completions` (OpenAI's limit).
const MAX_COMPLETION_LOGPROBS: u32 = 5;
/// Most alternatives `top_logprobs` may ask for on `/v1/chat/completions` (OpenAI's limit).
const MAX_TOP_LOGPROBS: u32 = 20;

impl RequestBody {
    /// Checks the fields both endpoints share; returns the sampling and the stop sequences.
    fn sampling_and_stop(&mut self, served: &str) -> Result<(SamplerParams, Vec<String>), ApiError> {
        if let Some(m) = self.model.take().filter(|m| !names_served(m, served)) {
            return Err(ApiError {
                status: 404,
                message: format!("The model `{m}` does not exist: this server serves `{served}` (GET /v1/models)"),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n: sluice generates one choice per request; use n = 1", Some("n")));
        }
        let ignored = [
            ("user", self.user.is_some()),
            ("store", self.store.is_some()),
            ("metadata", self.metadata.is_some()),
            ("service_tier", self.service_tier.is_some()),
            ("prediction", self.prediction.is_some()),
            ("safety_identifier", self.safety_identifier.is_some()),
            ("prompt_cache_key", self.prompt_cache_key.is_some()),
        ];
        for (name, _) in ignored.iter().filter(|(_, sent)| *sent) {
            log::debug!("request field {name} accepted and ignored: it does not change what sluice generates");
        }
        let mut p = SamplerParams::greedy();
        p.temperature = in_range("temperature", self.temperature, 1.0, 0.0..=2.0, "use 0 (greedy) to 2")?;
        p.top_p = in_range("top_p", self.top_p, 1.0, 0.0..=1.0, "use a value in (0, 1]")?;
        if p.top_p == 0.0 {
            return Err(ApiError::invalid("top_p: 0 keeps no token; use a value in (0, 1]", Some("top_p")));
        }
        p.top_k = self.top_k.unwrap_or(0);
        if p.top_k < 0 {
            return Err(ApiError::invalid(
                format!("top_k: {} is negative; use 0 (off) or more", p.top_k),
                Some("top_k"),
            ));
        }
        p.min_p = in_range("min_p", self.min_p, 0.0, 0.0..=1.0, "use 0 (off) to 1")?;
        p.penalty_freq = in_range("frequency_penalty", self.frequency_penalty, 0.0, -2.0..=2.0, "use -2 to 2")?;
        p.penalty_present = in_range("presence_penalty", self.presence_penalty, 0.0, -2.0..=2.0, "use -2 to 2")?;
        p.penalty_repeat =
            in_range("repetition_penalty", self.repetition_penalty, 1.0, 0.0..=10.0, "use 1 (off); above 1 penalizes")?;
        if p.penalty_repeat == 0.0 {
            return Err(ApiError::invalid("repetition_penalty: must be above 0; 1 is off", Some("repetition_penalty")));
        }
        p.logit_bias = logit_bias(self.logit_bias.take())?;
        // OpenAI seeds are 64-bit; llama.cpp's are 32: both halves count.
        p.seed = match self.seed {
            Some(s) => ((s as u64) ^ ((s as u64) >> 32)) as u32,
            None => random_seed(),
        };
        let stop = match self.stop.take() {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s],
            Some(StopField::Many(v)) => v,
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                format!("stop: at most {MAX_STOPS} sequences, got {}", stop.len()),
                Some("stop"),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop: a stop sequence is empty", Some("stop")));
        }
        if let Some(s) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(
                format!("stop: a stop sequence of {} bytes; at most {MAX_STOP_BYTES}", s.len()),
                Some("stop"),
            ));
        }
        Ok((p, stop))
    }

    /// `stream` and `stream_options.include_usage`.
    fn streaming(&self) -> Result<(bool, bool), ApiError> {
        let stream = self.stream.unwrap_or(false);
        let usage = self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid("stream_options: only allowed when stream is true", Some("stream_options")));
        }
        Ok((stream, usage))
    }
}

/// `logit_bias`: token ids (as strings) to biases in [-100, 100]. Whether the tokens exist is
/// checked against the vocabulary when the sampler is made.
fn logit_bias(map: Option<Map<String, Value>>) -> Result<Vec<(ggml_sys::Token, f32)>, ApiError> {
    let map = map.unwrap_or_default();
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            format!("logit_bias: {} entries; at most {MAX_LOGIT_BIAS}", map.len()),
            Some("logit_bias"),
        ));
    }
    let mut out = Vec::new();
    for (key, value) in map {
        let param = format!("logit_bias.{key}");
        let token = key
            .parse::<ggml_sys::Token>()
            .ok()
            .filter(|t| *t >= 0)
            .ok_or_else(|| ApiError::invalid(format!("{param}: {key:?} is not a token id"), Some(&param)))?;
        let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid(format!("{param}: {value} is not a bias from -100 to 100"), Some(&param))
        })?;
        out.push((token, bias as f32));
    }
    Ok(out)
}

/// `value` (or `default`) when it lies in `range`, else a 400 naming `name` and `fix`.
fn in_range(
    name: &str,
    value: Option<f32>,
    default: f32,
    range: std::ops::RangeInclusive<f32>,
    fix: &str,
) -> Result<f32, ApiError> {
    let v = value.unwrap_or(default);
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(ApiError::invalid(format!("{name}: {v} is out of range; {fix}"), Some(name)))
    }
}

/// A field the other endpoint takes, sent to this one.
fn wrong_endpoint(field: &str, endpoint: &str) -> ApiError {
    ApiError::invalid(
        format!("Unrecognized request argument supplied: {field} ({endpoint} does not take it)"),
        Some(field),
    )
}

/// A seed for a request that gives none.
fn random_seed() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)) as u32
}

/// `thinking_budget_tokens`: -1 (or absent) for no bound, else the most tokens a thinking block
/// gets before its end tag is written for it.
fn thinking_budget(v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None | Some(-1) => Ok(None),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| {
            ApiError::invalid(
                format!("thinking_budget_tokens: {n} is not -1 (no bound) or a number of tokens"),
                Some("thinking_budget_tokens"),
            )
        }),
    }
}

fn check_max_tokens(v: Option<u32>, param: &str) -> Result<Option<u32>, ApiError> {
    match v {
        Some(0) => Err(ApiError::invalid(format!("{param}: must be at least 1"), Some(param))),
        v => Ok(v),
    }
}

/// Parses and checks a `/v1/completions` body for the model `served`.
pub fn completion_request(body: &[u8], served: &str) -> Result<GenerationRequest, ApiError> {
    completion_from(parse(body)?, served)
}

/// [`completion_request`] of a body another API's request was translated into.
pub fn completion_request_from(body: Value, served: &str) -> Result<GenerationRequest, ApiError> {
    completion_from(parse_value(body)?, served)
}

/// Checks a completion request's fields and makes the generation request.
fn completion_from(mut r: RequestBody, served: &str) -> Result<GenerationRequest, ApiError> {
    for (field, sent) in [
        ("messages", r.messages.is_some()),
        ("max_completion_tokens", r.max_completion_tokens.is_some()),
        ("top_logprobs", r.top_logprobs.is_some()),
        ("tools", r.tools.is_some()),
        ("tool_choice", r.tool_choice.is_some()),
        ("parallel_tool_calls", r.parallel_tool_calls.is_some()),
        ("response_format", r.response_format.is_some()),
        ("chat_template_kwargs", r.chat_template_kwargs.is_some()),
        ("reasoning_effort", r.reasoning_effort.is_some()),
        ("thinking_budget_tokens", r.thinking_budget_tokens.is_some()),
    ] {
        if sent {
            return Err(wrong_endpoint(field, "/v1/completions"));
        }
    }
    let prompt = match r.prompt.take() {
        None => return Err(ApiError::invalid("missing field `prompt`", Some("prompt"))),
        Some(PromptField::One(p)) => p,
        Some(PromptField::Many(mut v)) if v.len() == 1 => v.remove(0),
        Some(PromptField::Many(v)) => {
            return Err(ApiError::invalid(
                format!("prompt: an array must hold exactly one string (got {}); send one request per prompt", v.len()),
                Some("prompt"),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt: the prompt is empty", Some("prompt")));
    }
    let logprobs = match r.logprobs.take() {
        None => None,
        Some(LogprobsField::Count(n)) if n <= MAX_COMPLETION_LOGPROBS => Some(n as usize),
        Some(LogprobsField::Count(n)) => {
            return Err(ApiError::invalid(
                format!("logprobs: at most {MAX_COMPLETION_LOGPROBS} alternatives, got {n}"),
                Some("logprobs"),
            ))
        }
        Some(LogprobsField::Switch(_)) => {
            return Err(ApiError::invalid(
                "logprobs: /v1/completions takes a number of alternatives (0 to 5), not true/false",
                Some("logprobs"),
            ))
        }
    };
    let max_tokens = Some(check_max_tokens(r.max_tokens, "max_tokens")?.unwrap_or(DEFAULT_COMPLETION_TOKENS));
    let (stream, include_usage) = r.streaming()?;
    let (sampling, stop) = r.sampling_and_stop(served)?;
    Ok(GenerationRequest {
        prompt: PromptInput::Text(prompt),
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        logprobs,
        cache_prompt: r.cache_prompt.unwrap_or(true),
        owner: Owner::default(),
        truncate: None,
        unload_after: false,
        model: None,
    })
}

/// Parses and checks a `/v1/chat/completions` body for the model `served`.
pub fn chat_request(body: &[u8], served: &str) -> Result<GenerationRequest, ApiError> {
    chat_from(parse(body)?, served)
}

/// [`chat_request`] of a body another API's request was translated into.
pub fn chat_request_from(body: Value, served: &str) -> Result<GenerationRequest, ApiError> {
    chat_from(parse_value(body)?, served)
}

/// Checks a chat request's fields and makes the generation request.
fn chat_from(mut r: RequestBody, served: &str) -> Result<GenerationRequest, ApiError> {
    if r.prompt.is_some() {
        return Err(wrong_endpoint("prompt", "/v1/chat/completions"));
    }
    let Some(messages) = r.messages.take() else {
        return Err(ApiError::invalid("missing field `messages`", Some("messages")));
    };
    let inputs = chat_inputs(ChatFields {
        messages,
        tools: r.tools.take(),
        tool_choice: r.tool_choice.take(),
        parallel_tool_calls: r.parallel_tool_calls,
        response_format: r.response_format.take(),
        chat_template_kwargs: r.chat_template_kwargs.take(),
        reasoning_effort: r.reasoning_effort.take(),
    })?;
    let logprobs = match (r.logprobs.take(), r.top_logprobs) {
        (None | Some(LogprobsField::Switch(false)), None) => None,
        (Some(LogprobsField::Switch(true)), top) => match top.unwrap_or(0) {
            top if top <= MAX_TOP_LOGPROBS => Some(top as usize),
            top => {
                return Err(ApiError::invalid(
                    format!("top_logprobs: at most {MAX_TOP_LOGPROBS}, got {top}"),
                    Some("top_logprobs"),
                ))
            }
        },
        (None | Some(LogprobsField::Switch(false)), Some(_)) => {
            return Err(ApiError::invalid("top_logprobs: needs \"logprobs\": true", Some("top_logprobs")))
        }
        (Some(LogprobsField::Count(_)), _) => {
            return Err(ApiError::invalid(
                "logprobs: /v1/chat/completions takes true or false (and top_logprobs for alternatives)",
                Some("logprobs"),
            ))
        }
    };
    let max_tokens = match (r.max_completion_tokens, r.max_tokens) {
        (Some(v), _) => check_max_tokens(Some(v), "max_completion_tokens")?,
        (None, v) => check_max_tokens(v, "max_tokens")?,
    };
    let (stream, include_usage) = r.streaming()?;
    let (mut sampling, stop) = r.sampling_and_stop(served)?;
    // Thinking turned off is held to, on templates that have no switch for it too: a thinking
    // block the model opens anyway is closed at once.
    sampling.thinking_budget = thinking_budget(r.thinking_budget_tokens)?.or((!inputs.enable_thinking).then_some(0));
    Ok(GenerationRequest {
        prompt: PromptInput::Chat(Box::new(inputs)),
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        logprobs,
        cache_prompt: r.cache_prompt.unwrap_or(true),
        owner: Owner::default(),
        truncate: None,
        unload_after: false,
        model: None,
    })
}

mod chat_stream;
mod endpoints;
mod reply;
mod response_input;
mod response_items;
mod responses;
mod responses_api;

use crate::serve::http::{parse, parse_value};
pub use endpoints::{generate, model, models};
pub use reply::Kind;
pub use responses::{responses_request, ResponseSetup};
pub use responses_api::{answer as responses, kept};

#[cfg(test)]
mod tests;
