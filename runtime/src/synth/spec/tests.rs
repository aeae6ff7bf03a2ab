use super::*;
use crate::synth::gguf_writer::TensorSpec;

/// gpt-oss-120b's shape as `make bench-board-120b` draws it.
fn gpt_oss_120b() -> SynthSpec {
    SynthSpec {
        arch: SynthArch::GptOss,
        layers: 36,
        embd: 2880,
        heads: 64,
        kv_heads: 8,
        key_length: Some(64),
        experts: 128,
        experts_used: 2,
        expert_ff: 2880,
        vocab_size: Some(201_088),
        sliding_window: Some(128),
        out_type: OutputType::Q4KMDrawn,
        ..SynthSpec::default()
    }
}

/// Layer `il`'s tensors: (routed expert weights' bytes per expert, every other tensor's bytes).
fn layer_bytes(t: &[TensorSpec], il: u32, experts: u64) -> (u64, u64) {
    let prefix = format!("blk.{il}.");
    let of_layer = || t.iter().filter(|t| t.name.starts_with(&prefix));
    let is_expert = |t: &&TensorSpec| t.name.contains("_exps.weight");
    let expert: u64 = of_layer().filter(is_expert).map(TensorSpec::n_bytes).sum();
    let dense: u64 = of_layer().filter(|t| !is_expert(t)).map(TensorSpec::n_bytes).sum();
    (expert / experts, dense)
}

/// The published gpt-oss-120b Q4_K_M file's bytes per layer, as the recorded trace's header gives
/// them (`../shared/traces/bigmoeonedge-2026-07-15/gptoss.route.csv`): 13,219,200 B an expert (its
/// three MXFP4 matrices), and 23,280,128 B of everything else in the layers llama.cpp gives more
/// bits (`attn_v` in Q8_0, as its Q6_K falls back for rows of 2,880) and 22,727,168 B in the others
/// (`attn_v` in Q5_0). The drawn file has the same.
#[test]
fn drawn_gpt_oss_120b_has_the_published_files_bytes_per_layer() {
    let spec = gpt_oss_120b();
    spec.validate().unwrap();
    let t: Vec<TensorSpec> = arch::tensors(&spec, None).into_iter().map(|(t, _)| t).collect();
    let more_bits = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35];
    for il in 0..36 {
        let dense = if more_bits.contains(&il) { 23_280_128 } else { 22_727_168 };
        assert_eq!(layer_bytes(&t, il, 128), (13_219_200, dense), "layer {il}");
    }
    let ty = |name: &str| t.iter().find(|t| t.name == name).unwrap().ty;
    assert_eq!(ty("output.weight"), TensorType::Q8_0);
    assert_eq!(ty("token_embd.weight"), TensorType::Q5_0);
    assert_eq!(ty("blk.0.attn_output.weight"), TensorType::Q4K, "4,096-wide rows keep Q4_K");
    let total: u64 = t.iter().map(TensorSpec::n_bytes).sum();
    assert!((62_000_000_000..64_000_000_000).contains(&total), "about 63 GB: {total}");
}

/// Rows of a multiple of 256 keep the k-quants: Qwen3-30B-A3B's shape draws no fallback type.
#[test]
fn drawn_k_quants_stay_where_rows_fit_their_blocks() {
    let spec =
        SynthSpec { embd: 2048, expert_ff: 768, layers: 8, out_type: OutputType::Q4KMDrawn, ..Default::default() };
    let t = arch::tensors(&spec, None);
    let types = |pick: &dyn Fn(&TensorSpec) -> bool| {
        let mut v: Vec<TensorType> = t.iter().filter(|(t, _)| pick(t)).map(|(t, _)| t.ty).collect();
        v.dedup();
        v
    };
    assert_eq!(types(&|t| t.name == "output.weight"), [TensorType::Q6K]);
    assert_eq!(
        types(&|t| t.name.starts_with("blk.6.attn_v") || t.name.starts_with("blk.6.ffn_down_exps")),
        [TensorType::Q6K]
    );
    assert_eq!(
        types(&|t| t.name.starts_with("blk.5.attn_v") || t.name.starts_with("blk.5.ffn_down_exps")),
        [TensorType::Q4K]
    );
    let matrices = types(&|t| t.ne.len() > 1 && !t.name.contains("ffn_gate_inp"));
    assert!(matrices.iter().all(|ty| matches!(ty, TensorType::Q4K | TensorType::Q6K)), "{matrices:?}");
}
