//! The architectures whose streaming a gate verifies: streamed greedy output equal to resident,
//! token for token, on fixtures `sluice synth --arch` writes in their layout.
//!
//! Any other architecture streams by the generic rule of [`crate::stream::index`] (every
//! `blk.<il>.*_exps.weight` of the expert count), guarded by the warm-up's checks: every indexed
//! expert tensor must be used, and only by a routed matrix product whose expert ids are its own
//! layer's `ffn_moe_topk-<il>` node, so that every byte a layer reads has been made resident.
//! It logs that it is not verified.

/// One verified architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    /// `general.architecture` value.
    pub arch: &'static str,
    /// The layouts its gates cover.
    pub layouts: &'static str,
}

/// The architectures gates verify (tests/tests/streaming.rs, fixtures of tests/src/lib.rs).
pub const VERIFIED: &[Verified] = &[
    Verified {
        arch: "qwen3moe",
        layouts: "split gate/up/down experts; f32, f16, Q8_0, Q4_K_M, Q6_K, unaligned slices, split files",
    },
    Verified {
        arch: "deepseek2",
        layouts: "latent attention, shared expert, sigmoid routing with expert groups, a leading dense layer, a NextN block; split and fused gate/up experts",
    },
    Verified { arch: "gpt-oss", layouts: "per-expert biases, MXFP4 experts, attention sinks, sliding-window layers" },
];

/// Whether a gate verifies `arch`.
pub fn is_verified(arch: &str) -> bool {
    VERIFIED.iter().any(|v| v.arch == arch)
}

/// The list as `sluice run --list-archs` prints it.
pub fn table() -> String {
    let mut out = format!("{:<10} {}\n", "verified", "layouts its gates cover");
    for v in VERIFIED {
        out.push_str(&format!("{:<10} {}\n", v.arch, v.layouts));
    }
    out.push_str(
        "\nEvery other MoE architecture of this llama.cpp streams by the generic rule: each \
         blk.<layer>.*_exps.weight tensor holding <arch>.expert_count experts (split or fused \
         gate/up, down) streams; shared experts, per-expert biases and NextN blocks do not. The \
         warm-up checks that each such tensor is used only by its layer's routed product \
         (ffn_moe_topk-<layer>) and fails with the tensor's name otherwise. Such a model logs that \
         it is not verified: compare its output with --resident once.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gated_architectures_are_verified_and_listed() {
        for arch in ["qwen3moe", "deepseek2", "gpt-oss"] {
            assert!(is_verified(arch), "{arch}");
            assert!(table().contains(arch));
        }
        assert!(!is_verified("glm4moe"));
        assert!(table().contains("generic rule"));
    }
}
