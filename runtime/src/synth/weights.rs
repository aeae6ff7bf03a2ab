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
    /// [`Init::Uniform`], but element `dim` of each row of `row_len` elements (or of row `row`
    /// alone) is `value`: a direction every token's embedding shares, and the one output row that
    /// reads it (a model that favours one token).
    Marked {
        /// Output scale.
        gain: f32,
        /// Input width, for the scale.
        fan_in: u64,
        /// Elements of a row (`ne[0]`).
        row_len: u64,
        /// The element of a row that is set.
        dim: u64,
        /// Its value.
        value: f32,
        /// The one row set; `None`: every row.
        row: Option<u64>,
    },
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
        Init::Uniform { gain, fan_in } | Init::Marked { gain, fan_in, .. } => {
            gain * (3.0 / fan_in.max(1) as f32).sqrt()
        }
    };
    if ty.block_elements() > 1 {
        return write_blocks(out, &mut rng, n / ty.block_elements(), ty, bound);
    }
    let mut given = 0usize;
    let mut at = 0u64;
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
                &Init::Marked { row_len, dim, value, row, .. } => {
                    let drawn = ((rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * bound;
                    let marked = at % row_len.max(1) == dim && row.is_none_or(|r| at / row_len.max(1) == r);
                    if marked {
                        value
                    } else {
                        drawn
                    }
                }
            };
            at += 1;
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

/// Writes `blocks` quantized blocks of `ty` whose values are spread evenly over
/// `[-bound, bound]`: every block's (and sub-block's) scale the same, the quants drawn from `rng`
/// (no float values are drawn and quantized: a model of tens of GB is written at the disk's
/// speed).
///
/// Q4_K: a value is `d * 32 * q - dmin * 32` for a quant `q` in 0..16, so `dmin = 7.5 d` centres
/// it and `d = bound / 240` bounds it. Q6_K: `d * 32 * (q - 32)` for `q` in 0..64, `d = bound /
/// 1024`. Q5_0: `d * (q - 16)` for `q` in 0..32, `d = bound / 16`. Q8_0: `d * q` for `q` in
/// -128..128, `d = bound / 128`. MXFP4: `2^(e - 128) * k` for `k` one of E2M1's doubled values
/// (0 to ±12), the power of two `e` sets the largest at or below the bound.
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
        TensorType::Q6K => {
            block[192..208].fill(32);
            block[208..210].copy_from_slice(&f16(bound / 1024.0));
            0..192
        }
        TensorType::Q5_0 => {
            block[..2].copy_from_slice(&f16(bound / 16.0));
            2..22
        }
        TensorType::Q8_0 => {
            block[..2].copy_from_slice(&f16(bound / 128.0));
            2..34
        }
        TensorType::Mxfp4 => {
            block[0] = mxfp4_exponent(bound);
            1..17
        }
        TensorType::F32 | TensorType::F16 => unreachable!("float types are written as values"),
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

/// The E8M0 exponent of an MXFP4 block whose largest value (12 × 2^(e − 128), ggml reading a
/// block as `kvalues_mxfp4[q] * 2^(e - 127) / 2`) is the largest power-of-two step at or below
/// `bound`; 0 (the smallest scale) for a zero bound.
fn mxfp4_exponent(bound: f32) -> u8 {
    if bound <= 0.0 {
        return 0;
    }
    (128.0 + (bound / 12.0).log2().floor()).clamp(0.0, 254.0) as u8
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

    /// A Q4_K block's 256 values as ggml's `dequantize_row_q4_K` reads them (its six-bit scales
    /// and mins unpacked as `get_scale_min_k4` does).
    fn q4_k_values(b: &[u8]) -> Vec<f32> {
        let f16 = |x: &[u8]| half::f16::from_le_bytes([x[0], x[1]]).to_f32();
        let (d, dmin, sc, qs) = (f16(&b[0..2]), f16(&b[2..4]), &b[4..16], &b[16..144]);
        let scale_min = |j: usize| -> (f32, f32) {
            let (s, m) = if j < 4 {
                (sc[j] & 63, sc[j + 4] & 63)
            } else {
                ((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4))
            };
            (f32::from(s), f32::from(m))
        };
        let mut out = Vec::new();
        for (pair, q) in qs.chunks(32).enumerate() {
            for (half, shift) in [(0, 0), (1, 4)] {
                let (s, m) = scale_min(2 * pair + half);
                out.extend(q.iter().map(|&x| d * s * f32::from((x >> shift) & 15) - dmin * m));
            }
        }
        out
    }

    /// A Q6_K block's 256 values as ggml's `dequantize_row_q6_K` reads them.
    fn q6_k_values(b: &[u8]) -> Vec<f32> {
        let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
        let d = half::f16::from_le_bytes([b[208], b[209]]).to_f32();
        let mut out = vec![0.0; 256];
        for n in 0..2 {
            let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
            for l in 0..32 {
                let q = |low: u8, bits: u8| f32::from(low | (bits & 3) << 4) - 32.0;
                let scale = |k: usize| d * f32::from(sc[l / 16 + k] as i8);
                out[128 * n + l] = scale(0) * q(ql[l] & 15, qh[l]);
                out[128 * n + l + 32] = scale(2) * q(ql[l + 32] & 15, qh[l] >> 2);
                out[128 * n + l + 64] = scale(4) * q(ql[l] >> 4, qh[l] >> 4);
                out[128 * n + l + 96] = scale(6) * q(ql[l + 32] >> 4, qh[l] >> 6);
            }
        }
        out
    }

    /// A Q5_0 block's 32 values as ggml's `dequantize_row_q5_0` reads them.
    fn q5_0_values(b: &[u8]) -> Vec<f32> {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
        let mut out = vec![0.0; 32];
        for (j, &q) in b[6..22].iter().enumerate() {
            let high = |bit: u32| ((qh >> bit) & 1) as u8;
            out[j] = d * (f32::from(q & 15 | high(j as u32) << 4) - 16.0);
            out[j + 16] = d * (f32::from(q >> 4 | high(j as u32 + 16) << 4) - 16.0);
        }
        out
    }

    /// A Q8_0 block's 32 values.
    fn q8_0_values(b: &[u8]) -> Vec<f32> {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        b[2..34].iter().map(|&q| d * f32::from(q as i8)).collect()
    }

    /// An MXFP4 block's 32 values as ggml's `dequantize_row_mxfp4` reads them.
    fn mxfp4_values(b: &[u8]) -> Vec<f32> {
        const K: [f32; 16] = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0];
        let d = (f32::from(b[0]) - 128.0).exp2();
        let mut out = vec![0.0; 32];
        for (j, &q) in b[1..17].iter().enumerate() {
            out[j] = K[usize::from(q & 15)] * d;
            out[j + 16] = K[usize::from(q >> 4)] * d;
        }
        out
    }

    /// A decoder of one block's bytes.
    type Decode = fn(&[u8]) -> Vec<f32>;

    #[test]
    fn drawn_blocks_decode_within_the_bound_and_centred() {
        let bound = 0.5f32;
        let types: [(TensorType, Decode); 5] = [
            (TensorType::Q4K, q4_k_values),
            (TensorType::Q6K, q6_k_values),
            (TensorType::Q5_0, q5_0_values),
            (TensorType::Q8_0, q8_0_values),
            (TensorType::Mxfp4, mxfp4_values),
        ];
        for (ty, decode) in types {
            let n = ty.block_bytes() as usize;
            let mut v = Vec::new();
            write_values(&mut v, 3, 1, 512, ty, &Init::Uniform { gain: bound / 3f32.sqrt(), fan_in: 1 }).unwrap();
            assert_eq!(v.len(), 512 / ty.block_elements() as usize * n, "{ty:?}");
            let values: Vec<f32> = v.chunks(n).flat_map(decode).collect();
            assert_eq!(values.len(), 512);
            assert!(values.iter().all(|x| x.abs() <= bound * 1.01), "{ty:?}");
            // Every block's (sub-block's) scale reaches the bound's order (a packing mistake
            // leaves some at 0): the drawn quants span it, as a uniform init would.
            for sub in values.chunks(32) {
                assert!(sub.iter().any(|x| x.abs() >= bound * 0.25), "{ty:?}: a block stays near 0");
            }
            let mean = values.iter().sum::<f32>() / values.len() as f32;
            assert!(mean.abs() < bound / 4.0, "{ty:?}: mean {mean}");
        }
    }
}
