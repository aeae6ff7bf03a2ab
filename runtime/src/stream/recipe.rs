//! Architecture recipes: which tensors of a layer hold the routed experts.
//!
//! Each supported MoE architecture is one row. Counts and shapes always come from the file;
//! a recipe names only the tensor suffixes (`blk.<il>.<suffix>.weight`) that hold stacked
//! experts (`ne[2]` = expert count) and so are streamed. Everything else, shared experts
//! included, stays resident.

/// One architecture's expert layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recipe {
    /// `general.architecture` value.
    pub arch: &'static str,
    /// Suffixes of the routed-expert tensors.
    pub expert_suffixes: &'static [&'static str],
    /// Whether gate and up projections are fused in one tensor.
    pub fused_gate_up: bool,
    /// Suffixes of shared-expert tensors (always resident), for the listing.
    pub shared_suffixes: &'static [&'static str],
}

const SPLIT: &[&str] = &["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];
const SHEXP: &[&str] = &["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"];

/// The supported architectures.
pub const RECIPES: &[Recipe] = &[
    Recipe { arch: "qwen3moe", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: &[] },
    Recipe { arch: "qwen2moe", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: SHEXP },
    Recipe { arch: "olmoe", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: &[] },
    // Mixtral-style models are `llama` files with an expert count.
    Recipe { arch: "llama", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: &[] },
    Recipe { arch: "gpt-oss", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: &[] },
    Recipe { arch: "deepseek2", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: SHEXP },
    Recipe { arch: "granitemoe", expert_suffixes: SPLIT, fused_gate_up: false, shared_suffixes: &[] },
    Recipe {
        arch: "gemma4",
        expert_suffixes: &["ffn_gate_up_exps", "ffn_down_exps"],
        fused_gate_up: true,
        shared_suffixes: &[],
    },
];

/// The recipe for `arch`, if there is one.
pub fn recipe_for(arch: &str) -> Option<&'static Recipe> {
    RECIPES.iter().find(|r| r.arch == arch)
}

/// The table as `sluice run --list-archs` prints it.
pub fn table() -> String {
    let mut out =
        format!("{:<12} {:<8} {:<52} {}\n", "arch", "layout", "streamed expert tensors", "resident shared experts");
    for r in RECIPES {
        let layout = if r.fused_gate_up { "fused" } else { "split" };
        let shared = if r.shared_suffixes.is_empty() { "-".to_string() } else { r.shared_suffixes.join(", ") };
        out.push_str(&format!("{:<12} {:<8} {:<52} {}\n", r.arch, layout, r.expert_suffixes.join(", "), shared));
    }
    out.push_str(
        "\nTo add an architecture, add a row to RECIPES in runtime/src/stream/recipe.rs and a gate fixture.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_architecture_has_a_row() {
        for arch in ["qwen3moe", "qwen2moe", "olmoe", "llama", "gpt-oss", "deepseek2", "granitemoe", "gemma4"] {
            assert!(recipe_for(arch).is_some(), "{arch}");
            assert!(table().contains(arch));
        }
        assert!(recipe_for("gemma4").unwrap().fused_gate_up);
        assert!(recipe_for("bert").is_none());
    }
}
