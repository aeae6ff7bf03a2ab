//! Picking dimensions to hit a target file size (`sluice synth --size 2GiB`).

use super::{vocab, SynthSpec};

/// Why a target size cannot be met.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("--size {target} bytes is too small: the dense weights alone take about {dense} bytes and one block-width of expert FFN about {step} more; lower --layers, --experts or --embd")]
pub struct SizeError {
    /// The requested size.
    pub target: u64,
    /// Estimated bytes of everything but the experts.
    pub dense: u64,
    /// Estimated bytes added per block-width of expert FFN.
    pub step: u64,
}

/// Estimated bytes of everything but the routed experts.
fn dense_bytes(spec: &SynthSpec) -> f64 {
    let bpw = spec.out_type.bytes_per_weight();
    let (e, v) = (f64::from(spec.embd), vocab::N_VOCAB as f64);
    let hd = f64::from(spec.head_dim());
    let attn = e * hd * f64::from(2 * spec.heads + 2 * spec.kv_heads);
    let router = e * f64::from(spec.experts);
    let norms = 4.0 * (3.0 * e + 2.0 * hd);
    2.0 * e * v * bpw + f64::from(spec.layers) * ((attn + router) * bpw + norms)
}

/// The expert FFN width (a multiple of the output type's block width) that brings the model
/// closest to `target` bytes without going over, keeping every other dimension of `spec`.
pub fn fit_expert_ff(spec: &SynthSpec, target: u64) -> Result<u32, SizeError> {
    let bpw = spec.out_type.bytes_per_weight();
    let per_ff = 3.0 * f64::from(spec.embd) * f64::from(spec.experts) * f64::from(spec.layers) * bpw;
    let dense = dense_bytes(spec);
    let w = spec.out_type.block_width();
    let err = SizeError { target, dense: dense as u64, step: (per_ff * f64::from(w)) as u64 };
    let room = target as f64 - dense;
    if room <= 0.0 {
        return Err(err);
    }
    let ff = (room / per_ff) as u64 / u64::from(w) * u64::from(w);
    if ff == 0 || ff > u64::from(u32::MAX) {
        return Err(err);
    }
    Ok(ff as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::OutputType;

    #[test]
    fn fits_within_a_few_percent_and_respects_blocks() {
        let spec = SynthSpec {
            layers: 8,
            embd: 512,
            heads: 8,
            kv_heads: 4,
            experts: 32,
            experts_used: 4,
            ..Default::default()
        };
        let target = 2u64 << 30;
        let ff = fit_expert_ff(&spec, target).unwrap();
        let fitted = SynthSpec { expert_ff: ff, ..spec.clone() };
        let est = dense_bytes(&fitted) + fitted.expert_bytes() as f64;
        assert!(est <= target as f64 && est > 0.98 * target as f64, "{est} vs {target}");
        let q = SynthSpec { out_type: OutputType::Q4KM, ..spec };
        assert_eq!(fit_expert_ff(&q, target).unwrap() % 256, 0);
    }

    #[test]
    fn too_small_is_an_error() {
        let err = fit_expert_ff(&SynthSpec::default(), 1000).unwrap_err();
        assert_eq!(err.target, 1000);
        assert!(err.to_string().contains("too small"));
    }
}
