//! The streamed experts' routed product as an operator-extension kernel.
//!
//! One kernel, registered once per process on the CPU device, computes the `MUL_MAT_ID` nodes
//! whose weights are a streaming session's expert tensors, and no other node: a resident
//! model's graph keeps ggml's native kernel. Its arithmetic is ggml-cpu's own
//! ([`ggml_sys::ext::routed`]), so streamed output stays byte-identical to resident; what it
//! adds is that each routed expert is computed as soon as its slices have landed (per-expert
//! readiness, from the I/O lanes), experts already resident first, while a thread with nothing
//! ready blocks instead of spinning. Nodes where ggml-cpu would round differently (its tiled
//! K-quant path, x86 only) are left native; the engine reads their layer serially.
//!
//! Which nodes are a session's: while a session's context is created (and while `sluice plan`
//! measures one), the kernel is *claiming* on that thread: every `MUL_MAT_ID` node llama.cpp's
//! scheduler offers it whose weights are named as one of the session's expert tensors is
//! recorded and taken, so the context's reserved compute buffers include the kernel's workspace.
//! The session then registers those tensors ([`Claims`]) until it is dropped.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use ggml_sys::ext::routed::{self, ExpertGate};
use ggml_sys::ext::{Device, Execution, GgmlOp, Kernel, KernelError, KernelSpec, Prepared, Target};
use ggml_sys::{GgmlType, TensorView};

use super::index::ExpertIndex;
use super::io::IoLanes;
use super::StreamError;

/// The kernel's registered name.
pub const KERNEL_NAME: &str = "sluice.streamed_mul_mat_id.v1";

/// What a session's kernel executions wait on and count.
pub struct ExpertSource {
    lanes: Arc<IoLanes>,
    bound: Duration,
    threads: u32,
    stall_ns: AtomicU64,
    nodes: AtomicU64,
}

impl ExpertSource {
    /// Waits on `lanes`, each wait for an expert bounded by `bound`; `threads` compute threads
    /// share the stall.
    pub fn new(lanes: Arc<IoLanes>, bound: Duration, threads: u32) -> ExpertSource {
        ExpertSource { lanes, bound, threads: threads.max(1), stall_ns: AtomicU64::new(0), nodes: AtomicU64::new(0) }
    }

    /// The lanes it waits on.
    pub fn lanes(&self) -> &Arc<IoLanes> {
        &self.lanes
    }

    /// Time compute threads were blocked waiting for experts since the last call, averaged
    /// over the threads.
    pub fn take_stall(&self) -> Duration {
        Duration::from_nanos(self.stall_ns.swap(0, Ordering::Relaxed) / u64::from(self.threads))
    }

    /// Routed products the kernel computed since the last call.
    pub fn take_nodes(&self) -> u64 {
        self.nodes.swap(0, Ordering::Relaxed)
    }
}

/// One expert tensor of a session, as the kernel's gate for one execution.
struct TensorGate<'a> {
    source: &'a ExpertSource,
    tensor: usize,
    name: &'a str,
}

impl ExpertGate for TensorGate<'_> {
    fn ready(&self, expert: u32) -> bool {
        self.source.lanes.is_landed(self.tensor, expert)
    }

    fn wait(&self, pending: &[u32]) -> Result<(), KernelError> {
        let t0 = Instant::now();
        let ok = self.source.lanes.wait_any(self.tensor, pending, self.source.bound);
        self.source.stall_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if ok {
            Ok(())
        } else {
            Err(KernelError(format!(
                "{}: a routed expert's slice was not read (the streaming engine reports which and why)",
                self.name
            )))
        }
    }

    fn done(&self, expert: u32) {
        // A slice passing through (waves) goes back at once; one the cache keeps stays.
        self.source.lanes.release_after_use(self.tensor, expert);
    }
}

/// A registered expert tensor: its session's source and its index there.
struct Claimed {
    source: Arc<ExpertSource>,
    tensor: usize,
    name: Arc<str>,
}

/// Every live session's expert tensors, by tensor identity.
fn claimed() -> &'static RwLock<HashMap<usize, Claimed>> {
    static CLAIMED: OnceLock<RwLock<HashMap<usize, Claimed>>> = OnceLock::new();
    CLAIMED.get_or_init(Default::default)
}

/// What the kernel took while a streamed context was created.
#[derive(Debug, Default)]
pub struct Claim {
    /// The expert tensors, by name: their identity.
    pub found: HashMap<String, usize>,
    /// The largest workspace the kernel reported for one of the context's nodes (ggml keeps one
    /// workspace per backend, sized for the largest).
    pub workspace: usize,
}

thread_local! {
    /// While a streamed context is created on this thread: the expert tensor names to claim, and
    /// what was claimed so far.
    static CLAIMING: RefCell<Option<(HashSet<String>, Claim)>> = const { RefCell::new(None) };
}

/// The kernel.
struct StreamedMatmul;

impl StreamedMatmul {
    /// Whether `weights` is a live session's expert tensor, or one being claimed on this thread
    /// (then recorded).
    fn is_streamed(weights: TensorView<'_>) -> bool {
        if claimed().read().unwrap_or_else(|p| p.into_inner()).contains_key(&weights.key()) {
            return true;
        }
        CLAIMING.with(|c| {
            let mut c = c.borrow_mut();
            let Some((wanted, found)) = c.as_mut() else { return false };
            if !wanted.contains(weights.name()) {
                return false;
            }
            found.found.insert(weights.name().to_string(), weights.key());
            true
        })
    }
}

impl Kernel for StreamedMatmul {
    fn supports(&self, node: TensorView<'_>) -> bool {
        let Some(weights) = node.src(0) else { return false };
        // Recorded first: a node left native for now (a prompt batch ggml-cpu tiles) still
        // marks the tensor as the session's, for the decodes that come through the kernel.
        Self::is_streamed(weights) && routed::computes_like_native(node)
    }

    fn prepare(&self, nodes: &[TensorView<'_>]) -> Result<Prepared, KernelError> {
        let node = nodes.last().ok_or_else(|| KernelError("no node".into()))?;
        let workspace = routed::mul_mat_id_workspace(*node)?;
        CLAIMING.with(|c| {
            if let Some((_, claim)) = c.borrow_mut().as_mut() {
                claim.workspace = claim.workspace.max(workspace);
            }
        });
        Ok(Prepared { workspace, state: None })
    }

    fn execute(&self, run: &mut Execution<'_>) -> Result<(), KernelError> {
        let weights = run.output().src(0).ok_or_else(|| KernelError("MUL_MAT_ID without weights".into()))?;
        let (source, tensor, name) = {
            let map = claimed().read().unwrap_or_else(|p| p.into_inner());
            let c = map
                .get(&weights.key())
                .ok_or_else(|| KernelError(format!("{} belongs to no live streaming session", weights.name())))?;
            (Arc::clone(&c.source), c.tensor, Arc::clone(&c.name))
        };
        routed::mul_mat_id(run, &TensorGate { source: &source, tensor, name: &name })?;
        source.nodes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Registers the kernel on the CPU device (once per process).
pub fn register() -> Result<(), StreamError> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let spec = KernelSpec {
                name: KERNEL_NAME.into(),
                target: Target::Op(GgmlOp::MUL_MAT_ID),
                priority: 100,
                fusion: false,
            };
            ggml_sys::ext::register_kernel(Device::cpu(), spec, StreamedMatmul).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(StreamError::Kernel)
}

/// Runs `create` (which creates a context over a model of `index`) with the kernel claiming on
/// this thread: returns its result and what the kernel took.
pub fn claiming<T>(index: &ExpertIndex, create: impl FnOnce() -> T) -> Result<(T, Claim), StreamError> {
    register()?;
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            CLAIMING.with(|c| c.borrow_mut().take());
        }
    }
    let wanted = index.experts.iter().map(|t| t.name.clone()).collect();
    CLAIMING.with(|c| *c.borrow_mut() = Some((wanted, Claim::default())));
    let reset = Reset;
    let out = create();
    let found = CLAIMING.with(|c| c.borrow_mut().take()).map(|(_, f)| f).unwrap_or_default();
    drop(reset);
    Ok((out, found))
}

/// A session's expert tensors, registered with the kernel until dropped (drop it after the
/// context that computes them).
pub struct Claims {
    keys: Vec<usize>,
    taken: Vec<bool>,
}

impl Claims {
    /// Registers the expert tensors of `index` that `claim` found while the session's context
    /// was created as `source`'s. A tensor the kernel was never offered (its products placed on
    /// a GPU, say) is computed by ggml's own kernel: its layer must be read before it runs.
    pub fn register(index: &ExpertIndex, claim: &Claim, source: &Arc<ExpertSource>) -> Claims {
        let mut map = claimed().write().unwrap_or_else(|p| p.into_inner());
        let mut keys = Vec::with_capacity(index.experts.len());
        let mut taken = vec![false; index.experts.len()];
        for (k, t) in index.experts.iter().enumerate() {
            let Some(&key) = claim.found.get(&t.name) else {
                log::warn!(
                    "expert tensor {} is not computed by the streamed-experts kernel: its layer is read serially",
                    t.name
                );
                continue;
            };
            map.insert(key, Claimed { source: Arc::clone(source), tensor: k, name: t.name.as_str().into() });
            keys.push(key);
            taken[k] = true;
        }
        Claims { keys, taken }
    }

    /// Which expert tensors (by index) the kernel computes.
    pub fn taken(&self) -> &[bool] {
        &self.taken
    }
}

impl Drop for Claims {
    fn drop(&mut self) {
        let mut map = claimed().write().unwrap_or_else(|p| p.into_inner());
        for k in &self.keys {
            map.remove(k);
        }
    }
}

/// Whether the kernel computes an expert tensor of type `ty` for a batch of `tokens` (else
/// ggml-cpu's own kernel does, and the layer's experts must all be resident first).
pub fn computes(ty: GgmlType, tokens: i64) -> bool {
    routed::reproduces_native(ty, tokens)
}
