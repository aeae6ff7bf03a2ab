//! A route trace: every layer's routed experts in every decode of a streamed run, with what the
//! cache needs to replay them (each expert's bytes, the staging allowance, the budget and the
//! policy the run used), and its file (`sluice bench --trace`, read by `sluice replay`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cache::{CachePolicy, ExpertCache};
use super::routing::RouteRecord;

/// The trace file's magic.
pub(crate) const MAGIC: &[u8; 8] = b"SLUICERT";

/// The largest trace file read (about 40 million routed experts).
const MAX_FILE_BYTES: u64 = 1 << 30;

/// A streamed run's routes and the cache's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteTrace {
    /// The model's file name (for reports).
    pub model: String,
    /// Layers.
    pub n_layer: u32,
    /// Experts per layer.
    pub n_expert: u32,
    /// Each expert's bytes as the cache accounts them, `layer * n_expert + expert`.
    pub expert_bytes: Vec<u64>,
    /// How far a layer may run over the budget before its misses pass through.
    pub staging: u64,
    /// The run's cache budget, bytes.
    pub budget: u64,
    /// The run's cache policy.
    pub policy: CachePolicy,
    /// Every planned layer, in order.
    pub steps: Vec<RouteRecord>,
}

/// Why a trace file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read or written.
    #[error("route trace {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a route trace, is damaged, or contradicts itself.
    #[error("route trace {path}: {detail}; record it again with `sluice bench --trace`")]
    Bad {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

impl RouteTrace {
    /// The trace of `steps`, routed through `cache` with `staging` bytes of staging, of the
    /// model named `model`.
    pub fn of(model: String, cache: &ExpertCache, staging: u64, steps: &[RouteRecord]) -> RouteTrace {
        let (n_layer, n_expert) = (cache.n_layer(), cache.n_expert());
        RouteTrace {
            model,
            n_layer,
            n_expert,
            expert_bytes: (0..n_layer * n_expert).map(|i| cache.bytes(i / n_expert, i % n_expert)).collect(),
            staging,
            budget: cache.budget(),
            policy: cache.policy(),
            steps: steps.to_vec(),
        }
    }

    /// Where expert `e` of `layer` is in [`RouteTrace::expert_bytes`] (and in any per-expert table
    /// laid out the same way).
    pub fn index(&self, layer: u32, e: u32) -> usize {
        (layer * self.n_expert + e) as usize
    }

    /// The bytes of expert `e` of `layer`.
    pub fn bytes(&self, layer: u32, e: u32) -> u64 {
        self.expert_bytes[self.index(layer, e)]
    }

    /// Writes the trace to `path` (atomically).
    pub fn save(&self, path: &Path) -> Result<(), TraceError> {
        crate::framed::save(path, MAGIC, self).map_err(|source| TraceError::Io { path: path.into(), source })
    }

    /// Reads the trace at `path` and checks that every step names a layer and experts within
    /// its shape.
    pub fn load(path: &Path) -> Result<RouteTrace, TraceError> {
        let bad = |detail: String| TraceError::Bad { path: path.into(), detail };
        let trace: RouteTrace = crate::framed::load(path, MAGIC, MAX_FILE_BYTES).map_err(|e| match e {
            crate::framed::FramedError::Io(source) => TraceError::Io { path: path.into(), source },
            crate::framed::FramedError::Corrupt(detail) => bad(detail),
        })?;
        trace.check().map_err(bad)?;
        Ok(trace)
    }

    /// Whether the steps fit the shape.
    fn check(&self) -> Result<(), String> {
        let n = u64::from(self.n_layer) * u64::from(self.n_expert);
        if n == 0 || n > u64::from(u32::MAX) || self.expert_bytes.len() as u64 != n {
            return Err(format!(
                "{} expert sizes for {} layers of {} experts",
                self.expert_bytes.len(),
                self.n_layer,
                self.n_expert
            ));
        }
        for (i, s) in self.steps.iter().enumerate() {
            if s.layer >= self.n_layer {
                return Err(format!("step {i} names layer {}, beyond the {} layers", s.layer, self.n_layer));
            }
            let mut seen = vec![false; self.n_expert as usize];
            for &e in &s.experts {
                if e >= self.n_expert || std::mem::replace(&mut seen[e as usize], true) {
                    return Err(format!("step {i} names expert {e} out of range or twice"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> RouteTrace {
        RouteTrace {
            model: "m.gguf".into(),
            n_layer: 2,
            n_expert: 4,
            expert_bytes: vec![10; 8],
            staging: 20,
            budget: 30,
            policy: CachePolicy::Lru,
            steps: vec![RouteRecord { decode: 0, layer: 1, tokens: 1, staged: true, experts: vec![3, 0] }],
        }
    }

    #[test]
    fn a_trace_loads_back_and_a_contradicting_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        trace().save(&path).unwrap();
        assert_eq!(RouteTrace::load(&path).unwrap(), trace());
        for (broken, says) in [
            (RouteTrace { n_expert: 3, ..trace() }, "8 expert sizes for 2 layers of 3 experts"),
            (RouteTrace { steps: vec![RouteRecord { layer: 2, ..trace().steps[0].clone() }], ..trace() }, "layer 2"),
            (
                RouteTrace { steps: vec![RouteRecord { experts: vec![1, 1], ..trace().steps[0].clone() }], ..trace() },
                "expert 1 out of range or twice",
            ),
        ] {
            broken.save(&path).unwrap();
            let e = RouteTrace::load(&path).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("t.trace"), "{e}");
        }
        std::fs::write(&path, b"not a trace").unwrap();
        assert!(RouteTrace::load(&path).unwrap_err().to_string().contains("no SLUICERT header"));
    }
}
