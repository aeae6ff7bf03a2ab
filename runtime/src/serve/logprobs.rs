//! Log probabilities of generated tokens, in the two shapes OpenAI returns them.
//!
//! They are the model's own distribution: a log-softmax of the raw logits the token was chosen
//! from, before penalties, grammar or temperature.

use ggml_sys::{Model, Token};
use serde_json::{json, Map, Value};

/// A chosen token's log probability, with the likeliest alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its log probability.
    pub logprob: f32,
    /// The likeliest tokens (bytes, log probability), most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
}

impl TokenLogprob {
    /// The log probability of `token` (whose text is `piece`) under `logits`, with the `top`
    /// likeliest tokens.
    pub fn of(model: &Model, token: Token, piece: &[u8], logits: &[f32], top: usize) -> TokenLogprob {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let lse = max + sum.ln() as f32;
        let mut best: Vec<(usize, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if best.len() < top || l > best[best.len() - 1].1 {
                    let at = best.partition_point(|&(_, b)| b >= l);
                    best.insert(at, (i, l));
                    best.truncate(top);
                }
            }
        }
        TokenLogprob {
            bytes: piece.to_vec(),
            logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| l - lse),
            top: best.into_iter().map(|(i, l)| (model.token_piece(i as Token), l - lse)).collect(),
        }
    }

    /// About how many bytes it holds.
    pub fn weight(&self) -> usize {
        const ENTRY: usize = 32;
        ENTRY + self.bytes.len() + self.top.iter().map(|(b, _)| ENTRY + b.len()).sum::<usize>()
    }

    fn text(bytes: &[u8]) -> String {
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// The chat shape: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
pub fn chat_json(tokens: &[TokenLogprob]) -> Value {
    let entry =
        |bytes: &[u8], logprob: f32| json!({ "token": TokenLogprob::text(bytes), "logprob": logprob, "bytes": bytes });
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.bytes, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(b, l)| entry(b, *l)).collect();
            e
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// The completions shape: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, the
/// offsets counted from `offset` (the text already returned).
pub fn completion_json(tokens: &[TokenLogprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.bytes.len();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut m = Map::new();
            for (b, l) in &t.top {
                m.entry(TokenLogprob::text(b)).or_insert(json!(l));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| TokenLogprob::text(&t.bytes)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_count_bytes_from_the_text_already_sent() {
        let t = |s: &str, l: f32| TokenLogprob {
            bytes: s.as_bytes().to_vec(),
            logprob: l,
            top: vec![(s.as_bytes().to_vec(), l)],
        };
        let j = completion_json(&[t("ab", -0.5), t("c", -1.0)], 10);
        assert_eq!(j["text_offset"], json!([10, 12]));
        assert_eq!(j["tokens"], json!(["ab", "c"]));
        assert_eq!(j["top_logprobs"][1]["c"], json!(-1.0));
        let c = chat_json(&[t("ab", -0.5)]);
        assert_eq!(c["content"][0]["bytes"], json!([97, 98]));
        assert_eq!(c["content"][0]["top_logprobs"][0]["token"], "ab");
    }
}
