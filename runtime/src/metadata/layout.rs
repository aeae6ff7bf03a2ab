//! How GGUF names the tensors of a layer: the naming rules the metadata checks, the expert index
//! and `synth` share.

/// The block number and the rest of a `blk.<il>.<rest>` tensor name.
pub fn parse_block(name: &str) -> Option<(u32, &str)> {
    let (il, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    Some((il.parse().ok()?, rest))
}

/// Whether `rest` (a name after `blk.<il>.`) belongs to an expert layout (`ffn_down_exps.bias`,
/// `ffn_gate_chexps.weight`, ...), streamed or not; shared experts (`*_shexp`) do not.
pub fn is_expert_layout(rest: &str) -> bool {
    rest.split('.').next().is_some_and(|base| base.ends_with("exps"))
}

/// Whether a tensor name (or its part after `blk.<il>.`) is a routed experts' weight
/// (`*_exps.weight`): the one definition the index, the metadata checks and `synth` use.
pub fn is_expert_weight(name: &str) -> bool {
    name.ends_with("_exps.weight")
}
