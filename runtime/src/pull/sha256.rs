//! A SHA-256 whose state can be saved and taken up again, so that a pull interrupted after 17 of
//! 18 GB checks the file's digest without reading the 17 GB again: the compression function is
//! `sha2`'s (hardware-accelerated where the CPU has it), the block buffering and padding are
//! here, and the state is a few dozen bytes.

use serde::{Deserialize, Serialize};
use sha2::digest::generic_array::GenericArray;

/// SHA-256's initial hash value (FIPS 180-4, 5.3.3).
const H0: [u32; 8] = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

/// A running SHA-256 that serializes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sha256State {
    h: [u32; 8],
    /// Bytes hashed so far, the buffered ones included.
    len: u64,
    /// Bytes short of a whole 64-byte block.
    pending: Vec<u8>,
}

impl Default for Sha256State {
    fn default() -> Self {
        Sha256State { h: H0, len: 0, pending: Vec::with_capacity(64) }
    }
}

impl Sha256State {
    /// Bytes hashed so far.
    #[allow(clippy::len_without_is_empty)] // a digest's length, not a collection's
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Hashes `data` after what came before.
    pub fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if !self.pending.is_empty() {
            let take = (64 - self.pending.len()).min(data.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.pending.len() < 64 {
                return;
            }
            let block = *GenericArray::from_slice(&self.pending);
            sha2::compress256(&mut self.h, &[block]);
            self.pending.clear();
        }
        let whole = data.len() / 64 * 64;
        if whole > 0 {
            let blocks: Vec<_> = data[..whole].chunks_exact(64).map(|c| *GenericArray::from_slice(c)).collect();
            sha2::compress256(&mut self.h, &blocks);
        }
        self.pending.extend_from_slice(&data[whole..]);
    }

    /// The digest of everything hashed, in lowercase hex.
    pub fn finish_hex(&self) -> String {
        let mut h = self.h;
        let mut tail = self.pending.clone();
        tail.push(0x80);
        while tail.len() % 64 != 56 {
            tail.push(0);
        }
        tail.extend_from_slice(&(self.len * 8).to_be_bytes());
        let blocks: Vec<_> = tail.chunks_exact(64).map(|c| *GenericArray::from_slice(c)).collect();
        sha2::compress256(&mut h, &blocks);
        h.iter().map(|w| format!("{w:08x}")).collect()
    }

    /// Whether the state can be what it claims: a pending buffer of `len mod 64` bytes.
    pub fn is_consistent(&self) -> bool {
        self.pending.len() as u64 == self.len % 64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn reference(data: &[u8]) -> String {
        Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn equals_sha2_for_every_split_and_length() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for len in [0, 1, 55, 56, 63, 64, 65, 119, 128, 999, 1000] {
            for cut in [0, 1, 31, 63, 64, 100].into_iter().filter(|&c| c <= len) {
                let mut s = Sha256State::default();
                s.update(&data[..cut]);
                s.update(&data[cut..len]);
                assert_eq!(s.finish_hex(), reference(&data[..len]), "len {len}, cut {cut}");
                assert!(s.is_consistent());
            }
        }
    }

    #[test]
    fn a_saved_state_goes_on_where_it_stopped() {
        let data = vec![0xa5u8; 4097];
        let mut s = Sha256State::default();
        s.update(&data[..1234]);
        let saved = postcard::to_allocvec(&s).unwrap();
        let mut back: Sha256State = postcard::from_bytes(&saved).unwrap();
        back.update(&data[1234..]);
        assert_eq!(back.finish_hex(), reference(&data));
        assert_eq!(back.len(), 4097);
    }

    #[test]
    fn the_empty_digest_is_sha256s() {
        assert_eq!(
            Sha256State::default().finish_hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
