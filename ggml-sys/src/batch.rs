//! A batch of tokens for `llama_decode`.

use llama_cpp_sys_2 as sys;

use crate::{Error, Result, Token};

/// A token batch with a fixed capacity; each token belongs to one sequence.
pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
}

impl Batch {
    /// A batch that holds up to `capacity` tokens.
    pub fn new(capacity: usize) -> Batch {
        let capacity = capacity.clamp(1, i32::MAX as usize);
        // SAFETY: allocates arrays for `capacity` tokens with one sequence id each.
        let raw = unsafe { sys::llama_batch_init(capacity as i32, 0, 1) };
        Batch { raw, capacity }
    }

    /// Empties the batch.
    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// The most tokens the batch holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of tokens in the batch.
    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    /// Whether the batch holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.raw.n_tokens == 0
    }

    /// Appends `token` at position `pos` of sequence 0; `logits` asks llama.cpp to keep this
    /// position's logits.
    pub fn push(&mut self, token: Token, pos: i32, logits: bool) -> Result<()> {
        self.push_to(0, token, pos, logits)
    }

    /// Appends `token` at position `pos` of sequence `seq` (a sequence the context does not keep
    /// fails the decode, which llama.cpp checks).
    pub fn push_to(&mut self, seq: u32, token: Token, pos: i32, logits: bool) -> Result<()> {
        let seq = i32::try_from(seq).map_err(|_| Error::NoSequence { seq, n_seq: crate::MAX_SEQUENCES })?;
        let i = self.len();
        if i >= self.capacity {
            return Err(Error::BatchFull { capacity: self.capacity });
        }
        // SAFETY: llama_batch_init allocated `capacity` entries in each array (and one seq id per
        // entry); i < capacity.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq;
            *self.raw.logits.add(i) = i8::from(logits);
        }
        self.raw.n_tokens += 1;
        Ok(())
    }

    pub(crate) fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: raw came from llama_batch_init and is freed exactly once.
        unsafe { sys::llama_batch_free(self.raw) };
    }
}
