//! The vocabulary: token strings, and byte tokens only where the tokenizer reads them.

use std::collections::HashMap;

use ggml_sys::GgufFile;

use super::MetadataError;

/// llama.cpp's tokenizers that turn byte tokens (`<0xNN>`, token type 6) back into bytes; any
/// other one aborts on the first byte token when the vocabulary's pieces are cached at load.
const BYTE_TOKENIZERS: [&str; 6] = ["llama", "gpt2", "hybriddna", "whitespace", "gemma4", "t5"];

/// A token type: a byte token.
const BYTE_TOKEN: i64 = 6;

/// Token strings, and byte tokens.
pub(super) fn check(gguf: &GgufFile) -> Result<(), MetadataError> {
    check_strings(gguf)?;
    check_byte_tokens(gguf)
}

/// Byte tokens only in a vocabulary whose tokenizer reads them.
fn check_byte_tokens(gguf: &GgufFile) -> Result<(), MetadataError> {
    const MODEL: &str = "tokenizer.ggml.model";
    let Some(model) = gguf.get_str(MODEL) else { return Ok(()) };
    if BYTE_TOKENIZERS.contains(&model.as_str()) {
        return Ok(());
    }
    let types = gguf.array_u32("tokenizer.ggml.token_type").unwrap_or_default();
    match types.iter().position(|&t| t == BYTE_TOKEN) {
        Some(id) => Err(MetadataError::new(
            MODEL,
            format!(
                "is {:?}, whose tokenizer has no byte tokens, but token {id} is one (token type {BYTE_TOKEN}); byte tokens belong to {}",
                crate::text::excerpt(&model, 64),
                BYTE_TOKENIZERS.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

/// Token strings: none may appear twice (llama.cpp maps text to tokens one to one).
fn check_strings(gguf: &GgufFile) -> Result<(), MetadataError> {
    const TOKENS: &str = "tokenizer.ggml.tokens";
    let Some(tokens) = gguf.array_strings(TOKENS) else { return Ok(()) };
    let mut seen: HashMap<&[u8], usize> = HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        if let Some(first) = seen.insert(t, id) {
            return Err(MetadataError::new(
                TOKENS,
                format!("holds {:?} twice (tokens {first} and {id})", String::from_utf8_lossy(t)),
            ));
        }
    }
    Ok(())
}
