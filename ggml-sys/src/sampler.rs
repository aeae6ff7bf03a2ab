//! llama.cpp common's sampler (what llama-server samples with), through `common_shim.cpp`:
//! penalties, top-k, top-p, min-p, temperature and a seeded draw, with a GBNF grammar (eager, or
//! lazy behind triggers) enforced on every token.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llama_cpp_sys_2 as sys;
use serde::Serialize;

use crate::chat::{chat_caught, made, GrammarTrigger};
use crate::{Context, Error, Model, Result, Token};

#[repr(C)]
struct RawSampler {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn sluice_sampler_init(model: *const sys::llama_model, params_json: *const std::ffi::c_char) -> *mut RawSampler;
    fn sluice_sampler_free(s: *mut RawSampler);
    fn sluice_sampler_accept_prompt(s: *mut RawSampler, token: sys::llama_token);
    fn sluice_sampler_sample(s: *mut RawSampler, ctx: *mut sys::llama_context, idx: i32) -> sys::llama_token;
}

/// Where a grammar comes from; llama.cpp feeds the template's generation prompt to the ones it
/// made itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GrammarKind {
    /// Written by the user.
    #[default]
    User,
    /// Made from a JSON schema.
    Output,
    /// Made for tool calls.
    Tools,
}

/// How tokens are chosen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplerParams {
    /// 0: the highest logit (the lowest id on ties), the same text every time.
    pub temperature: f32,
    /// Keep the k likeliest (0: all).
    pub top_k: i32,
    /// Keep the likeliest tokens up to this mass (1: all).
    pub top_p: f32,
    /// Drop tokens under this share of the likeliest one's probability (0: none).
    pub min_p: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: i32,
    /// Divides the logit of a recent token (1: off).
    pub penalty_repeat: f32,
    /// Subtracted per occurrence of a recent token (0: off).
    pub penalty_freq: f32,
    /// Subtracted once from any recent token (0: off).
    pub penalty_present: f32,
    /// The draw's seed: the same seed, the same text.
    pub seed: u32,
    /// Added to these tokens' logits: (token, bias).
    pub logit_bias: Vec<(Token, f32)>,
    /// A GBNF grammar every chosen token must keep valid; empty: none.
    pub grammar: String,
    /// Where the grammar comes from.
    pub grammar_kind: GrammarKind,
    /// Whether the grammar waits for a trigger.
    pub grammar_lazy: bool,
    /// What wakes a lazy grammar.
    pub grammar_triggers: Vec<GrammarTrigger>,
    /// The start of the assistant's turn already in the prompt.
    pub generation_prompt: String,
    /// The tag that opens thinking (a lazy grammar sleeps inside thinking).
    pub thinking_start_tag: String,
    /// The tags that close thinking.
    pub thinking_end_tags: Vec<String>,
    /// Tokens of thinking after which the first end tag closes the block (`None`: no bound).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking_budget: Option<u32>,
}

impl SamplerParams {
    /// The highest logit every time, no penalties, no grammar.
    pub fn greedy() -> SamplerParams {
        SamplerParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            penalty_last_n: 64,
            penalty_repeat: 1.0,
            penalty_freq: 0.0,
            penalty_present: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
            grammar: String::new(),
            grammar_kind: GrammarKind::User,
            grammar_lazy: false,
            grammar_triggers: Vec::new(),
            generation_prompt: String::new(),
            thinking_start_tag: String::new(),
            thinking_end_tags: Vec::new(),
            thinking_budget: None,
        }
    }

    /// Whether every choice is the highest logit (no draw).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// A sampler for one generation over one model.
pub struct Sampler {
    raw: NonNull<RawSampler>,
    guard: Option<Guard>,
}

/// What bounds one sampling call's grammar work: a cancel flag and a time bound.
struct Guard {
    cancel: Arc<AtomicBool>,
    bound: Duration,
}

// SAFETY: the sampler is used from one thread at a time (&mut self; not Sync) and holds nothing
// tied to the thread that made it.
unsafe impl Send for Sampler {}

impl Sampler {
    /// A sampler over `model`'s vocabulary. A grammar llama.cpp cannot parse, or a biased token
    /// outside the vocabulary, is [`Error::Chat`].
    pub fn new(model: &Model, params: &SamplerParams) -> Result<Sampler> {
        let json = serde_json::to_string(params)
            .map_err(|e| Error::Chat { call: "common_sampler_init", message: format!("params: {e}") })?;
        let json = CString::new(json).map_err(|e| Error::TextNul(e.nul_position()))?;
        // SAFETY: live model; json is NUL-terminated and lives for the call.
        let raw = unsafe { sluice_sampler_init(model.raw().cast_const(), json.as_ptr()) };
        made("common_sampler_init", raw).map(|raw| Sampler { raw, guard: None })
    }

    /// Feeds prompt tokens to the penalties' history.
    pub fn accept_prompt(&mut self, tokens: &[Token]) -> Result<()> {
        for &t in tokens {
            // SAFETY: live sampler; the token comes from the model's tokenizer.
            unsafe { sluice_sampler_accept_prompt(self.raw.as_ptr(), t) };
            chat_caught("common_sampler_accept")?;
        }
        Ok(())
    }

    /// Bounds the grammar work of each later [`Sampler::sample`]: it stops with
    /// [`Error::Aborted`] once `cancel` is set, and with [`Error::GrammarTooSlow`] when one
    /// token's grammar checks take longer than `bound` (a grammar's cost per token grows with
    /// the alternatives it keeps open, times the vocabulary).
    pub fn set_guard(&mut self, cancel: Arc<AtomicBool>, bound: Duration) {
        self.guard = Some(Guard { cancel, bound });
    }

    /// Chooses the token for output `idx` of `ctx`'s last decode (`-1`: the last), and
    /// accepts it.
    pub fn sample(&mut self, ctx: &Context<'_>, idx: i32) -> Result<Token> {
        ctx.logits(idx)?;
        let started = Instant::now();
        if let Some(g) = &self.guard {
            let deadline_us = ggml_now_us().saturating_add(i64::try_from(g.bound.as_micros()).unwrap_or(i64::MAX));
            // SAFETY: the flag is an AtomicBool (one byte, the layout of bool) that the guard's Arc
            // keeps alive; the thread's guard is cleared below, before this call returns, so
            // llama.cpp never reads it after that. llama.cpp loads it atomically.
            unsafe { sys::llama_grammar_set_work_guard(g.cancel.as_ptr().cast_const(), deadline_us) };
        }
        // SAFETY: live sampler and context; idx has logits (checked above).
        let token = unsafe { sluice_sampler_sample(self.raw.as_ptr(), ctx.raw(), idx) };
        if self.guard.is_some() {
            // SAFETY: clearing the thread's guard: no pointer is kept.
            unsafe { sys::llama_grammar_set_work_guard(std::ptr::null(), 0) };
        }
        let caught = chat_caught("common_sampler_sample");
        match (&self.guard, caught) {
            (_, Ok(())) => Ok(token),
            (Some(g), Err(_)) if g.cancel.load(Ordering::Relaxed) => Err(Error::Aborted),
            (Some(g), Err(_)) if started.elapsed() >= g.bound => {
                Err(Error::GrammarTooSlow { bound_ms: g.bound.as_millis() as u64 })
            }
            (_, Err(e)) => Err(e),
        }
    }
}

/// ggml's clock, which the grammar guard's deadline is on.
fn ggml_now_us() -> i64 {
    // SAFETY: takes no arguments and reads CLOCK_MONOTONIC (ggml_time_init is needed on Windows
    // only).
    unsafe { sys::ggml_time_us() }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: raw came from sluice_sampler_init and is freed once.
        unsafe { sluice_sampler_free(self.raw.as_ptr()) };
    }
}
