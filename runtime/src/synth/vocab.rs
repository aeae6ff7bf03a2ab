//! The synthetic models' vocabulary: a byte-fallback SentencePiece (`llama`) vocabulary of
//! `<unk>`, `<s>`, `</s>` and the 256 `<0xNN>` byte tokens, so any text tokenizes, plus the
//! word separator `▁` and the markers of the common chat formats (ChatML's `<|im_start|>` /
//! `<|im_end|>`, thinking and tool-call tags), so that a chat template's prompt tokenizes and
//! renders back to the same text (no space prefix is added) and a chat ends at `<|im_end|>`.
//! With words ([`super::SynthSpec::words`], the demo model), a thousand common English words
//! follow as `▁word` tokens, so that random weights generate random words instead of bytes.
//! With a chat template, the markers of the other chat formats that it uses come last, each one
//! token as in the models that ship the template (gpt-oss's channels, DeepSeek's and Kimi's
//! tool-call sections, MiniMax's turns, ...).

use super::gguf_writer::Value;

/// Token id of `<unk>`.
pub const UNK: i32 = 0;
/// Token id of `<s>` (beginning of sequence).
pub const BOS: i32 = 1;
/// Token id of `</s>` (end of sequence).
pub const EOS: i32 = 2;
/// The chat tokens after the byte tokens: text and llama.cpp token type.
const CHAT_TOKENS: [(&str, i32); 7] = [
    ("\u{2581}", TYPE_NORMAL),
    ("<|im_start|>", TYPE_CONTROL),
    ("<|im_end|>", TYPE_CONTROL),
    ("<think>", TYPE_USER_DEFINED),
    ("</think>", TYPE_USER_DEFINED),
    ("<tool_call>", TYPE_USER_DEFINED),
    ("</tool_call>", TYPE_USER_DEFINED),
];
/// The id of the token `text` stands for: one printable ASCII character's byte token, or a token
/// of the vocabulary (with or without the words, with the markers of `template`) spelt `text`.
pub fn token_id(text: &str, with_words: bool, template: Option<&str>) -> Option<u64> {
    if let [b] = text.as_bytes() {
        return b.is_ascii_graphic().then_some(3 + u64::from(*b));
    }
    let meta = metadata(with_words, template, None);
    let tokens = meta.iter().find_map(|(k, v)| match v {
        Value::StrArray(t) if k == "tokenizer.ggml.tokens" => Some(t),
        _ => None,
    })?;
    tokens.iter().position(|t| t == text).map(|i| i as u64)
}

/// Token id of `<|im_end|>` (end of a chat turn).
const IM_END: u32 = 3 + 256 + 2;
/// Number of tokens without words: three specials, 256 bytes and the chat tokens.
const N_BASE: u64 = 3 + 256 + CHAT_TOKENS.len() as u64;

/// The markers of the chat formats sluice's chat tests use, beyond [`CHAT_TOKENS`]: a template
/// that contains one gets it as a token. (llama.cpp ends a generation at the ones it knows as
/// end-of-turn tokens by their text: `<|return|>`, `<|call|>`, `<｜end▁of▁sentence｜>`.)
const TEMPLATE_MARKERS: [&str; 52] = [
    // Qwen3, Qwen3.5, GLM
    "<tool_response>",
    "</tool_response>",
    // gpt-oss (harmony)
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    // DeepSeek V3.1
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    // GLM-4.5/4.6
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    // LFM2
    "<|startoftext|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
    // Kimi K2
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    // MiniMax M2
    "]~!b[",
    "]~b]",
    "[e~[",
    "<minimax:tool_call>",
    "</minimax:tool_call>",
];

/// The markers `template` uses that get tokens of their own.
fn template_markers(template: Option<&str>) -> impl Iterator<Item = &'static str> + '_ {
    TEMPLATE_MARKERS.into_iter().filter(move |m| template.is_some_and(|t| t.contains(m)))
}

/// The common English words of the demo vocabulary (`words.txt`), most frequent first.
fn words() -> impl Iterator<Item = &'static str> {
    include_str!("words.txt").lines().filter(|l| !l.is_empty() && !l.starts_with('#'))
}

/// Number of tokens, with or without the words, with the markers of `template`.
pub fn n_vocab(with_words: bool, template: Option<&str>, pad_to: Option<u32>) -> u64 {
    let n = N_BASE + if with_words { words().count() as u64 } else { 0 } + template_markers(template).count() as u64;
    n.max(pad_to.map_or(0, u64::from))
}

// llama.cpp's token attributes (enum llama_token_type).
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;
const TYPE_UNUSED: i32 = 5;
const TYPE_BYTE: i32 = 6;

/// The `tokenizer.ggml.*` metadata entries, with or without the words, with the markers of
/// `template`, padded with unused tokens to `pad_to` tokens.
pub fn metadata(with_words: bool, template: Option<&str>, pad_to: Option<u32>) -> Vec<(String, Value)> {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    let mut types = vec![TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL];
    types.extend(std::iter::repeat_n(TYPE_BYTE, 256));
    tokens.extend(CHAT_TOKENS.iter().map(|(t, _)| t.to_string()));
    types.extend(CHAT_TOKENS.iter().map(|(_, kind)| *kind));
    let mut scores = vec![0.0f32; tokens.len()];
    if with_words {
        // SentencePiece prefers the higher-scored piece: the more frequent word.
        for (rank, w) in words().enumerate() {
            tokens.push(format!("\u{2581}{w}"));
            types.push(TYPE_NORMAL);
            scores.push(-(rank as f32) / 1000.0);
        }
    }
    for marker in template_markers(template) {
        tokens.push(marker.to_string());
        types.push(TYPE_USER_DEFINED);
        scores.push(0.0);
    }
    for i in tokens.len()..pad_to.map_or(0, |n| n as usize) {
        tokens.push(format!("<unused_{i}>"));
        types.push(TYPE_UNUSED);
        scores.push(0.0);
    }
    vec![
        ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
        ("tokenizer.ggml.tokens".into(), Value::StrArray(tokens)),
        ("tokenizer.ggml.scores".into(), Value::F32Array(scores)),
        ("tokenizer.ggml.token_type".into(), Value::I32Array(types)),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(UNK as u32)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(BOS as u32)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(EOS as u32)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
        ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
        ("tokenizer.ggml.eot_token_id".into(), Value::U32(IM_END)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_favoured_token_is_a_byte_or_a_token_of_the_vocabulary() {
        assert_eq!(token_id("1", false, None), Some(3 + 0x31));
        assert_eq!(token_id("<tool_call>", false, None), Some(N_BASE - 2));
        let kimi = Some("{{ '<|tool_call_begin|>' }}");
        assert_eq!(token_id("<|tool_call_begin|>", false, kimi), Some(N_BASE));
        assert_eq!(token_id("<|tool_call_begin|>", false, None), None, "the marker comes with its template");
        assert_eq!(token_id("\u{7}", false, None), None);
        assert_eq!(token_id("nope", false, None), None);
    }
}
