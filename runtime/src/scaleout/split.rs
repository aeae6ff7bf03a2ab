//! Which layers each RPC worker holds: whole layers from the end of the model, as many as each
//! worker's free memory takes, checked against llama.cpp's own sizes for the split.

use std::fmt::Write as _;
use std::ops::Range;
use std::path::Path;

use ggml_sys::{MemorySizes, RpcDevice, RpcSplit};
use serde::Serialize;

use super::{ScaleError, Worker};
use crate::budget::measure_context;
use crate::stream::ExpertIndex;
use crate::units::mib;

/// One worker's share of the model.
#[derive(Debug, Clone, Serialize)]
pub struct Share {
    /// The worker's `host:port`.
    pub endpoint: String,
    /// The layers it holds, resident (dense weights and experts).
    pub layers: Range<u32>,
    /// It holds the output layer too (the last worker).
    pub output: bool,
    /// Weight bytes it holds, as llama.cpp sizes them.
    pub weights: u64,
    /// KV cache bytes of its layers.
    pub kv: u64,
    /// Compute buffer bytes.
    pub compute: u64,
    /// What the worker reported free before the split.
    pub free: u64,
    /// Its memory (a sluice worker: its budget).
    pub total: u64,
}

impl Share {
    /// Everything it holds.
    pub fn held(&self) -> u64 {
        self.weights + self.kv + self.compute
    }
}

/// A model split between this board (the head) and RPC workers.
#[derive(Debug, Clone, Serialize)]
pub struct Split {
    /// The model's layers.
    pub n_layer: u32,
    /// The first layer a worker holds: the head keeps `0..first_remote` and streams their
    /// experts.
    pub first_remote: u32,
    /// The workers' shares, in layer order.
    pub shares: Vec<Share>,
    #[serde(skip)]
    devices: Vec<RpcDevice>,
}

impl Split {
    /// The split as llama.cpp loads it.
    pub fn rpc(&self) -> RpcSplit {
        RpcSplit { devices: self.devices.clone(), layers: self.shares.iter().map(|s| s.layers.len() as u32).collect() }
    }

    /// The split as a table: the head's layers, then each worker's layers and memory.
    pub fn describe(&self) -> String {
        let range = |r: &Range<u32>| match r.len() {
            0 => "none".to_string(),
            1 => format!("layer {}", r.start),
            _ => format!("layers {}-{}", r.start, r.end - 1),
        };
        let mut o = format!(
            "split of {} layers over this board and {} RPC worker(s):\n  {:<21} {:<16} streams its layers' experts (its ledger follows)\n",
            self.n_layer,
            self.shares.len(),
            "this board (head)",
            range(&(0..self.first_remote))
        );
        for s in &self.shares {
            let layers = format!("{}{}", range(&s.layers), if s.output { " + output" } else { "" });
            let _ = writeln!(
                o,
                "  {:<21} {:<16} weights {:.1} + KV {:.1} + compute {:.1} = {:.1} MiB resident, of {:.1} MiB free (it lends {:.1} MiB)",
                s.endpoint,
                layers,
                mib(s.weights),
                mib(s.kv),
                mib(s.compute),
                mib(s.held()),
                mib(s.free),
                mib(s.total)
            );
        }
        o
    }
}

/// Layers per worker, filled from the model's end: the last worker takes the output layer and
/// then as many layers as its free memory holds by `cost`, the worker before it the layers before
/// those, and so on; the head keeps at least layers `0..min_head`.
fn greedy(free: &[u64], cost: impl Fn(u32) -> u64, fixed: &[u64], n_layer: u32, min_head: u32) -> Vec<u32> {
    let mut counts = vec![0u32; free.len()];
    let mut end = n_layer;
    for j in (0..free.len()).rev() {
        let mut used = fixed[j];
        while end > min_head && used + cost(end - 1) <= free[j] {
            used += cost(end - 1);
            end -= 1;
            counts[j] += 1;
        }
    }
    counts
}

/// The layers `greedy` gives the workers, spread over them in proportion to their free memory
/// (largest remainders first), when every worker's share fits by `cost`; else `greedy`'s counts.
fn balanced(free: &[u64], cost: impl Fn(u32) -> u64, fixed: &[u64], n_layer: u32, greedy: &[u32]) -> Vec<u32> {
    let remote: u32 = greedy.iter().sum();
    let total: u128 = free.iter().map(|&f| u128::from(f)).sum::<u128>().max(1);
    let shares: Vec<u128> = free.iter().map(|&f| u128::from(remote) * u128::from(f)).collect();
    let mut counts: Vec<u32> = shares.iter().map(|s| (s / total) as u32).collect();
    let mut by_remainder: Vec<usize> = (0..free.len()).collect();
    by_remainder.sort_by_key(|&j| std::cmp::Reverse((shares[j] % total, j)));
    let left = remote - counts.iter().sum::<u32>();
    for &j in by_remainder.iter().take(left as usize) {
        counts[j] += 1;
    }
    let mut end = n_layer;
    for j in (0..free.len()).rev() {
        let start = end - counts[j];
        if fixed[j] + (start..end).map(&cost).sum::<u64>() > free[j] {
            return greedy.to_vec();
        }
        end = start;
    }
    counts
}

/// Splits `index`'s model between this board and `workers` for a context of `shape`. The
/// head keeps at least the layers up to its first MoE layer (which it streams); the workers take
/// the rest from the end, the output layer on the last one: as many whole layers as fit in what
/// they report free, spread over them in proportion to it. The split is checked against llama.cpp's sizes of a metadata-only load
/// split that way, and layers move toward the head until every worker's share fits.
pub fn plan_split(
    model: &Path,
    index: &ExpertIndex,
    shape: crate::generate::ContextShape,
    workers: &[Worker],
) -> Result<Split, ScaleError> {
    let n_layer = index.n_layer;
    let (layer_bytes, output_bytes) = index.layer_weight_bytes();
    let single = measure_context(model, shape, None, None)?;
    let kv_per_layer = single.kv.div_ceil(u64::from(n_layer.max(1)));
    let cost = |l: u32| layer_bytes[l as usize] + kv_per_layer;
    let free: Vec<u64> = workers.iter().map(|w| w.free).collect();
    let last = workers.len() - 1;
    let fixed: Vec<u64> =
        (0..workers.len()).map(|j| single.compute + if j == last { output_bytes } else { 0 }).collect();
    let no_room = |need: u64| ScaleError::NoRoomForOutput {
        endpoint: workers[last].device.endpoint().to_string(),
        free_mib: mib(workers[last].free),
        need_mib: mib(need),
    };
    if fixed[last] > free[last] {
        return Err(no_room(fixed[last]));
    }
    let min_head = index.moe_layers().next().map_or(n_layer, |l| l + 1);
    let most = greedy(&free, cost, &fixed, n_layer, min_head);
    let mut counts = balanced(&free, cost, &fixed, n_layer, &most);
    let devices: Vec<RpcDevice> = workers.iter().map(|w| w.device.clone()).collect();
    loop {
        let rpc = RpcSplit { devices: devices.clone(), layers: counts.clone() };
        let sizes = measure_context(model, shape, None, Some(&rpc))?;
        let held = |m: &MemorySizes| m.model + m.context + m.compute;
        match (0..workers.len()).find(|&j| held(&sizes.workers[j]) > free[j]) {
            None => return Ok(split(n_layer, &counts, workers, &sizes.workers, devices)),
            Some(j) if counts[j] == 0 => return Err(no_room(held(&sizes.workers[j]))),
            Some(j) => {
                // Its first layer goes to the worker before it, or to the head.
                counts[j] -= 1;
                if j > 0 {
                    counts[j - 1] += 1;
                }
                log::debug!("RPC split: worker {j} is over by llama.cpp's sizes; one layer moves toward the head");
            }
        }
    }
}

/// The split `counts` describes, with the measured sizes.
fn split(n_layer: u32, counts: &[u32], workers: &[Worker], sizes: &[MemorySizes], devices: Vec<RpcDevice>) -> Split {
    let first_remote = n_layer - counts.iter().sum::<u32>();
    let mut start = first_remote;
    let shares = workers
        .iter()
        .zip(counts)
        .zip(sizes)
        .enumerate()
        .map(|(j, ((w, &n), m))| {
            let layers = start..start + n;
            start += n;
            Share {
                endpoint: w.device.endpoint().to_string(),
                layers,
                output: j == workers.len() - 1,
                weights: m.model,
                kv: m.context,
                compute: m.compute,
                free: w.free,
                total: w.total,
            }
        })
        .collect();
    Split { n_layer, first_remote, shares, devices }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_fill_from_the_end_and_the_head_keeps_its_minimum() {
        // Ten layers of 10, no fixed cost: the last worker takes 3, the one before 2.
        let c = greedy(&[25, 30], |_| 10, &[0, 0], 10, 1);
        assert_eq!(c, [2, 3]);
        // The output's fixed cost comes first on the last worker.
        assert_eq!(greedy(&[25, 30], |_| 10, &[0, 15], 10, 1), [2, 1]);
        // Roomy workers stop at the head's minimum.
        assert_eq!(greedy(&[1000, 1000], |_| 10, &[0, 0], 10, 4), [0, 6]);
        // Larger layers at the end.
        assert_eq!(greedy(&[100], |l| if l >= 8 { 40 } else { 10 }, &[0], 10, 1), [4]);
    }

    #[test]
    fn the_layers_spread_over_the_workers_by_their_free_memory_when_they_fit() {
        assert_eq!(balanced(&[1000, 1000], |_| 10, &[0, 0], 10, &[0, 6]), [3, 3]);
        assert_eq!(balanced(&[1000, 3000], |_| 10, &[0, 0], 10, &[0, 8]), [2, 6]);
        // 5 layers over 25 and 30 free: 2.27 and 2.73, the larger remainder takes the fifth.
        assert_eq!(balanced(&[25, 30], |_| 10, &[0, 0], 10, &[2, 3]), [2, 3]);
        // A proportional share that does not fit (the output's cost) keeps the greedy counts.
        assert_eq!(balanced(&[30, 30], |_| 10, &[0, 25], 10, &[3, 0]), [3, 0]);
    }
}
