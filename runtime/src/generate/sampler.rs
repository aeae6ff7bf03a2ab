//! Choosing tokens: llama.cpp's sampler, and a token as it is chosen.

use std::collections::HashSet;
use std::ops::ControlFlow;

use ggml_sys::{Model, SamplerParams, Token};

use super::GenerateError;

/// Chooses tokens with llama.cpp's sampler ([`SamplerParams`]: greedy, or penalties, top-k,
/// top-p, min-p, temperature and a seeded draw, under an optional grammar), and renders them
/// as text.
pub struct Sampler {
    pub(super) inner: ggml_sys::Sampler,
    /// Special tokens whose text is kept in the output (a chat format's markers).
    shown: HashSet<Token>,
}

impl Sampler {
    /// A sampler over `model`'s vocabulary. A grammar llama.cpp cannot parse is an error.
    pub fn new(model: &Model, params: &SamplerParams) -> Result<Sampler, GenerateError> {
        Ok(Sampler { inner: ggml_sys::Sampler::new(model, params)?, shown: HashSet::new() })
    }

    /// The highest logit every time (lowest id on ties): the same text as a resident run.
    pub fn greedy(model: &Model) -> Result<Sampler, GenerateError> {
        Sampler::new(model, &SamplerParams::greedy())
    }

    /// Bounds each token's grammar work: cancelled with `cancel`, and an error past `bound`
    /// ([`ggml_sys::Sampler::set_guard`]).
    pub fn set_guard(&mut self, cancel: std::sync::Arc<std::sync::atomic::AtomicBool>, bound: std::time::Duration) {
        self.inner.set_guard(cancel, bound);
    }

    /// Keeps the text of these special tokens in the output (they are dropped otherwise).
    pub fn show_special(&mut self, tokens: impl IntoIterator<Item = Token>) {
        self.shown.extend(tokens);
    }

    /// The text of `token`, a shown special token's included.
    pub(super) fn piece(&self, model: &Model, token: Token) -> Vec<u8> {
        model.token_piece_with(token, self.shown.contains(&token))
    }
}

/// A token as it is chosen.
#[derive(Debug, Clone, Copy)]
pub struct Chosen<'a> {
    /// The token.
    pub token: Token,
    /// Its text.
    pub piece: &'a [u8],
    /// The model's logits it was chosen from (before any sampling step).
    pub logits: &'a [f32],
}

/// A token callback that never stops the generation, from one that only watches.
pub fn to_end(mut on_token: impl FnMut(Token, &[u8])) -> impl FnMut(&Chosen<'_>) -> ControlFlow<()> {
    move |c| {
        on_token(c.token, c.piece);
        ControlFlow::Continue(())
    }
}
