//! The warm-up capture: one decode in which every graph node's sources are scanned for the
//! model's weight tensors; nothing is isolated. Each use of an expert tensor is checked to be a
//! routed product over its own layer's top-k node, the only use streaming can serve. The first
//! time an expert tensor is seen, before any node that uses it computes, it is rebound into an
//! empty page-congruent anonymous reservation, so the warm-up never faults expert bytes in from
//! the file mapping; with dense `anon`, each resident weight is likewise read once by the lanes
//! into its own reservation and rebound. (Asks run ahead of compute within a split, and the CPU
//! backend computes synchronously.) [`Capture::finish`] hands what it bound to the streaming
//! state ([`Bound`]).

use std::sync::Arc;

use ggml_sys::{EvalPhase, Model, Reservation, TensorView, WeightTensor};

use super::checksums::ReadSums;
use super::index::ExpertIndex;
use super::io::{IoLanes, ReadJob, SliceCheck};
use super::StreamError;

/// What the capture hands the streaming state.
pub struct Bound {
    /// Each expert tensor's reservation, in [`ExpertIndex::experts`] order, released (empty).
    pub reservations: Vec<Arc<Reservation>>,
    /// Each layer's expert tensors in the order the graph uses them.
    pub use_order: Vec<Vec<usize>>,
    /// Which expert tensors the graph uses more than once.
    pub reused: Vec<bool>,
    /// Dense bytes read into anonymous memory (dense `anon`).
    pub dense_bytes_read: u64,
}

/// The capture's state, driven by the eval callback during the warm-up decode.
pub struct Capture<'m> {
    model: &'m Model,
    index: Arc<ExpertIndex>,
    lanes: Arc<IoLanes>,
    /// What the dense reads are checked against (`--verify`).
    sums: Option<Arc<ReadSums>>,
    /// Read the dense weights into anonymous memory (dense `anon`).
    dense_anon: bool,
    pending: Vec<Option<Arc<Reservation>>>,
    captured_dense: Vec<bool>,
    dense_bytes_read: u64,
    use_order: Vec<Vec<usize>>,
    reused: Vec<bool>,
    jobs: Vec<ReadJob>,
    failure: Option<StreamError>,
}

impl<'m> Capture<'m> {
    /// A capture of `index`'s tensors in `model`'s graph, reading dense weights with `lanes`
    /// when `dense_anon`, each read checked against `sums` when given.
    pub fn new(
        model: &'m Model,
        index: Arc<ExpertIndex>,
        lanes: Arc<IoLanes>,
        sums: Option<Arc<ReadSums>>,
        dense_anon: bool,
    ) -> Capture<'m> {
        Capture {
            model,
            pending: vec![None; index.experts.len()],
            captured_dense: vec![false; index.dense.len()],
            dense_bytes_read: 0,
            use_order: vec![Vec::new(); index.n_layer as usize],
            reused: vec![false; index.experts.len()],
            jobs: Vec::new(),
            failure: None,
            lanes,
            sums,
            dense_anon,
            index,
        }
    }

    /// The eval callback during the warm-up: asks for every node, and captures its sources
    /// before it computes. A failure stops the warm-up right after the node that met it (its
    /// Computed answer), before any later node computes over what failed.
    pub fn on_eval(&mut self, t: TensorView<'_>, phase: EvalPhase) -> bool {
        match phase {
            EvalPhase::Ask => {
                if self.failure.is_none() {
                    if let Err(e) = self.capture_sources(t) {
                        self.failure = Some(e);
                    }
                }
                self.failure.is_some()
            }
            EvalPhase::Computed => self.failure.is_none(),
        }
    }

    fn capture_sources(&mut self, t: TensorView<'_>) -> Result<(), StreamError> {
        for i in 0..10 {
            let Some(src) = t.src(i) else { continue };
            let name = src.name();
            if let Some(k) = self.index.expert_by_name(name) {
                self.check_routed_use(t, i, k)?;
                let layer = self.index.experts[k].layer as usize;
                if self.use_order[layer].contains(&k) {
                    self.reused[k] = true;
                } else {
                    self.use_order[layer].push(k);
                }
                if self.pending[k].is_none() {
                    if let Some(w) = src.as_weight(self.model) {
                        self.pending[k] = Some(self.rebind_expert(k, w)?);
                    }
                }
            } else if self.dense_anon {
                if let Some(k) = self.index.dense_by_name(name) {
                    if !self.captured_dense[k] {
                        if let Some(w) = src.as_weight(self.model) {
                            self.read_dense(k, w)?;
                            self.captured_dense[k] = true;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks that `node` uses expert tensor `k` (as its source `slot`) the one way streaming
    /// can serve: as the weights of a routed product (`MUL_MAT_ID`) whose expert ids are the
    /// top-k node of the tensor's own layer, computed before it. Any other use would read expert
    /// slices the router did not ask for, which are not resident.
    fn check_routed_use(&self, node: TensorView<'_>, slot: usize, k: usize) -> Result<(), StreamError> {
        let tensor = &self.index.experts[k];
        let router = format!("ffn_moe_topk-{}", tensor.layer);
        let routed = slot == 0 && node.op_name() == "MUL_MAT_ID" && node.src(2).is_some_and(|ids| ids.name() == router);
        if routed {
            return Ok(());
        }
        Err(StreamError::Unrouted {
            tensor: tensor.name.clone(),
            node: node.name().to_string(),
            op: node.op_name().to_string(),
            router,
            arch: self.index.arch.clone(),
        })
    }

    /// Checks the graph's expert tensor `k` against the file and rebinds it into an empty
    /// reservation.
    fn rebind_expert(&self, k: usize, w: WeightTensor<'m>) -> Result<Arc<Reservation>, StreamError> {
        let t = &self.index.experts[k];
        let view = w.view();
        if view.n_bytes() as u64 != t.size || view.nb()[2] as u64 != t.stride {
            return Err(StreamError::LayoutMismatch {
                tensor: t.name.clone(),
                detail: format!(
                    "graph has {} bytes, stride {}; file has {} bytes, stride {}",
                    view.n_bytes(),
                    view.nb()[2],
                    t.size,
                    t.stride
                ),
            });
        }
        let r = Arc::new(Reservation::new(t.offset, t.size).map_err(StreamError::Reserve)?);
        w.rebind(Arc::clone(&r)).map_err(|e| StreamError::Graph(e.to_string()))?;
        Ok(r)
    }

    /// Reads dense tensor `k` once into anonymous memory through the lanes and rebinds it.
    fn read_dense(&mut self, k: usize, w: WeightTensor<'m>) -> Result<(), StreamError> {
        let d = &self.index.dense[k];
        let r = Arc::new(Reservation::new(d.offset, d.size).map_err(StreamError::Reserve)?);
        let (start, end) = r.window(0, d.size);
        self.jobs.push(ReadJob {
            target: Arc::clone(&r),
            shard: d.shard,
            start,
            len: (end - start) as usize,
            tag: (u32::MAX, k as u32),
            tensor: usize::MAX,
            slice: None,
            pass: false,
            speculative: false,
            check: self.sums.as_ref().map(|s| SliceCheck { from: 0, to: d.size, sum: s.dense(k) }),
        });
        // The tensor leaves llama.cpp's file mapping before the read: if the read fails, the node
        // that asked computes over zeros (and the warm-up stops after it), never over a mapping
        // whose pages fault on the failing file.
        w.rebind(Arc::clone(&r)).map_err(|e| StreamError::Graph(e.to_string()))?;
        let stats = self.lanes.read_all(&mut self.jobs).map_err(|mut f| {
            f.what = format!("tensor {}", d.name);
            f
        })?;
        self.dense_bytes_read += stats.bytes;
        Ok(())
    }

    /// Ends the capture: checks that every expert tensor was found and rebound, and releases
    /// the reservations (the warm-up computed over them, which maps the zero page where it
    /// read), so that what is in RAM is only what the cache and the staging will hold.
    pub fn finish(self) -> Result<Bound, StreamError> {
        if let Some(e) = self.failure {
            return Err(e);
        }
        if let Some(k) = self.pending.iter().position(Option::is_none) {
            return Err(StreamError::NotCaptured {
                tensor: self.index.experts[k].name.clone(),
                arch: self.index.arch.clone(),
            });
        }
        let reservations: Vec<Arc<Reservation>> = self.pending.into_iter().flatten().collect();
        for r in &reservations {
            r.release(0, r.size());
        }
        Ok(Bound {
            reservations,
            use_order: self.use_order,
            reused: self.reused,
            dense_bytes_read: self.dense_bytes_read,
        })
    }
}
