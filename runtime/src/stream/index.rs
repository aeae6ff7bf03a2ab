//! The expert index: where every routed expert's bytes sit in the model's file(s).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ggml_sys::{GgmlType, GgufFile};

use super::recipe::{self, Recipe};

/// A stacked expert tensor (`ne[2]` experts) of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertTensor {
    /// Tensor name.
    pub name: String,
    /// Layer number.
    pub layer: u32,
    /// Which shard file holds it (index into [`ExpertIndex::shards`]).
    pub shard: usize,
    /// Absolute offset of the tensor's data in that file.
    pub offset: u64,
    /// Bytes of the whole tensor.
    pub size: u64,
    /// Bytes from one expert's slice to the next (`nb[2]`).
    pub stride: u64,
    /// Number of experts stacked in it.
    pub n_expert: u32,
    /// Element type.
    pub ty: GgmlType,
}

impl ExpertTensor {
    /// The byte range of expert `e`'s slice, relative to the tensor.
    pub fn slice(&self, e: u32) -> (u64, u64) {
        (u64::from(e) * self.stride, u64::from(e + 1) * self.stride)
    }
}

/// A tensor that stays resident.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseTensor {
    /// Tensor name.
    pub name: String,
    /// Shard file index.
    pub shard: usize,
    /// Absolute offset.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// Why a model cannot be streamed.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The GGUF could not be read.
    #[error(transparent)]
    Gguf(#[from] ggml_sys::Error),
    /// No recipe for the architecture.
    #[error("{path}: architecture '{arch}' has no streaming recipe; run it with --resident, or add a row to the recipe table (`sluice run --list-archs` prints it)")]
    UnknownArch {
        /// The model.
        path: PathBuf,
        /// Its architecture.
        arch: String,
    },
    /// No routed expert tensors.
    #[error("{path}: no routed expert tensors ({}) found; it is not a Mixture-of-Experts model, so run it with --resident", .suffixes.join(", "))]
    NoExperts {
        /// The model.
        path: PathBuf,
        /// The suffixes looked for.
        suffixes: Vec<&'static str>,
    },
    /// Metadata is missing or inconsistent.
    #[error("{path}: {what}")]
    Metadata {
        /// The model.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
}

/// Where each expert's bytes are, for a whole (possibly split) model.
#[derive(Debug)]
pub struct ExpertIndex {
    /// The architecture's recipe.
    pub recipe: &'static Recipe,
    /// The model's files, first one first.
    pub shards: Vec<PathBuf>,
    /// Expert tensors, grouped by layer in file order.
    pub experts: Vec<ExpertTensor>,
    /// Every other tensor.
    pub dense: Vec<DenseTensor>,
    /// Layers.
    pub n_layer: u32,
    /// Experts per layer.
    pub n_expert: u32,
    /// Experts each token routes to.
    pub n_expert_used: u32,
    by_layer: Vec<Vec<usize>>,
    by_name: HashMap<String, usize>,
    dense_by_name: HashMap<String, usize>,
}

/// The shard files of the model whose first file is `first`.
pub fn shard_paths(first: &Path, g: &GgufFile) -> Result<Vec<PathBuf>, IndexError> {
    let count = g.get_u64("split.count").unwrap_or(1);
    if count <= 1 {
        return Ok(vec![first.to_path_buf()]);
    }
    let s = first.to_string_lossy();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let prefix = s.strip_suffix(&suffix).ok_or_else(|| IndexError::Metadata {
        path: first.into(),
        what: format!(
            "split.count is {count} but the file name does not end in {suffix}; pass the first file of the split"
        ),
    })?;
    Ok((1..=count).map(|i| PathBuf::from(format!("{prefix}-{i:05}-of-{count:05}.gguf"))).collect())
}

fn parse_layer(name: &str, suffix: &str) -> Option<u32> {
    let rest = name.strip_prefix("blk.")?;
    let (il, tail) = rest.split_once('.')?;
    (tail == format!("{suffix}.weight")).then(|| il.parse().ok())?
}

impl ExpertIndex {
    /// Reads the headers of `path` (and the other files of a split model).
    pub fn open(path: &Path) -> Result<ExpertIndex, IndexError> {
        let first = GgufFile::open(path)?;
        let meta_err = |what: String| IndexError::Metadata { path: path.into(), what };
        let arch = first.architecture().ok_or_else(|| meta_err("general.architecture is missing".into()))?;
        let recipe = recipe::recipe_for(&arch)
            .ok_or_else(|| IndexError::UnknownArch { path: path.into(), arch: arch.clone() })?;
        let key_u32 = |k: &str| first.get_u64(&format!("{arch}.{k}")).map(|v| v as u32);
        let n_layer = key_u32("block_count").ok_or_else(|| meta_err(format!("{arch}.block_count is missing")))?;
        let n_expert_used = key_u32("expert_used_count").unwrap_or(0);
        let shards = shard_paths(path, &first)?;
        let mut experts = Vec::new();
        let mut dense = Vec::new();
        for (shard, shard_path) in shards.iter().enumerate() {
            let opened;
            let g = if shard == 0 {
                &first
            } else {
                opened = GgufFile::open(shard_path)?;
                &opened
            };
            for t in g.tensors() {
                let layer = recipe.expert_suffixes.iter().find_map(|s| parse_layer(&t.name, s));
                match layer {
                    Some(layer) if t.ne[2] > 1 => experts.push(ExpertTensor {
                        name: t.name.clone(),
                        layer,
                        shard,
                        offset: t.offset,
                        size: t.size,
                        stride: t.nb()[2],
                        n_expert: t.ne[2] as u32,
                        ty: t.ty,
                    }),
                    _ => dense.push(DenseTensor { name: t.name.clone(), shard, offset: t.offset, size: t.size }),
                }
            }
        }
        if experts.is_empty() {
            return Err(IndexError::NoExperts { path: path.into(), suffixes: recipe.expert_suffixes.to_vec() });
        }
        let n_expert = experts[0].n_expert;
        if let Some(t) = experts.iter().find(|t| t.n_expert != n_expert || t.layer >= n_layer) {
            return Err(meta_err(format!("expert tensor {} has {} experts (layer {}), inconsistent with {n_expert} experts over {n_layer} layers", t.name, t.n_expert, t.layer)));
        }
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(meta_err(format!("{arch}.expert_used_count is {n_expert_used}, not between 1 and {n_expert}")));
        }
        let mut by_layer = vec![Vec::new(); n_layer as usize];
        for (i, t) in experts.iter().enumerate() {
            by_layer[t.layer as usize].push(i);
        }
        let by_name = experts.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let dense_by_name = dense.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(ExpertIndex {
            recipe,
            shards,
            experts,
            dense,
            n_layer,
            n_expert,
            n_expert_used,
            by_layer,
            by_name,
            dense_by_name,
        })
    }

    /// The expert tensors of `layer`.
    pub fn layer_tensors(&self, layer: u32) -> impl Iterator<Item = (usize, &ExpertTensor)> {
        self.by_layer.get(layer as usize).into_iter().flatten().map(move |&i| (i, &self.experts[i]))
    }

    /// The expert tensor named `name`.
    pub fn expert_by_name(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The resident tensor named `name`.
    pub fn dense_by_name(&self, name: &str) -> Option<usize> {
        self.dense_by_name.get(name).copied()
    }

    /// Every (layer, expert) pair.
    fn all_experts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (0..self.n_layer).flat_map(move |l| (0..self.n_expert).map(move |e| (l, e)))
    }

    /// Window bytes of every expert: what a cache holding all of them accounts.
    pub fn all_expert_window_bytes(&self) -> u64 {
        self.all_experts().map(|(l, e)| self.expert_window_bytes(l, e)).sum()
    }

    /// Bytes of one expert's page-aligned read windows in `layer` (what reading it costs and
    /// what the cache accounts for it).
    pub fn expert_window_bytes(&self, layer: u32, e: u32) -> u64 {
        self.layer_tensors(layer)
            .map(|(_, t)| {
                let (a, b) = t.slice(e);
                page_window(t.offset + a, t.offset + b)
            })
            .sum()
    }

    /// Bytes of the dense tensors' page-aligned windows: what reading them into anonymous
    /// memory (dense `anon`) holds.
    pub fn dense_window_bytes(&self) -> u64 {
        self.dense.iter().map(|t| page_window(t.offset, t.offset + t.size)).sum()
    }

    /// The largest expert's window bytes over all layers.
    pub fn max_expert_window_bytes(&self) -> u64 {
        self.all_experts().map(|(l, e)| self.expert_window_bytes(l, e)).max().unwrap_or(0)
    }

    /// One token's routed demand, the one definition that plans, checks and the cache use:
    /// in every layer, the windows of its `n_expert_used` largest experts, resident at once. It
    /// is never more than all experts (quantized experts' windows differ by a page or so, so
    /// `layers x k x the largest window` could be, and refused a cache holding every expert).
    pub fn one_token_demand(&self) -> u64 {
        (0..self.n_layer)
            .map(|l| {
                let mut windows: Vec<u64> = (0..self.n_expert).map(|e| self.expert_window_bytes(l, e)).collect();
                windows.sort_unstable_by(|a, b| b.cmp(a));
                windows.iter().take(self.n_expert_used as usize).sum::<u64>()
            })
            .sum()
    }

    /// Bytes of all expert tensors.
    pub fn expert_bytes(&self) -> u64 {
        self.experts.iter().map(|t| t.size).sum()
    }

    /// Bytes of all resident tensors.
    pub fn dense_bytes(&self) -> u64 {
        self.dense.iter().map(|t| t.size).sum()
    }
}

/// Bytes of the page-aligned window around the file range `[start, end)`.
fn page_window(start: u64, end: u64) -> u64 {
    let page = ggml_sys::page_size();
    end.div_ceil(page) * page - start / page * page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_parse_only_for_the_exact_suffix() {
        assert_eq!(parse_layer("blk.12.ffn_up_exps.weight", "ffn_up_exps"), Some(12));
        assert_eq!(parse_layer("blk.12.ffn_up_exps.bias", "ffn_up_exps"), None);
        assert_eq!(parse_layer("blk.x.ffn_up_exps.weight", "ffn_up_exps"), None);
        assert_eq!(parse_layer("blk.1.ffn_up_shexp.weight", "ffn_up_exps"), None);
    }
}
