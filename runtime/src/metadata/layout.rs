//! How GGUF names the tensors of a layer and the files of a split model: the naming rules the
//! metadata checks, the expert index and `synth` share.

use std::path::{Path, PathBuf};

use ggml_sys::GgufFile;

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

/// The most shards llama.cpp's loader reads (`split.count` is a u16 there).
const MAX_SHARDS: u64 = u16::MAX as u64;

/// The shard files of the model whose first file is `first`, each found on disk in turn (the
/// first one missing is named); the error says what is wrong with the split.
pub fn shard_paths(first: &Path, g: &GgufFile) -> Result<Vec<PathBuf>, String> {
    let count = g.get_u64("split.count").unwrap_or(1);
    if count <= 1 {
        return Ok(vec![first.to_path_buf()]);
    }
    if count > MAX_SHARDS {
        return Err(format!("split.count is {count}; llama.cpp reads at most {MAX_SHARDS} files"));
    }
    let s = first.to_string_lossy();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let prefix = s.strip_suffix(&suffix).ok_or_else(|| {
        format!("split.count is {count} but the file name does not end in {suffix}; pass the first file of the split")
    })?;
    let mut shards = vec![first.to_path_buf()];
    for i in 2..=count {
        let shard = PathBuf::from(format!("{prefix}-{i:05}-of-{count:05}.gguf"));
        if !shard.is_file() {
            return Err(format!(
                "split.count is {count}, but shard {i} ({}) is not there; copy every file of the split beside the first",
                shard.display()
            ));
        }
        shards.push(shard);
    }
    Ok(shards)
}
