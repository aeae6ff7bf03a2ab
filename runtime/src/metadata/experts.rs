//! Expert counts, groups and gating (`load_hparams`' expert asserts, `build_moe_ffn`).

use super::{shown, Meta, MetadataError, MAX_EXPERTS};

/// The most `expert_gating_func` llama.cpp's `build_moe_ffn` computes (softmax 1, sigmoid 2,
/// softmax over the weights 3, sqrt-softplus 4; 0 is the architecture's default); any other
/// value reaches its `GGML_ABORT`.
const MAX_GATING_FUNC: u64 = 4;

/// Expert counts: at most [`MAX_EXPERTS`]; experts used per token 1 to the count in every layer
/// (0 without experts), none above layer 0's (the graph selects layer 0's count of experts per
/// token and sums each layer's own count of them; a 0 divides by zero in the loaders); groups
/// that divide the experts; a gating function `build_moe_ffn` knows; and expert tensors of that
/// many experts.
pub(super) fn check(m: &Meta) -> Result<(), MetadataError> {
    let experts = m.int("expert_count").unwrap_or(0);
    if experts > MAX_EXPERTS {
        return Err(m.error("expert_count", format!("is {experts}; llama.cpp runs at most {MAX_EXPERTS} experts")));
    }
    let used = m.per_layer("expert_used_count")?.unwrap_or_else(|| vec![0]);
    let range = if experts > 0 { format!("1 to {experts} (the expert count)") } else { "0 (no experts)".into() };
    let fits = |u: i64| if experts > 0 { (1..=experts as i64).contains(&u) } else { u == 0 };
    if !used.iter().all(|&u| fits(u)) {
        return Err(m.error("expert_used_count", format!("is {}; it must be {range} in every layer", shown(&used))));
    }
    if let Some((layer, u)) = used.iter().enumerate().find(|(_, &u)| u > used[0]) {
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
        m.gguf.tensors().iter().find(|t| crate::stream::index::is_expert_weight(&t.name) && t.ne[2] != experts as i64)
    {
        return Err(m.error("expert_count", format!("is {experts}, but tensor {} holds {} experts", t.name, t.ne[2])));
    }
    Ok(())
}
