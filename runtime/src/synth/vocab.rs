//! The synthetic models' vocabulary: a byte-fallback SentencePiece (`llama`) vocabulary of
//! `<unk>`, `<s>`, `</s>` and the 256 `<0xNN>` byte tokens, so any text tokenizes.

use super::gguf_writer::Value;

/// Token id of `<unk>`.
pub const UNK: i32 = 0;
/// Token id of `<s>` (beginning of sequence).
pub const BOS: i32 = 1;
/// Token id of `</s>` (end of sequence).
pub const EOS: i32 = 2;
/// Number of tokens: three specials and 256 bytes.
pub const N_VOCAB: u64 = 3 + 256;

// llama.cpp's token attributes (enum llama_token_type).
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_BYTE: i32 = 6;

/// The `tokenizer.ggml.*` metadata entries.
pub fn metadata() -> Vec<(String, Value)> {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    let mut types = vec![TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL];
    types.extend(std::iter::repeat_n(TYPE_BYTE, 256));
    let scores = vec![0.0f32; tokens.len()];
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
    ]
}
