//! The architectures `sluice synth` writes: llama.cpp's tensor names, shapes and metadata keys for
//! each, at the spec's (small) sizes. Each layout exercises a different part of the streaming
//! engine: split or fused gate/up experts, shared experts, expert-group routing, per-expert
//! biases, quantized experts, leading dense layers and blocks llama.cpp does not run.

use super::gguf_writer::{TensorSpec, TensorType, Value};
use super::weights::Init;
use super::{reuse, routing};
use super::{vocab, SynthSpec};

/// An architecture `sluice synth` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthArch {
    /// Qwen3-MoE (`qwen3moe`): routed experts only, split gate/up/down.
    #[value(name = "qwen3moe")]
    Qwen3moe,
    /// DeepSeek-V3 style (`deepseek2`): multi-head latent attention, one shared expert, sigmoid
    /// routing with a score bias and expert-group selection, one leading dense layer, and a NextN
    /// (multi-token prediction) block after the last layer, which llama.cpp does not run.
    #[value(name = "deepseek2")]
    Deepseek2,
    /// gpt-oss (`gpt-oss`): attention sinks and biases, sliding-window layers, and per-expert
    /// biases beside the routed experts.
    #[value(name = "gpt-oss")]
    GptOss,
}

/// The sliding window of gpt-oss's local layers unless the spec names one: short, so the gates'
/// prompts cross it.
const GPT_OSS_WINDOW: u32 = 16;

impl SynthArch {
    /// `general.architecture`.
    pub fn name(self) -> &'static str {
        match self {
            SynthArch::Qwen3moe => "qwen3moe",
            SynthArch::Deepseek2 => "deepseek2",
            SynthArch::GptOss => "gpt-oss",
        }
    }
}

/// DeepSeek-V3-style dimensions derived from a spec: latent attention ranks and head splits, the
/// dense layer's width, and the expert groups.
struct Mla {
    /// Rotary part of each query/key head.
    rope: u64,
    /// Non-rotary part.
    nope: u64,
    /// Query low-rank width.
    q_lora: u64,
    /// Key/value latent width.
    kv_lora: u64,
    /// The leading dense layer's feed-forward width.
    dense_ff: u64,
    /// Expert groups (0: no group selection) and how many of them each token uses.
    groups: (u32, u32),
}

impl Mla {
    fn of(spec: &SynthSpec) -> Mla {
        let hd = u64::from(spec.head_dim());
        let e = u64::from(spec.embd);
        Mla {
            rope: hd / 4,
            nope: hd - hd / 4,
            q_lora: e / 2,
            kv_lora: e / 4,
            dense_ff: 2 * u64::from(spec.expert_ff),
            groups: deepseek_groups(spec.experts),
        }
    }
}

/// Expert groups of a deepseek2 fixture: four groups, two used per token, when the experts split
/// into four groups of at least two; else none.
pub fn deepseek_groups(experts: u32) -> (u32, u32) {
    if experts >= 8 && experts % 4 == 0 {
        (4, 2)
    } else {
        (0, 0)
    }
}

/// Builds a tensor table in file order.
struct Table {
    out: Vec<(TensorSpec, Init)>,
    out_type: super::OutputType,
    layers: u32,
    arch: SynthArch,
}

impl Table {
    fn push(&mut self, name: String, ne: Vec<u64>, ty: TensorType, init: Init) {
        self.out.push((TensorSpec { name, ne, ty }, init));
    }

    /// A weight matrix (or stack of them) in the spec's matrix type, `gain` over its first
    /// dimension.
    fn matrix(&mut self, name: String, ne: Vec<u64>, gain: f32) {
        let fan_in = ne[0];
        let ty = self.out_type.type_of(&name, fan_in, self.layers, self.arch);
        self.push(name, ne, ty, Init::Uniform { gain, fan_in });
    }

    /// A norm weight (ones, f32).
    fn norm(&mut self, name: String, n: u64) {
        self.push(name, vec![n], TensorType::F32, Init::Ones);
    }

    /// A bias or other small f32 vector of values in `[-0.5, 0.5]`.
    fn bias(&mut self, name: String, ne: Vec<u64>) {
        self.push(name, ne, TensorType::F32, Init::Uniform { gain: 0.5, fan_in: 3 });
    }
}

/// The first element of every embedding of a model that favours a token.
const FAVOUR_EMBEDDING: f32 = 8.0;
/// The first element of the favoured token's output row.
const FAVOUR_OUTPUT: f32 = 8.0;

/// The tensor table of `spec`, in file order, with how each tensor's values are drawn.
/// `router_bias` is skewed routing's bias profile (hottest expert first), which each gpt-oss
/// layer permutes into its router bias; `None` draws the bias at random (uniform routing, or a
/// table only sized).
pub fn tensors(spec: &SynthSpec, router_bias: Option<&[f32]>) -> Vec<(TensorSpec, Init)> {
    let (e, v) = (u64::from(spec.embd), vocab::n_vocab(spec.words, spec.chat_template.as_deref(), spec.vocab_size));
    let mut t = Table { out: Vec::new(), out_type: spec.out_type, layers: spec.layers, arch: spec.arch };
    // Embedding rows of about unit variance.
    let embd_type = spec.out_type.type_of("token_embd.weight", e, spec.layers, spec.arch);
    let favoured = spec.favour.as_deref().and_then(|t| vocab::token_id(t, spec.words, spec.chat_template.as_deref()));
    let (embd, output) = match favoured {
        None => (Init::Uniform { gain: 1.0, fan_in: 3 }, Init::Uniform { gain: 4.0, fan_in: e }),
        // Every embedding shares a large first element, which the favoured token's output row
        // alone reads: it leads the logits at every position, whatever the layers add.
        Some(token) => (
            Init::Marked { gain: 1.0, fan_in: 3, row_len: e, dim: 0, value: FAVOUR_EMBEDDING, row: None },
            Init::Marked { gain: 4.0, fan_in: e, row_len: e, dim: 0, value: FAVOUR_OUTPUT, row: Some(token) },
        ),
    };
    t.push("token_embd.weight".into(), vec![e, v], embd_type, embd);
    t.norm("output_norm.weight".into(), e);
    let output_type = spec.out_type.type_of("output.weight", e, spec.layers, spec.arch);
    t.push("output.weight".into(), vec![e, v], output_type, output);
    match spec.arch {
        SynthArch::Qwen3moe => (0..spec.layers).for_each(|il| qwen3moe_layer(spec, il, &mut t)),
        SynthArch::Deepseek2 => (0..=spec.layers).for_each(|il| deepseek2_layer(spec, il, &mut t)),
        SynthArch::GptOss => (0..spec.layers).for_each(|il| gpt_oss_layer(spec, il, router_bias, &mut t)),
    }
    t.out
}

/// `blk.<il>.<name>.weight`.
fn weight(il: u32, name: &str) -> String {
    format!("blk.{il}.{name}.weight")
}

/// `blk.<il>.<name>.bias`.
fn bias(il: u32, name: &str) -> String {
    format!("blk.{il}.{name}.bias")
}

/// Routed experts `ne[2]` deep: gate and up (fused into one tensor of twice the width, or
/// split), then down.
fn routed_experts(spec: &SynthSpec, il: u32, fused: bool, t: &mut Table) {
    let (e, ne, ff) = (u64::from(spec.embd), u64::from(spec.experts), u64::from(spec.expert_ff));
    if fused {
        t.matrix(weight(il, "ffn_gate_up_exps"), vec![e, 2 * ff, ne], 1.0);
    } else {
        t.matrix(weight(il, "ffn_gate_exps"), vec![e, ff, ne], 1.0);
        t.matrix(weight(il, "ffn_up_exps"), vec![e, ff, ne], 1.0);
    }
    t.matrix(weight(il, "ffn_down_exps"), vec![ff, e, ne], 1.0);
}

/// The router: a large gain makes top-k choices clear-cut, and since the router reads each
/// token's own hidden state, routing varies from token to token.
fn router(spec: &SynthSpec, il: u32, t: &mut Table) {
    t.matrix(weight(il, "ffn_gate_inp"), vec![u64::from(spec.embd), u64::from(spec.experts)], routing::ROUTER_GAIN);
}

fn qwen3moe_layer(spec: &SynthSpec, il: u32, t: &mut Table) {
    let e = u64::from(spec.embd);
    let (hd, nh, nkv) = (u64::from(spec.head_dim()), u64::from(spec.heads), u64::from(spec.kv_heads));
    t.norm(weight(il, "attn_norm"), e);
    t.matrix(weight(il, "attn_q"), vec![e, hd * nh], 1.0);
    t.matrix(weight(il, "attn_k"), vec![e, hd * nkv], 1.0);
    t.matrix(weight(il, "attn_v"), vec![e, hd * nkv], 1.0);
    t.matrix(weight(il, "attn_output"), vec![hd * nh, e], 1.0);
    t.norm(weight(il, "attn_q_norm"), hd);
    t.norm(weight(il, "attn_k_norm"), hd);
    t.norm(weight(il, "ffn_norm"), e);
    router(spec, il, t);
    routed_experts(spec, il, false, t);
}

/// A deepseek2 block: layer 0 is dense, the others MoE with a shared expert, and block
/// `spec.layers` is the NextN block (a MoE layer plus its projection).
fn deepseek2_layer(spec: &SynthSpec, il: u32, t: &mut Table) {
    let m = Mla::of(spec);
    let (e, hd, nh) = (u64::from(spec.embd), u64::from(spec.head_dim()), u64::from(spec.heads));
    let ff = u64::from(spec.expert_ff);
    t.norm(weight(il, "attn_norm"), e);
    t.norm(weight(il, "attn_q_a_norm"), m.q_lora);
    t.norm(weight(il, "attn_kv_a_norm"), m.kv_lora);
    t.matrix(weight(il, "attn_q_a"), vec![e, m.q_lora], 1.0);
    t.matrix(weight(il, "attn_q_b"), vec![m.q_lora, nh * hd], 1.0);
    t.matrix(weight(il, "attn_kv_a_mqa"), vec![e, m.kv_lora + m.rope], 1.0);
    t.matrix(weight(il, "attn_k_b"), vec![m.nope, m.kv_lora, nh], 1.0);
    t.matrix(weight(il, "attn_v_b"), vec![m.kv_lora, hd, nh], 1.0);
    t.matrix(weight(il, "attn_output"), vec![nh * hd, e], 1.0);
    t.norm(weight(il, "ffn_norm"), e);
    if il == 0 {
        t.matrix(weight(il, "ffn_gate"), vec![e, m.dense_ff], 1.0);
        t.matrix(weight(il, "ffn_up"), vec![e, m.dense_ff], 1.0);
        t.matrix(weight(il, "ffn_down"), vec![m.dense_ff, e], 1.0);
        return;
    }
    router(spec, il, t);
    t.bias(bias(il, "exp_probs_b"), vec![u64::from(spec.experts)]);
    routed_experts(spec, il, spec.fused_gate_up, t);
    t.matrix(weight(il, "ffn_gate_shexp"), vec![e, ff], 1.0);
    t.matrix(weight(il, "ffn_up_shexp"), vec![e, ff], 1.0);
    t.matrix(weight(il, "ffn_down_shexp"), vec![ff, e], 1.0);
    if il == spec.layers {
        t.matrix(weight(il, "nextn.eh_proj"), vec![2 * e, e], 1.0);
        t.norm(weight(il, "nextn.enorm"), e);
        t.norm(weight(il, "nextn.hnorm"), e);
        t.norm(weight(il, "nextn.shared_head_norm"), e);
    }
}

/// A gpt-oss block; `skew` is the calibrated router bias profile of skewed routing.
fn gpt_oss_layer(spec: &SynthSpec, il: u32, skew: Option<&[f32]>, t: &mut Table) {
    let (e, ne, ff) = (u64::from(spec.embd), u64::from(spec.experts), u64::from(spec.expert_ff));
    let (hd, nh, nkv) = (u64::from(spec.head_dim()), u64::from(spec.heads), u64::from(spec.kv_heads));
    t.norm(weight(il, "attn_norm"), e);
    t.norm(weight(il, "post_attention_norm"), e);
    // Reuse: zero queries (every position weighs its window alike), strong values in the local
    // layers, and sinks the calibration sets. A global layer's values keep unit gain: its sink
    // is closed, and its single-token attention sums every cell's value in f16 (ggml's CPU flash
    // attention), which strong values overflow within a few hundred cells of repeated text.
    let gains = match spec.reuse {
        Some(_) if reuse::is_local(il) => [0.0, 1.0, reuse::VALUE_GAIN],
        Some(_) => [0.0, 1.0, 1.0],
        None => [1.0; 3],
    };
    for ((name, width), gain) in
        [("attn_q", hd * nh), ("attn_k", hd * nkv), ("attn_v", hd * nkv)].into_iter().zip(gains)
    {
        t.matrix(weight(il, name), vec![e, width], gain);
        if gain == 0.0 {
            t.push(bias(il, name), vec![width], TensorType::F32, Init::Uniform { gain: 0.0, fan_in: 1 });
        } else {
            t.bias(bias(il, name), vec![width]);
        }
    }
    t.matrix(weight(il, "attn_output"), vec![hd * nh, e], 1.0);
    t.bias(bias(il, "attn_output"), vec![e]);
    if spec.reuse.is_some() {
        let sink = if reuse::is_local(il) { reuse::INITIAL_SINK } else { reuse::CLOSED_SINK };
        t.push(weight(il, "attn_sinks"), vec![nh], TensorType::F32, Init::Values(vec![sink; nh as usize].into()));
    } else {
        t.bias(weight(il, "attn_sinks"), vec![nh]);
    }
    router(spec, il, t);
    match skew {
        Some(profile) => {
            let b = routing::by_expert(profile, spec.seed, il);
            t.push(bias(il, "ffn_gate_inp"), vec![ne], TensorType::F32, Init::Values(b.into()));
        }
        None => t.bias(bias(il, "ffn_gate_inp"), vec![ne]),
    }
    routed_experts(spec, il, false, t);
    t.bias(bias(il, "ffn_gate_exps"), vec![ff, ne]);
    t.bias(bias(il, "ffn_up_exps"), vec![ff, ne]);
    t.bias(bias(il, "ffn_down_exps"), vec![e, ne]);
}

/// The architecture's metadata keys (without `general.*` and the vocabulary).
pub fn metadata(spec: &SynthSpec) -> Vec<(String, Value)> {
    let arch = spec.arch.name();
    let k = |s: &str| format!("{arch}.{s}");
    let hd = spec.head_dim();
    let mut meta = vec![
        (k("context_length"), Value::U32(spec.ctx_len)),
        (k("embedding_length"), Value::U32(spec.embd)),
        (k("expert_feed_forward_length"), Value::U32(spec.expert_ff)),
        (k("attention.head_count"), Value::U32(spec.heads)),
        (k("rope.freq_base"), Value::F32(10_000.0)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("expert_count"), Value::U32(spec.experts)),
        (k("expert_used_count"), Value::U32(spec.experts_used)),
    ];
    let u32_of = |v: u64| Value::U32(v as u32);
    match spec.arch {
        SynthArch::Qwen3moe | SynthArch::GptOss => meta.extend([
            (k("block_count"), Value::U32(spec.layers)),
            (k("feed_forward_length"), Value::U32(spec.expert_ff)),
            (k("attention.head_count_kv"), Value::U32(spec.kv_heads)),
            (k("attention.key_length"), Value::U32(hd)),
            (k("attention.value_length"), Value::U32(hd)),
        ]),
        SynthArch::Deepseek2 => {
            let m = Mla::of(spec);
            meta.extend([
                (k("block_count"), Value::U32(spec.layers + 1)),
                (k("nextn_predict_layers"), Value::U32(1)),
                (k("leading_dense_block_count"), Value::U32(1)),
                (k("feed_forward_length"), u32_of(m.dense_ff)),
                // Latent attention: one shared latent head; keys are the latent plus the rotary
                // part, values the latent, decompressed per head by attn_k_b / attn_v_b.
                (k("attention.head_count_kv"), Value::U32(1)),
                (k("attention.key_length"), u32_of(m.kv_lora + m.rope)),
                (k("attention.value_length"), u32_of(m.kv_lora)),
                (k("attention.key_length_mla"), Value::U32(hd)),
                (k("attention.value_length_mla"), Value::U32(hd)),
                (k("attention.q_lora_rank"), u32_of(m.q_lora)),
                (k("attention.kv_lora_rank"), u32_of(m.kv_lora)),
                (k("rope.dimension_count"), u32_of(m.rope)),
                (k("expert_shared_count"), Value::U32(1)),
                (k("expert_weights_scale"), Value::F32(2.5)),
                (k("expert_weights_norm"), Value::Bool(true)),
                // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
                (k("expert_gating_func"), Value::U32(2)),
            ]);
            if m.groups.0 > 0 {
                meta.push((k("expert_group_count"), Value::U32(m.groups.0)));
                meta.push((k("expert_group_used_count"), Value::U32(m.groups.1)));
            }
        }
    }
    if spec.arch == SynthArch::GptOss {
        meta.push((k("attention.sliding_window"), Value::U32(spec.sliding_window.unwrap_or(GPT_OSS_WINDOW))));
    }
    meta
}

/// Checks what `spec.arch` needs of the spec's dimensions.
pub fn validate(spec: &SynthSpec) -> Result<(), (&'static str, String)> {
    if spec.fused_gate_up && spec.arch != SynthArch::Deepseek2 {
        return Err((
            "fused-gate-up",
            format!("{} has no fused gate/up expert tensor in llama.cpp; use --arch deepseek2", spec.arch.name()),
        ));
    }
    if spec.sliding_window.is_some() && spec.arch != SynthArch::GptOss {
        return Err(("sliding-window", "only gpt-oss has a sliding window; remove it or use --arch gpt-oss".into()));
    }
    if spec.sliding_window == Some(0) {
        return Err(("sliding-window", "must be at least 1 token".into()));
    }
    if spec.arch != SynthArch::Deepseek2 {
        return Ok(());
    }
    if spec.layers < 2 {
        return Err(("layers", "deepseek2 needs at least 2: a leading dense layer and a MoE layer".into()));
    }
    if spec.head_dim() % 8 != 0 || spec.embd % 4 != 0 {
        return Err((
            "embd",
            format!(
                "deepseek2 needs heads of a multiple of 8 wide (--embd {} / --heads {} is {})",
                spec.embd,
                spec.heads,
                spec.head_dim()
            ),
        ));
    }
    let (groups, used) = deepseek_groups(spec.experts);
    if groups > 0 && spec.experts_used > spec.experts / groups * used {
        return Err((
            "experts-used",
            format!(
                "{} is more than the {} experts of the {used} of {groups} expert groups a token may use",
                spec.experts_used,
                spec.experts / groups * used
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &SynthSpec) -> Vec<String> {
        tensors(spec, None).into_iter().map(|(t, _)| t.name).collect()
    }

    #[test]
    fn deepseek2_has_a_dense_first_layer_shared_experts_and_a_nextn_block() {
        let spec = SynthSpec { arch: SynthArch::Deepseek2, layers: 3, ..Default::default() };
        let n = names(&spec);
        assert!(n.contains(&"blk.0.ffn_up.weight".to_string()));
        assert!(!n.iter().any(|t| t.starts_with("blk.0.") && t.contains("_exps")));
        assert!(n.contains(&"blk.1.ffn_up_shexp.weight".to_string()));
        assert!(n.contains(&"blk.3.nextn.eh_proj.weight".to_string()));
        assert!(n.contains(&"blk.3.ffn_down_exps.weight".to_string()));
        let fused = SynthSpec { fused_gate_up: true, ..spec };
        let n = names(&fused);
        assert!(n.contains(&"blk.1.ffn_gate_up_exps.weight".to_string()));
        assert!(!n.contains(&"blk.1.ffn_gate_exps.weight".to_string()));
    }

    #[test]
    fn gpt_oss_has_per_expert_biases() {
        let spec = SynthSpec { arch: SynthArch::GptOss, ..Default::default() };
        let t = tensors(&spec, None);
        let b = t.iter().find(|(t, _)| t.name == "blk.1.ffn_down_exps.bias").unwrap();
        assert_eq!(b.0.ne, vec![256, 8]);
        assert_eq!(b.0.ty, TensorType::F32);
    }

    #[test]
    fn layouts_an_architecture_lacks_are_refused() {
        let spec = SynthSpec { fused_gate_up: true, ..Default::default() };
        assert_eq!(validate(&spec).unwrap_err().0, "fused-gate-up");
        let spec = SynthSpec { arch: SynthArch::Deepseek2, layers: 1, ..Default::default() };
        assert_eq!(validate(&spec).unwrap_err().0, "layers");
        let spec = SynthSpec { arch: SynthArch::Deepseek2, experts_used: 5, ..Default::default() };
        assert_eq!(validate(&spec).unwrap_err().0, "experts-used");
        let spec = SynthSpec { sliding_window: Some(128), ..Default::default() };
        assert_eq!(validate(&spec).unwrap_err().0, "sliding-window");
    }
}
