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
    if ty.block_elements() > 1 {
        return write_blocks(out, &mut rng, n / ty.block_elements(), ty, bound);
    }
    let mut given = 0usize;
    let mut buf = Vec::with_capacity(CHUNK * ty.block_bytes() as usize);
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
                _ => buf.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            }
        }
        out.write_all(&buf)?;
        left -= take as u64;
    }
    Ok(())
}

/// Writes `blocks` k-quant blocks of `ty` whose values are spread evenly over
/// `[-bound, bound]`: every sub-block's scale the same, the quants drawn from `rng` (no float
/// values are drawn and quantized: a model of tens of GB is written at the disk's speed).
///
/// Q4_K: a value is `d * 32 * q - dmin * 32` for a quant `q` in 0..16, so `dmin = 7.5 d` centres
/// it and `d = bound / 240` bounds it. Q6_K: `d * 32 * (q - 32)` for `q` in 0..64, `d = bound /
/// 1024`.
fn write_blocks(out: &mut dyn Write, rng: &mut ChaCha8Rng, blocks: u64, ty: TensorType, bound: f32) -> io::Result<()> {
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let mut block = vec![0u8; ty.block_bytes() as usize];
    let quants = match ty {
        TensorType::Q4K => {
            let d = half::f16::from_f32(bound / 240.0);
            block[..2].copy_from_slice(&d.to_le_bytes());
            block[2..4].copy_from_slice(&f16(7.5 * d.to_f32()));
            // Six-bit scale and min 32 for all eight sub-blocks, packed as ggml's
            // `get_scale_min_k4` reads them.
            block[4..12].fill(0xA0);
            block[12..16].fill(0);
            16..144
        }
        _ => {
            block[192..208].fill(32);
            block[208..210].copy_from_slice(&f16(bound / 1024.0));
            0..192
        }
    };
    let mut buf = Vec::with_capacity(CHUNK * block.len());
    let mut left = blocks;
    while left > 0 {
        let take = left.min(CHUNK as u64);
        buf.clear();
        for _ in 0..take {
            rng.fill_bytes(&mut block[quants.clone()]);
            buf.extend_from_slice(&block);
        }
        out.write_all(&buf)?;
        left -= take;
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

    #[test]
    fn drawn_k_quant_blocks_decode_within_the_bound_and_centred() {
        let bound = 0.5f32;
        for (ty, n) in [(TensorType::Q4K, 144), (TensorType::Q6K, 210)] {
            let mut v = Vec::new();
            write_values(&mut v, 3, 1, 512, ty, &Init::Uniform { gain: bound / 3f32.sqrt(), fan_in: 1 }).unwrap();
            assert_eq!(v.len(), 2 * n, "{ty:?}");
            let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            let values: Vec<f32> = match ty {
                TensorType::Q4K => {
                    let (d, dmin) = (f16(&v[0..2]), f16(&v[2..4]));
                    v[16..144]
                        .iter()
                        .flat_map(|&q| [q & 15, q >> 4])
                        .map(|q| d * 32.0 * f32::from(q) - dmin * 32.0)
                        .collect()
                }
                _ => {
                    let d = f16(&v[208..210]);
                    v[0..128].iter().flat_map(|&q| [q & 15, q >> 4]).map(|q| d * 32.0 * (f32::from(q) - 8.0)).collect()
                }
            };
            assert!(values.iter().all(|x| x.abs() <= bound * 1.01), "{ty:?}");
            let mean = values.iter().sum::<f32>() / values.len() as f32;
            assert!(mean.abs() < bound / 4.0, "{ty:?}: mean {mean}");
        }
    }
}
