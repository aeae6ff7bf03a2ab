//! Expert counts, groups and gating (`load_hparams`' expert asserts, `build_moe_ffn`).

use std::collections::HashSet;

use super::{shown, Meta, MetadataError, MAX_EXPERTS};

/// The most `expert_gating_func` llama.cpp's `build_moe_ffn` computes (softmax 1, sigmoid 2,
/// softmax over the weights 3, sqrt-softplus 4; 0 is the architecture's default); any other
/// value reaches its `GGML_ABORT`.
const MAX_GATING_FUNC: u64 = 4;

/// The architectures whose graphs take each layer's own count of experts per token (nemotron-h's
/// heterogeneous layers); the others select layer 0's count for every layer.
const PER_LAYER_ROUTING: [&str; 2] = ["nemotron_h", "nemotron_h_moe"];

/// Expert counts: at most [`MAX_EXPERTS`]; experts used per token 1 to the count in every layer
/// that holds routed experts (a 0 there divides by zero in the loaders or sums no expert), 0 to
/// the count in the others; none above layer 0's (the graph selects layer 0's count of experts
/// per token and sums each layer's own count of them), but where the architecture routes per
/// layer; groups that divide the experts; a gating function `build_moe_ffn` knows; and expert
/// tensors of that many experts.
pub(super) fn check(m: &Meta) -> Result<(), MetadataError> {
    let experts = m.int("expert_count").unwrap_or(0);
    if experts > MAX_EXPERTS {
        return Err(m.error("expert_count", format!("is {experts}; llama.cpp runs at most {MAX_EXPERTS} experts")));
    }
    let used = m.per_layer("expert_used_count")?.unwrap_or_else(|| vec![0; m.layers as usize]);
    let routed: HashSet<u32> = m
        .gguf
        .tensors()
        .iter()
        .filter_map(|t| super::layout::parse_block(&t.name))
        .filter(|(_, rest)| super::layout::is_expert_weight(rest))
        .map(|(layer, _)| layer)
        .collect();
    // The fewest experts per token layer `layer` may use: 1 where it holds routed experts.
    let least = |layer: usize| i64::from(experts > 0 && routed.contains(&(layer as u32)));
    if let Some((layer, u)) = used.iter().enumerate().find(|&(layer, &u)| !(least(layer)..=experts as i64).contains(&u))
    {
        let which =
            if used.iter().all(|&v| v == used[0]) { String::new() } else { format!(" ({u} for layer {layer})") };
        return Err(m.error(
            "expert_used_count",
            format!("is {}{which}; it must be {} to {experts} (the expert count)", shown(&used), least(layer)),
        ));
    }
    if experts > 0 && used.iter().all(|&u| u == 0) {
        return Err(m.error("expert_used_count", format!("is 0 in every layer, with {experts} experts")));
    }
    let per_layer_routing = PER_LAYER_ROUTING.contains(&m.arch.as_str());
    if let Some((layer, u)) = used.iter().enumerate().find(|(_, &u)| u > used[0]).filter(|_| !per_layer_routing) {
        return Err(m.error(
            "expert_used_count",
            format!(
                "is {} for layer {layer}, above layer 0's {} (llama.cpp selects layer 0's count per token)",
                u, used[0]
            ),
        ));
    }
    let groups = m.int("expert_group_count").unwrap_or(0);
    let group_used = m.int("expert_group_used_count").unwrap_or(0);
    if groups > 0 && (experts == 0 || groups >= experts) {
        return Err(m.error("expert_group_count", format!("is {groups}; it must be below the expert count {experts}")));
    }
    if groups > 1 && experts % groups != 0 {
        return Err(m.error("expert_group_count", format!("is {groups}, which does not divide the {experts} experts")));
    }
    if groups > 1 && !(1..groups).contains(&group_used) {
        return Err(m.error("expert_group_used_count", format!("is {group_used}; it must be 1 to {}", groups - 1)));
    }
    if let Some(g) = m.int("expert_gating_func").filter(|&g| g > MAX_GATING_FUNC) {
        return Err(
            m.error("expert_gating_func", format!("is {g}; llama.cpp knows 0 (the default) to {MAX_GATING_FUNC}"))
        );
    }
    if let Some(t) =
        m.gguf.tensors().iter().find(|t| super::layout::is_expert_weight(&t.name) && t.ne[2] != experts as i64)
    {
        return Err(m.error("expert_count", format!("is {experts}, but tensor {} holds {} experts", t.name, t.ne[2])));
    }
    Ok(())
}
