//! Perplexity of a model on a text, defined as llama.cpp's perplexity tool defines it, so that
//! figures compare with published ones: the text is tokenized once (with the model's own
//! beginning-of-sequence token where its vocabulary adds one), cut into windows of `n_ctx`
//! tokens (each window's first token replaced by that token), each window computed from an empty
//! memory, and the second half of each window scored: the negative log-likelihood of every token
//! from position `n_ctx / 2 + 1` to the window's end, given the tokens before it in its window.
//! The perplexity is `exp` of their mean.
//!
//! A window is computed as one prompt (llama.cpp's way), or, for what acts only on single-token
//! decodes (the lossy substitution), its first half as a prompt and the rest a token at a time,
//! as generation computes; the two agree to rounding.
//!
//! Besides the figure, a run keeps the model's first choice (arg-max) at every scored position,
//! so that two runs of the same text (a lossy knob against the lossless run) can say how often
//! they agree.

use ggml_sys::{Model, Token};

/// Why a perplexity cannot be computed.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    /// The text is too short for two windows (llama.cpp's rule).
    #[error("the text has {tokens} tokens; perplexity with --ctx {n_ctx} needs at least {need} (two windows): give a longer file or a smaller --ctx")]
    TooShort {
        /// Tokens in the text.
        tokens: usize,
        /// The window.
        n_ctx: usize,
        /// Tokens needed.
        need: usize,
    },
    /// The window is too small to score anything.
    #[error("--ctx {0} is too small: a window needs at least 4 tokens (half of it is scored)")]
    WindowTooSmall(usize),
    /// Two runs to compare scored different positions.
    #[error("the runs compared scored {0} and {1} positions: they were not of the same text and windows")]
    Mismatched(usize, usize),
    /// llama.cpp could not tokenize the text.
    #[error(transparent)]
    Tokenize(#[from] ggml_sys::Error),
}

/// A tokenized text cut into windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Windows {
    tokens: Vec<Token>,
    n_ctx: usize,
    chunks: usize,
    bos: Option<Token>,
}

impl Windows {
    /// Cuts `tokens` (the text tokenized as the model adds special tokens) into windows of
    /// `n_ctx`, at most `max_chunks` of them; `bos` is the token each window starts with, if the
    /// model's vocabulary adds one.
    pub fn new(
        tokens: Vec<Token>,
        n_ctx: usize,
        max_chunks: Option<usize>,
        bos: Option<Token>,
    ) -> Result<Windows, PerplexityError> {
        if n_ctx < 4 {
            return Err(PerplexityError::WindowTooSmall(n_ctx));
        }
        if tokens.len() < 2 * n_ctx {
            return Err(PerplexityError::TooShort { tokens: tokens.len(), n_ctx, need: 2 * n_ctx });
        }
        let all = tokens.len() / n_ctx;
        let chunks = max_chunks.map_or(all, |m| m.clamp(1, all));
        Ok(Windows { tokens, n_ctx, chunks, bos })
    }

    /// Tokenizes `text` with `model`'s vocabulary and cuts it as [`Windows::new`] does.
    pub fn of_text(
        model: &Model,
        text: &str,
        n_ctx: usize,
        max_chunks: Option<usize>,
    ) -> Result<Windows, PerplexityError> {
        let tokens = model.tokenize(text, true)?;
        let bos = model.tokenize("", true)?.first().copied();
        Windows::new(tokens, n_ctx, max_chunks, bos)
    }

    /// The window size.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// How many windows are scored.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Tokens in the whole text.
    pub fn text_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Window `i` as it is computed: its first token replaced by the beginning-of-sequence
    /// token where the model has one.
    pub fn window(&self, i: usize) -> Vec<Token> {
        let mut w = self.tokens[i * self.n_ctx..(i + 1) * self.n_ctx].to_vec();
        if let Some(bos) = self.bos {
            w[0] = bos;
        }
        w
    }

    /// The token that follows position `pos` of window `i` in the text (what the logits there
    /// are scored against).
    fn next(&self, i: usize, pos: usize) -> Token {
        self.tokens[i * self.n_ctx + pos + 1]
    }

    /// The first position of a window whose logits are scored (`n_ctx / 2`).
    fn first_scored(&self) -> usize {
        self.n_ctx / 2
    }

    /// Scores the windows: `eval(window, on_logits)` computes one window from an empty memory
    /// and passes `on_logits(pos, logits)` every position's next-token logits; `progress` hears
    /// the running figure after each window.
    pub fn score<E>(
        &self,
        mut eval: impl FnMut(&[Token], &mut dyn FnMut(usize, &[f32])) -> Result<(), E>,
        mut progress: impl FnMut(usize, f64),
    ) -> Result<Scores, E> {
        let mut scores = Scores::default();
        let first = self.first_scored();
        for i in 0..self.chunks {
            let window = self.window(i);
            let n = window.len();
            eval(&window, &mut |pos, logits| {
                if (first..n - 1).contains(&pos) {
                    scores.add(logits, self.next(i, pos));
                }
            })?;
            progress(i + 1, scores.perplexity());
        }
        Ok(scores)
    }
}

impl Windows {
    /// Scores the windows as [`Windows::score`] does, each computed a token at a time past its
    /// first half, as generation computes: `eval(prompt, continuation, on_logits)` decodes the
    /// window's first half as a prompt, then feeds the rest one token at a time, passing
    /// `on_logits(i, logits)` the logits before `continuation[i]`.
    pub fn score_decoded<E>(
        &self,
        mut eval: impl FnMut(&[Token], &[Token], &mut dyn FnMut(usize, &[f32])) -> Result<(), E>,
        progress: impl FnMut(usize, f64),
    ) -> Result<Scores, E> {
        let first = self.first_scored();
        self.score(|w, on| eval(&w[..=first], &w[first + 1..], &mut |i, l| on(first + i, l)), progress)
    }
}

/// The scored positions of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scores {
    /// Sum of the scored tokens' negative log-likelihoods.
    pub nll: f64,
    /// The model's first choice at each scored position.
    pub top1: Vec<Token>,
}

impl Scores {
    /// Adds one position: its logits and the token that followed.
    fn add(&mut self, logits: &[f32], next: Token) {
        self.nll += negative_log_likelihood(logits, next);
        self.top1.push(arg_max(logits));
    }

    /// Positions scored.
    pub fn count(&self) -> usize {
        self.top1.len()
    }

    /// `exp` of the mean negative log-likelihood (1 with nothing scored).
    pub fn perplexity(&self) -> f64 {
        if self.top1.is_empty() {
            return 1.0;
        }
        (self.nll / self.top1.len() as f64).exp()
    }

    /// The share of positions (0 to 1) where this run's first choice is `other`'s.
    pub fn top1_agreement(&self, other: &Scores) -> Result<f64, PerplexityError> {
        if self.top1.len() != other.top1.len() {
            return Err(PerplexityError::Mismatched(self.top1.len(), other.top1.len()));
        }
        let same = self.top1.iter().zip(&other.top1).filter(|(a, b)| a == b).count();
        Ok(same as f64 / self.top1.len().max(1) as f64)
    }
}

/// `-log softmax(logits)[next]`, as llama.cpp's perplexity computes it: the maximum in f32, the
/// sum of exponentials in f64.
pub fn negative_log_likelihood(logits: &[f32], next: Token) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let chosen = logits.get(next as usize).copied().unwrap_or(f32::NEG_INFINITY);
    sum.ln() + f64::from(max) - f64::from(chosen)
}

/// The index of the largest logit (the first of equals).
fn arg_max(logits: &[f32]) -> Token {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as Token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_minus_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = [1.0f64, 2.0, 3.0].iter().map(|l| l.exp()).sum();
        for (t, l) in [(0, 1.0f64), (1, 2.0), (2, 3.0)] {
            let want = -(l.exp() / z).ln();
            // The exponentials are f32's, as llama.cpp's are.
            assert!((negative_log_likelihood(&logits, t) - want).abs() < 1e-6, "token {t}");
        }
        // Uniform logits: log of the vocabulary.
        assert!((negative_log_likelihood(&[0.5; 8], 3) - 8f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn windows_score_their_second_half_against_the_next_token() {
        // 10 tokens, windows of 4: two windows (tokens 0-3, 4-7), BOS 99 in front of each.
        let tokens: Vec<Token> = (10..20).collect();
        let w = Windows::new(tokens, 4, None, Some(99)).unwrap();
        assert_eq!(w.chunks(), 2);
        assert_eq!(w.window(1), vec![99, 15, 16, 17]);
        // A model whose logits put everything on token `pos + 1` of the window's text.
        let mut seen = Vec::new();
        let scores = w
            .score(
                |window: &[Token], on: &mut dyn FnMut(usize, &[f32])| {
                    for pos in 0..window.len() {
                        let mut logits = vec![0.0f32; 32];
                        logits[(window[pos] as usize + 1).min(31)] = 10.0;
                        on(pos, &logits);
                    }
                    Ok::<(), ()>(())
                },
                |i, ppl| seen.push((i, ppl)),
            )
            .unwrap();
        // Scored: positions 2 of each window (predicting tokens 13 and 17): n_ctx - 1 - n_ctx/2.
        assert_eq!(scores.count(), 2);
        assert_eq!(scores.top1, vec![13, 17]);
        let one = negative_log_likelihood(
            &{
                let mut l = vec![0.0f32; 32];
                l[13] = 10.0;
                l
            },
            13,
        );
        assert!((scores.perplexity() - one.exp()).abs() < 1e-9);
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn decoded_windows_score_the_same_positions_against_the_same_tokens() {
        let tokens: Vec<Token> = (10..20).collect();
        let w = Windows::new(tokens, 4, None, Some(99)).unwrap();
        let mut halves = Vec::new();
        // The same model as above: everything on the token after the last one given.
        let scores = w
            .score_decoded(
                |prompt: &[Token], rest: &[Token], on: &mut dyn FnMut(usize, &[f32])| {
                    halves.push((prompt.to_vec(), rest.to_vec()));
                    let mut seen = *prompt.last().unwrap();
                    for (i, &t) in rest.iter().enumerate() {
                        let mut logits = vec![0.0f32; 32];
                        logits[(seen as usize + 1).min(31)] = 10.0;
                        on(i, &logits);
                        seen = t;
                    }
                    Ok::<(), ()>(())
                },
                |_, _| {},
            )
            .unwrap();
        assert_eq!(halves, vec![(vec![99, 11, 12], vec![13]), (vec![99, 15, 16], vec![17])]);
        assert_eq!(scores.top1, vec![13, 17]);
    }

    #[test]
    fn short_texts_and_tiny_windows_are_refused() {
        assert!(matches!(
            Windows::new(vec![1; 7], 4, None, None),
            Err(PerplexityError::TooShort { tokens: 7, need: 8, .. })
        ));
        assert!(matches!(Windows::new(vec![1; 100], 3, None, None), Err(PerplexityError::WindowTooSmall(3))));
        assert_eq!(Windows::new(vec![1; 100], 4, Some(3), None).unwrap().chunks(), 3);
        assert_eq!(Windows::new(vec![1; 100], 4, Some(0), None).unwrap().chunks(), 1);
    }

    #[test]
    fn agreement_counts_equal_first_choices() {
        let a = Scores { nll: 0.0, top1: vec![1, 2, 3, 4] };
        let b = Scores { nll: 0.0, top1: vec![1, 2, 0, 4] };
        assert_eq!(a.top1_agreement(&b).unwrap(), 0.75);
        assert!(a.top1_agreement(&Scores::default()).is_err());
    }
}
