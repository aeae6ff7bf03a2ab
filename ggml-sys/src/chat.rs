//! Chat prompts formatted with llama.cpp's built-in template engine.

use std::ffi::CString;

use llama_cpp_sys_2 as sys;

use crate::{Error, Result};

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// Formats `messages` with `template` (a model's `tokenizer.chat_template`, or the name of a
/// template llama.cpp knows, such as `chatml`), ending with the start of an assistant turn.
/// A template llama.cpp does not recognise is [`Error::ChatTemplate`].
pub fn apply_chat_template(template: &str, messages: &[ChatMessage]) -> Result<String> {
    let tmpl = CString::new(template).map_err(|e| Error::TextNul(e.nul_position()))?;
    let owned: Vec<(CString, CString)> = messages
        .iter()
        .map(|m| Ok((CString::new(m.role.as_str())?, CString::new(m.content.as_str())?)))
        .collect::<std::result::Result<_, std::ffi::NulError>>()
        .map_err(|e| Error::TextNul(e.nul_position()))?;
    let chat: Vec<sys::llama_chat_message> =
        owned.iter().map(|(r, c)| sys::llama_chat_message { role: r.as_ptr(), content: c.as_ptr() }).collect();
    let text_len: usize = messages.iter().map(|m| m.role.len() + m.content.len()).sum();
    let mut buf = vec![0u8; 2 * text_len + 256];
    for _ in 0..2 {
        let cap = i32::try_from(buf.len()).map_err(|_| Error::Tokenize("chat too long".into()))?;
        // SAFETY: tmpl and every role/content pointer are NUL-terminated strings alive for the
        // call (owned above); chat holds chat.len() entries; buf is writable for cap bytes and
        // llama.cpp writes at most that many.
        let n = unsafe {
            crate::shim::sluice_chat_apply_template(
                tmpl.as_ptr(),
                chat.as_ptr(),
                chat.len(),
                true,
                buf.as_mut_ptr().cast(),
                cap,
            )
        };
        crate::shim::caught("llama_chat_apply_template")?;
        if n < 0 {
            return Err(Error::ChatTemplate { template: template.chars().take(60).collect() });
        }
        if (n as usize) <= buf.len() {
            buf.truncate(n as usize);
            return String::from_utf8(buf).map_err(|e| Error::Tokenize(format!("chat template output: {e}")));
        }
        buf.resize(n as usize, 0);
    }
    Err(Error::Tokenize("llama_chat_apply_template kept asking for a larger buffer".into()))
}
