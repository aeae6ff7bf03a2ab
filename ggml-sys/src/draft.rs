//! Draft tokens from the context's own n-grams (llama.cpp's lookup decoding, through
//! `common_shim.cpp`): when the text repeats itself, the tokens that followed the same n-gram
//! before are proposed, as many as the statistics support, for the model to verify in one batch.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::chat::{chat_caught, made};
use crate::{Result, Token};

#[repr(C)]
struct RawDraft {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn sluice_ngram_draft_new() -> *mut RawDraft;
    fn sluice_ngram_draft_free(d: *mut RawDraft);
    fn sluice_ngram_draft_add(d: *mut RawDraft, tokens: *const sys::llama_token, n: usize);
    fn sluice_ngram_draft_make(d: *mut RawDraft, out: *mut sys::llama_token, max: usize) -> usize;
}

/// One generation's context and its n-gram statistics.
pub struct NgramDraft {
    raw: NonNull<RawDraft>,
}

// SAFETY: the draft state is plain data used from one thread at a time (&mut self; not Sync).
unsafe impl Send for NgramDraft {}

impl NgramDraft {
    /// An empty context.
    pub fn new() -> Result<NgramDraft> {
        // SAFETY: no arguments; returns a new object or null after an exception.
        let raw = unsafe { sluice_ngram_draft_new() };
        made("common_ngram_cache", raw).map(|raw| NgramDraft { raw })
    }

    /// Appends tokens to the context (the prompt, then each accepted token).
    pub fn add(&mut self, tokens: &[Token]) -> Result<()> {
        // SAFETY: live state; tokens is valid for tokens.len() elements.
        unsafe { sluice_ngram_draft_add(self.raw.as_ptr(), tokens.as_ptr(), tokens.len()) };
        chat_caught("common_ngram_cache_update")
    }

    /// Up to `max` tokens that may follow the context; none when nothing repeats.
    pub fn draft(&mut self, max: usize) -> Result<Vec<Token>> {
        let mut out = vec![0; max];
        // SAFETY: live state; out is writable for max elements and the shim writes at most max.
        let n = unsafe { sluice_ngram_draft_make(self.raw.as_ptr(), out.as_mut_ptr(), max) };
        chat_caught("common_ngram_cache_draft")?;
        out.truncate(n);
        Ok(out)
    }
}

impl Drop for NgramDraft {
    fn drop(&mut self) {
        // SAFETY: raw came from sluice_ngram_draft_new and is freed once.
        unsafe { sluice_ngram_draft_free(self.raw.as_ptr()) };
    }
}
