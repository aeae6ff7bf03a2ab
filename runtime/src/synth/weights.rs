//! Deterministic random weights.
//!
//! Each tensor draws from its own ChaCha8 stream (the seed, and the tensor's index as the stream
//! number), so the bytes of a tensor depend only on the seed, its index and its shape, and a
//! model of many GiB is produced one chunk at a time.

use std::io::{self, Write};

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::gguf_writer::TensorType;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// Every element 1.0 (norm weights).
    Ones,
    /// Uniform in `[-a, a]` with `a = gain * sqrt(3 / fan_in)`, so each output of a product with a
    /// unit-variance input has variance `gain²`.
    Uniform {
        /// Output scale.
        gain: f32,
        /// Input width (`ne[0]`).
        fan_in: u64,
    },
    /// These values, in order (a calibrated router bias).
    Values(std::sync::Arc<[f32]>),
}

const CHUNK: usize = 1 << 16;

/// Writes `n` elements of type `ty` drawn by `init` from stream `stream` of `seed`.
pub fn write_values(
    out: &mut dyn Write,
    seed: u64,
    stream: u64,
    n: u64,
    ty: TensorType,
    init: &Init,
) -> io::Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    let bound = match *init {
        Init::Ones | Init::Values(_) => 0.0,
        Init::Uniform { gain, fan_in } => gain * (3.0 / fan_in.max(1) as f32).sqrt(),
    };
    let mut given = 0usize;
    let mut buf = Vec::with_capacity(CHUNK * ty.element_size() as usize);
    let mut left = n;
    while left > 0 {
        let take = left.min(CHUNK as u64) as usize;
        buf.clear();
        for _ in 0..take {
            let v = match init {
                Init::Ones => 1.0,
                Init::Values(values) => {
                    given += 1;
                    values.get(given - 1).copied().unwrap_or(0.0)
                }
                // 24 random bits → [0, 1) exactly representable in f32, then → [-bound, bound).
                Init::Uniform { .. } => ((rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * bound,
            };
            match ty {
                TensorType::F32 => buf.extend_from_slice(&v.to_le_bytes()),
                TensorType::F16 => buf.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            }
        }
        out.write_all(&buf)?;
        left -= take as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(seed: u64, stream: u64) -> Vec<u8> {
        let mut v = Vec::new();
        write_values(&mut v, seed, stream, 100, TensorType::F32, &Init::Uniform { gain: 1.0, fan_in: 3 }).unwrap();
        v
    }

    #[test]
    fn same_seed_and_stream_give_same_bytes_and_others_differ() {
        assert_eq!(draw(1, 0), draw(1, 0));
        assert_ne!(draw(1, 0), draw(1, 1));
        assert_ne!(draw(1, 0), draw(2, 0));
    }

    #[test]
    fn values_stay_within_the_bound() {
        let bytes = draw(7, 3);
        for c in bytes.chunks(4) {
            let v = f32::from_le_bytes(c.try_into().unwrap());
            assert!(v.abs() <= 1.0 + 1e-6, "{v}");
        }
    }
}
