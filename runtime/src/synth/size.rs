//! Picking dimensions to hit a target file size (`sluice synth --size 2GiB`).

use super::SynthSpec;

/// Why a target size cannot be met.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("--size {target} bytes is too small: the dense weights alone take about {dense} bytes and one block-width of expert FFN about {step} more; lower --layers, --experts or --embd")]
pub struct SizeError {
    /// The requested size.
    pub target: u64,
    /// Estimated bytes of everything that does not grow with the expert FFN width.
    pub dense: u64,
    /// Estimated bytes added per block-width of expert FFN.
    pub step: u64,
}

/// The expert FFN width (a multiple of the output type's block width) that brings the model
/// closest to `target` bytes without going over, keeping every other dimension of `spec`. The
/// estimated size is linear in the width (routed and shared experts, dense layers sized from it),
/// so two widths give its slope and intercept.
pub fn fit_expert_ff(spec: &SynthSpec, target: u64) -> Result<u32, SizeError> {
    let w = spec.out_type.block_width();
    let size_at = |ff: u32| SynthSpec { expert_ff: ff, ..spec.clone() }.estimated_bytes(|_| true);
    let (one, two) = (size_at(w), size_at(2 * w));
    let per_ff = (two - one) / f64::from(w);
    let fixed = one - per_ff * f64::from(w);
    let err = SizeError { target, dense: fixed.max(0.0) as u64, step: (per_ff * f64::from(w)) as u64 };
    let room = target as f64 - fixed;
    if room <= 0.0 || per_ff <= 0.0 {
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
    use crate::synth::{OutputType, SynthArch};

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
        for arch in [SynthArch::Qwen3moe, SynthArch::Deepseek2, SynthArch::GptOss] {
            let spec = SynthSpec { arch, ..spec.clone() };
            let ff = fit_expert_ff(&spec, target).unwrap();
            let est = SynthSpec { expert_ff: ff, ..spec.clone() }.estimated_bytes(|_| true);
            assert!(est <= target as f64 && est > 0.98 * target as f64, "{arch:?}: {est} vs {target}");
        }
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
