//! The expert index: where every routed expert's bytes sit in the model's file(s).
//!
//! Experts are found from the file, for any architecture: every `blk.<il>.*_exps.weight` tensor
//! whose third dimension is the model's expert count (split or fused gate/up, down) holds one
//! slice per expert and streams. Everything else stays resident: attention, norms, routers,
//! shared experts, per-expert biases and scales. Blocks llama.cpp does not run (NextN/MTP blocks
//! after the last layer) are neither indexed nor read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ggml_sys::{GgmlType, GgufFile};

use crate::metadata::layout::{is_expert_layout, is_expert_weight, parse_block, shard_paths};
use crate::metadata::verified;

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

/// A tensor that stays resident (or, for a block llama.cpp does not run, is never read).
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
    /// Elements.
    pub elements: u64,
}

/// Why a model cannot be streamed.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The GGUF could not be read.
    #[error(transparent)]
    Gguf(#[from] ggml_sys::Error),
    /// No routed expert tensors.
    #[error("{path}: no routed expert tensors (blk.<layer>.*_exps.weight holding {arch}.expert_count experts) found; it is not a Mixture-of-Experts model, so run it with --resident")]
    NoExperts {
        /// The model.
        path: PathBuf,
        /// Its architecture.
        arch: String,
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
    /// `general.architecture`.
    pub arch: String,
    /// Whether a gate verifies streaming this architecture (see [`verified`]); others stream by
    /// the generic rule and the warm-up's checks.
    pub verified: bool,
    /// The model's files, first one first.
    pub shards: Vec<PathBuf>,
    /// Expert tensors, grouped by layer in file order.
    pub experts: Vec<ExpertTensor>,
    /// Every other tensor llama.cpp loads.
    pub dense: Vec<DenseTensor>,
    /// Tensors of the blocks llama.cpp does not run (NextN/MTP): not loaded, never read.
    pub not_run: Vec<DenseTensor>,
    /// Dense tensors of the layers RPC workers hold ([`ExpertIndex::keep_layers_below`]).
    pub remote: Vec<DenseTensor>,
    /// Layers llama.cpp runs (`block_count` less the NextN blocks).
    pub n_layer: u32,
    /// NextN/MTP blocks after them (`nextn_predict_layers`).
    pub nextn_layers: u32,
    /// Experts per layer.
    pub n_expert: u32,
    /// Experts each token routes to: the most over the layers.
    pub n_expert_used: u32,
    used_per_layer: Vec<u32>,
    by_layer: Vec<Vec<usize>>,
    by_name: HashMap<String, usize>,
    dense_by_name: HashMap<String, usize>,
}

/// The experts used per token in each of the first `n_layer` of `blocks` layers: one value for
/// all, or one per block.
fn used_per_layer(g: &GgufFile, key: &str, n_layer: u32, blocks: u64) -> Result<Vec<u32>, String> {
    let values = crate::metadata::per_layer_values(g, key, blocks)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{key} is missing"))?;
    let per_layer: Vec<i64> = match values.as_slice() {
        [all] => vec![*all; n_layer as usize],
        each => each.iter().take(n_layer as usize).copied().collect(),
    };
    per_layer.iter().map(|&v| u32::try_from(v).map_err(|_| format!("{key} holds {v}"))).collect()
}

/// What the first file of a model says about all of its files' tensors: the layers that run and
/// the expert count, by which each file's tensors are told apart ([`Classifier::shard`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Classifier {
    /// Layers llama.cpp runs (`block_count` less the NextN blocks).
    pub n_layer: u32,
    /// NextN/MTP blocks after them.
    pub nextn_layers: u32,
    /// Experts per layer.
    pub n_expert: u32,
}

impl Classifier {
    /// Reads the layer and expert counts from `first` (the header of `path`, the model's first
    /// file); `NoExperts` for a model without routed experts.
    pub fn of_first(path: &Path, first: &GgufFile) -> Result<(Classifier, String), IndexError> {
        let meta_err = |what: String| IndexError::Metadata { path: path.into(), what };
        let arch = first.architecture().ok_or_else(|| meta_err("general.architecture is missing".into()))?;
        let key = |k: &str| format!("{arch}.{k}");
        let blocks =
            first.get_u64(&key("block_count")).ok_or_else(|| meta_err(format!("{} is missing", key("block_count"))))?;
        let nextn_layers = first.get_u64(&key("nextn_predict_layers")).unwrap_or(0).min(blocks);
        let n_layer = u32::try_from(blocks - nextn_layers)
            .map_err(|_| meta_err(format!("{} is {blocks}, too many layers", key("block_count"))))?;
        let n_expert = first.get_u64(&key("expert_count")).unwrap_or(0);
        if n_expert <= 1 {
            return Err(IndexError::NoExperts { path: path.into(), arch });
        }
        let n_expert = u32::try_from(n_expert)
            .map_err(|_| meta_err(format!("{} is {n_expert}, too many experts", key("expert_count"))))?;
        Ok((Classifier { n_layer, nextn_layers: nextn_layers as u32, n_expert }, arch))
    }

    /// The tensors of one file (`g`, file number `shard` of the model): routed experts in the
    /// layers that run, the other tensors llama.cpp loads (dense), and those of the layers that
    /// do not run (NextN).
    pub fn shard(&self, g: &GgufFile, shard: usize) -> ShardTensors {
        let mut out = ShardTensors::default();
        for t in g.tensors() {
            let elements = t.ne.iter().map(|&n| n.max(1) as u64).product();
            let dense_tensor = || DenseTensor { name: t.name.clone(), shard, offset: t.offset, size: t.size, elements };
            match parse_block(&t.name) {
                Some((layer, _)) if layer >= self.n_layer => out.not_run.push(dense_tensor()),
                Some((layer, rest)) if is_expert_weight(rest) && t.ne[2] == i64::from(self.n_expert) => {
                    out.experts.push(ExpertTensor {
                        name: t.name.clone(),
                        layer,
                        shard,
                        offset: t.offset,
                        size: t.size,
                        stride: t.nb()[2],
                        n_expert: self.n_expert,
                        ty: t.ty,
                    })
                }
                _ => out.dense.push(dense_tensor()),
            }
        }
        out
    }
}

/// A file's tensors by kind ([`Classifier::shard`]), or a model's, all files together.
#[derive(Debug, Default)]
pub struct ShardTensors {
    /// Routed experts in the layers that run.
    pub experts: Vec<ExpertTensor>,
    /// Every other tensor llama.cpp loads.
    pub dense: Vec<DenseTensor>,
    /// Tensors of the blocks llama.cpp does not run.
    pub not_run: Vec<DenseTensor>,
}

impl ShardTensors {
    /// The tensors of every file of `shards` (the first one's header already open as `first`).
    fn of(first: &GgufFile, shards: &[PathBuf], classifier: &Classifier) -> Result<ShardTensors, IndexError> {
        let mut all = classifier.shard(first, 0);
        for (shard, shard_path) in shards.iter().enumerate().skip(1) {
            let more = classifier.shard(&GgufFile::open(shard_path)?, shard);
            all.experts.extend(more.experts);
            all.dense.extend(more.dense);
            all.not_run.extend(more.not_run);
        }
        Ok(all)
    }
}

impl ExpertIndex {
    /// Reads the headers of `path` (and the other files of a split model).
    pub fn open(path: &Path) -> Result<ExpertIndex, IndexError> {
        let first = GgufFile::open(path)?;
        let (classifier, arch) = Classifier::of_first(path, &first)?;
        let Classifier { n_layer, nextn_layers, n_expert } = classifier;
        let meta_err = |what: String| IndexError::Metadata { path: path.into(), what };
        let key = |k: &str| format!("{arch}.{k}");
        let blocks = u64::from(n_layer + nextn_layers);
        let used_per_layer = used_per_layer(&first, &key("expert_used_count"), n_layer, blocks).map_err(meta_err)?;
        let shards = shard_paths(path, &first).map_err(meta_err)?;
        let ShardTensors { experts, dense, not_run } = ShardTensors::of(&first, &shards, &classifier)?;
        if experts.is_empty() {
            return Err(IndexError::NoExperts { path: path.into(), arch });
        }
        let mut by_layer = vec![Vec::new(); n_layer as usize];
        for (i, t) in experts.iter().enumerate() {
            by_layer[t.layer as usize].push(i);
        }
        if let Some(layer) = (0..n_layer).find(|&l| !by_layer[l as usize].is_empty() && used_per_layer[l as usize] == 0)
        {
            return Err(meta_err(format!(
                "{} is 0 for layer {layer}, which has routed experts",
                key("expert_used_count")
            )));
        }
        let by_name = experts.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let dense_by_name = dense.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(ExpertIndex {
            verified: verified::is_verified(&arch),
            arch,
            shards,
            experts,
            dense,
            not_run,
            remote: Vec::new(),
            n_layer,
            nextn_layers,
            n_expert,
            n_expert_used: used_per_layer.iter().copied().max().unwrap_or(0),
            used_per_layer,
            by_layer,
            by_name,
            dense_by_name,
        })
    }

    /// The layers that have routed experts (leading dense layers and others have none).
    pub fn moe_layers(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.n_layer).filter(|&l| !self.by_layer[l as usize].is_empty())
    }

    /// Experts each token routes to in `layer`.
    pub fn experts_used(&self, layer: u32) -> u32 {
        self.used_per_layer.get(layer as usize).copied().unwrap_or(0)
    }

    /// The distinct expert tensor kinds (`ffn_gate_exps`, `ffn_gate_up_exps`, ...), sorted.
    pub fn expert_kinds(&self) -> Vec<&str> {
        let mut kinds: Vec<&str> = self
            .experts
            .iter()
            .filter_map(|t| parse_block(&t.name).and_then(|(_, rest)| rest.strip_suffix(".weight")))
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        kinds
    }

    /// Resident tensors of an expert layout that do not stream: per-expert biases and scales,
    /// any `*_exps` weight not stacked `n_expert` deep, and other stacked experts of their own
    /// routing (grovemoe's `*_chexps`). The plan lists them.
    pub fn resident_expert_tensors(&self) -> impl Iterator<Item = &DenseTensor> {
        self.dense.iter().filter(|t| parse_block(&t.name).is_some_and(|(_, rest)| is_expert_layout(rest)))
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
    /// in every MoE layer, the windows of its `k` largest experts (`k` the layer's experts used),
    /// resident at once. It is never more than all experts (quantized experts' windows differ by
    /// a page or so, so `layers x k x the largest window` could be, and refused a cache holding
    /// every expert).
    pub fn one_token_demand(&self) -> u64 {
        self.moe_layers().map(|l| self.token_demand_in(l)).sum()
    }

    /// Bytes of f32 copies of the routers (weights and bias) of every layer that streams here:
    /// what the lookahead holds ([`super::lookahead::Lookahead`]).
    pub fn router_copy_bytes(&self) -> u64 {
        let streams = |name: &str| {
            parse_block(name).is_some_and(|(l, rest)| {
                matches!(rest, "ffn_gate_inp.weight" | "ffn_gate_inp.bias") && self.layer_tensors(l).next().is_some()
            })
        };
        self.dense.iter().filter(|d| streams(&d.name)).map(|d| d.elements * 4).sum()
    }

    /// One token's routed demand in its largest layer: the most a single-token decode holds
    /// beyond the expert cache while a layer computes, and the window a prompt batch's experts
    /// pass through in waves when they do not fit (the ledger's I/O staging).
    pub fn layer_token_demand(&self) -> u64 {
        self.moe_layers().map(|l| self.token_demand_in(l)).max().unwrap_or(0)
    }

    /// The windows of layer `l`'s `k` largest experts.
    fn token_demand_in(&self, l: u32) -> u64 {
        let mut windows: Vec<u64> = (0..self.n_expert).map(|e| self.expert_window_bytes(l, e)).collect();
        windows.sort_unstable_by(|a, b| b.cmp(a));
        windows.iter().take(self.experts_used(l) as usize).sum()
    }

    /// The index of a head that keeps only layers `0..first_remote` (the later ones are
    /// resident on RPC workers): their expert tensors leave the index, so nothing here streams,
    /// caches or plans them, and their dense tensors, with the output layer's (which goes with
    /// the last layer), move to [`ExpertIndex::remote`].
    pub fn keep_layers_below(mut self, first_remote: u32) -> ExpertIndex {
        let remote_tensor = |name: &str| match parse_block(name) {
            Some((layer, _)) => layer >= first_remote,
            None => name.starts_with("output") && first_remote < self.n_layer,
        };
        let (remote, dense): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.dense).into_iter().partition(|t| remote_tensor(&t.name));
        self.dense = dense;
        self.remote.extend(remote);
        self.experts.retain(|t| t.layer < first_remote);
        self.by_layer = vec![Vec::new(); self.n_layer as usize];
        for (i, t) in self.experts.iter().enumerate() {
            self.by_layer[t.layer as usize].push(i);
        }
        self.by_name = self.experts.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        self.dense_by_name = self.dense.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        self
    }

    /// Bytes of each layer's tensors, dense and experts (what an RPC worker holding the layer
    /// holds of its weights), and of the output layer's tensors.
    pub fn layer_weight_bytes(&self) -> (Vec<u64>, u64) {
        let mut layers = vec![0u64; self.n_layer as usize];
        let mut output = 0;
        for (name, size) in
            self.dense.iter().map(|t| (&t.name, t.size)).chain(self.experts.iter().map(|t| (&t.name, t.size)))
        {
            match parse_block(name) {
                Some((l, _)) if l < self.n_layer => layers[l as usize] += size,
                Some(_) => {}
                None if name.starts_with("output") => output += size,
                None => {}
            }
        }
        (layers, output)
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
    fn expert_weights_are_told_from_biases_shared_experts_and_other_names() {
        let expert = |name| parse_block(name).filter(|(_, rest)| is_expert_weight(rest)).map(|(il, _)| il);
        assert_eq!(expert("blk.12.ffn_up_exps.weight"), Some(12));
        assert_eq!(expert("blk.3.ffn_gate_up_exps.weight"), Some(3));
        assert_eq!(expert("blk.12.ffn_up_exps.bias"), None);
        assert_eq!(expert("blk.x.ffn_up_exps.weight"), None);
        assert_eq!(expert("blk.1.ffn_up_shexp.weight"), None);
        assert_eq!(expert("output.weight"), None);
        assert!(is_expert_layout("ffn_down_exps.bias") && is_expert_layout("ffn_gate_chexps.weight"));
        assert!(!is_expert_layout("ffn_up_shexp.weight") && !is_expert_layout("exp_probs_b.bias"));
        assert!(!is_expert_layout("ffn_gate_inp.weight"));
    }
}
