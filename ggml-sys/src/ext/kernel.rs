//! Kernels and fusion rules: application implementations of a built-in or registered operator
//! (or of a range of nodes) on one device.

use std::any::Any;
use std::ffi::{c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use llama_cpp_sys_2 as sys;

use super::op::{ExtOp, GgmlOp};
use super::sched::{Backend, Device};
use crate::{Error, Result, TensorView};

/// What a kernel computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Nodes of a built-in operation (for a fusion rule: the last node of its range).
    Op(GgmlOp),
    /// Nodes of a registered operator.
    Ext(ExtOp),
}

/// How a kernel is registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSpec {
    /// Unique on the device.
    pub name: String,
    /// What it computes.
    pub target: Target,
    /// Higher priorities are considered first.
    pub priority: i32,
    /// A fusion rule ([`Kernel::matches`] picks its ranges); it claims no single-node support.
    pub fusion: bool,
}

/// Why a kernel could not prepare or execute: ggml fails the allocation or the computation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KernelError(pub String);

/// A kernel's plan for one node (or fused range): workspace bytes ggml allocates for it, and
/// optional host-side state handed back to every execution.
#[derive(Default)]
pub struct Prepared {
    /// Workspace bytes.
    pub workspace: usize,
    /// Plan state.
    pub state: Option<Box<dyn Any + Send>>,
}

/// The nodes of a split graph, as a fusion rule's [`Kernel::matches`] sees them.
#[derive(Clone, Copy)]
pub struct GraphNodes<'a> {
    raw: *const sys::ggml_cgraph,
    _life: std::marker::PhantomData<&'a sys::ggml_cgraph>,
}

impl<'a> GraphNodes<'a> {
    /// Number of nodes.
    pub fn len(&self) -> usize {
        // SAFETY: raw is the live graph ggml passed for the duration of the call.
        unsafe { sys::ggml_graph_n_nodes(self.raw.cast_mut()).max(0) as usize }
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Node `i`, if in range.
    pub fn node(&self, i: usize) -> Option<TensorView<'a>> {
        // SAFETY: i < n_nodes, and the graph's nodes are live tensors for the call.
        (i < self.len()).then(|| unsafe { TensorView::from_raw(sys::ggml_graph_node(self.raw.cast_mut(), i as i32)) })
    }
}

/// An application kernel, or (with [`KernelSpec::fusion`]) a fusion rule. Callbacks inspect
/// metadata only (no tensor data before [`Kernel::execute`]), must not call the public
/// capability query for the same device and operator, and may run on any thread.
pub trait Kernel: Send + Sync + 'static {
    /// Whether the kernel computes `node` correctly (for a fusion rule: the range's last node).
    fn supports(&self, node: TensorView<'_>) -> bool;

    /// Whether to use the kernel where the device's native implementation could run `node`
    /// (where it could not, a supported kernel runs regardless).
    fn preferred(&self, _node: TensorView<'_>) -> bool {
        true
    }

    /// Fusion rules: how many consecutive nodes from node `i` the rule replaces (fewer than 2:
    /// none).
    fn matches(&self, _graph: GraphNodes<'_>, _i: usize) -> usize {
        0
    }

    /// Plans `nodes` (one node, or a fused range whose last node is the output): workspace and
    /// state. May run during memory measurement, before tensors have addresses; must not start
    /// work or allocate device memory.
    fn prepare(&self, _nodes: &[TensorView<'_>]) -> Result<Prepared, KernelError> {
        Ok(Prepared::default())
    }

    /// Computes the nodes with their current addresses.
    fn execute(&self, run: &mut Execution<'_>) -> Result<(), KernelError>;
}

/// One execution of a kernel: its nodes, state, workspace and backend.
pub struct Execution<'a> {
    backend: sys::ggml_backend_t,
    nodes: &'a [*mut sys::ggml_tensor],
    state: Option<&'a mut (dyn Any + Send)>,
    workspace: sys::ggml_backend_buffer_t,
}

impl Execution<'_> {
    /// The nodes computed (the last one is the output).
    pub fn nodes(&self) -> Vec<TensorView<'_>> {
        // SAFETY: the nodes are live tensors for the duration of the execution.
        self.nodes.iter().map(|&n| unsafe { TensorView::from_raw(n) }).collect()
    }

    /// The output node.
    pub fn output(&self) -> TensorView<'_> {
        // SAFETY: as in nodes; ggml passes at least one node.
        unsafe { TensorView::from_raw(self.nodes[self.nodes.len() - 1]) }
    }

    /// A copy of the bytes of a tensor the kernel reads (a source of one of its nodes): copied,
    /// because the allocator may let the output reuse an input's storage.
    pub fn read(&self, tensor: TensorView<'_>) -> Result<Vec<u8>, KernelError> {
        super::graph::read_tensor(tensor.raw()).map_err(|e| KernelError(e.to_string()))
    }

    /// Writes the output node's bytes (exactly its size).
    pub fn write_output(&mut self, bytes: &[u8]) -> Result<(), KernelError> {
        let out = self.nodes[self.nodes.len() - 1];
        super::graph::write_tensor(out, bytes).map_err(|e| KernelError(e.to_string()))
    }

    /// The workspace, when one was prepared and it lives in host memory.
    pub fn workspace(&mut self) -> Option<&mut [u8]> {
        if self.workspace.is_null() {
            return None;
        }
        // SAFETY: workspace is a live backend buffer ggml allocated for this execution.
        let (base, size, host) = unsafe {
            (
                sys::ggml_backend_buffer_get_base(self.workspace),
                sys::ggml_backend_buffer_get_size(self.workspace),
                sys::ggml_backend_buffer_is_host(self.workspace),
            )
        };
        // SAFETY: a host buffer of `size` bytes at `base`, used by nothing else while this
        // kernel executes (ggml runs one extension execution per workspace at a time).
        (host && !base.is_null()).then(|| unsafe { std::slice::from_raw_parts_mut(base.cast::<u8>(), size) })
    }

    /// The workspace's size in bytes (0 when none was prepared).
    pub fn workspace_size(&self) -> usize {
        if self.workspace.is_null() {
            return 0;
        }
        // SAFETY: a live buffer (checked non-null).
        unsafe { sys::ggml_backend_buffer_get_size(self.workspace) }
    }

    /// The raw nodes (for the CPU products of this crate).
    pub(crate) fn raw_nodes(&self) -> &[*mut sys::ggml_tensor] {
        self.nodes
    }

    /// The workspace's base address and size, when one was prepared in host memory (else
    /// `(0, 0)`).
    pub(crate) fn raw_workspace(&self) -> (usize, usize) {
        if self.workspace.is_null() {
            return (0, 0);
        }
        // SAFETY: workspace is a live backend buffer ggml allocated for this execution.
        let (base, size, host) = unsafe {
            (
                sys::ggml_backend_buffer_get_base(self.workspace),
                sys::ggml_backend_buffer_get_size(self.workspace),
                sys::ggml_backend_buffer_is_host(self.workspace),
            )
        };
        if host && !base.is_null() {
            (base as usize, size)
        } else {
            (0, 0)
        }
    }

    /// The backend executing the kernel.
    pub(crate) fn raw_backend(&self) -> sys::ggml_backend_t {
        self.backend
    }

    /// The state [`Kernel::prepare`] made, as a `T`.
    pub fn state<T: 'static>(&mut self) -> Option<&mut T> {
        self.state.as_deref_mut().and_then(|s| s.downcast_mut::<T>())
    }

    /// Runs `f(ith, nth)` on every thread of the CPU backend's configured (pinned) thread pool
    /// (`ggml_ext_cpu_parallel_v1`).
    pub fn cpu_parallel(&self, f: impl Fn(usize, usize) + Sync) -> Result<(), KernelError> {
        // SAFETY: backend is the live backend executing this kernel.
        super::sched::cpu_parallel(self.backend, &f).map_err(|e| KernelError(e.to_string()))
    }
}

/// What ggml keeps of a registered kernel (leaked: registrations are forever).
struct KernelData {
    kernel: Box<dyn Kernel>,
    name: String,
}

/// Runs a kernel callback, turning a panic into `on_panic` (logged).
fn guarded<T>(data: &KernelData, what: &str, on_panic: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log::error!("extension kernel {} panicked in {what}", data.name);
        on_panic
    })
}

/// # Safety
/// `user_data` must be a leaked `KernelData`.
unsafe fn data<'a>(user_data: *mut c_void) -> &'a KernelData {
    // SAFETY: the caller's contract.
    unsafe { &*(user_data as *const KernelData) }
}

/// # Safety
/// `nodes` must hold `n` live tensors.
unsafe fn views<'a>(nodes: *const *mut sys::ggml_tensor, n: c_int) -> Vec<TensorView<'a>> {
    // SAFETY: the caller's contract.
    (0..n.max(0) as usize).map(|i| unsafe { TensorView::from_raw(*nodes.add(i)) }).collect()
}

unsafe extern "C" fn supports_trampoline(node: *const sys::ggml_tensor, user_data: *mut c_void) -> bool {
    // SAFETY: ggml passes the registration's user data and a live node.
    let (d, view) = unsafe { (data(user_data), TensorView::from_raw(node)) };
    guarded(d, "supports", false, || d.kernel.supports(view))
}

unsafe extern "C" fn preferred_trampoline(node: *const sys::ggml_tensor, user_data: *mut c_void) -> bool {
    // SAFETY: as in supports_trampoline.
    let (d, view) = unsafe { (data(user_data), TensorView::from_raw(node)) };
    guarded(d, "preferred", false, || d.kernel.preferred(view))
}

unsafe extern "C" fn match_trampoline(graph: *const sys::ggml_cgraph, i: c_int, user_data: *mut c_void) -> c_int {
    // SAFETY: ggml passes the registration's user data and a live graph.
    let d = unsafe { data(user_data) };
    let nodes = GraphNodes { raw: graph, _life: std::marker::PhantomData };
    let i = i.max(0) as usize;
    // ggml indexes the graph with i + count: a count past the graph's end is cut to what is left.
    let left = nodes.len().saturating_sub(i);
    guarded(d, "match", 0, || d.kernel.matches(nodes, i).min(left).min(c_int::MAX as usize) as c_int)
}

unsafe extern "C" fn prepare_trampoline(
    _device: sys::ggml_backend_dev_t,
    nodes: *const *mut sys::ggml_tensor,
    n_nodes: c_int,
    state: *mut *mut c_void,
    workspace: *mut usize,
    user_data: *mut c_void,
) -> sys::ggml_status {
    // SAFETY: ggml passes the registration's user data and n_nodes live nodes.
    let (d, views) = unsafe { (data(user_data), views(nodes, n_nodes)) };
    let result = guarded(d, "prepare", Err(KernelError("panicked".into())), || d.kernel.prepare(&views));
    match result {
        Ok(p) => {
            // The state travels as a thin pointer to the boxed trait object.
            let boxed: *mut Option<Box<dyn Any + Send>> = Box::into_raw(Box::new(p.state));
            // SAFETY: ggml passes writable out-parameters.
            unsafe {
                *state = boxed.cast();
                *workspace = p.workspace;
            }
            sys::GGML_STATUS_SUCCESS
        }
        Err(e) => {
            log::error!("extension kernel {} could not prepare: {e}", d.name);
            sys::GGML_STATUS_FAILED
        }
    }
}

unsafe extern "C" fn execute_trampoline(
    backend: sys::ggml_backend_t,
    nodes: *const *mut sys::ggml_tensor,
    n_nodes: c_int,
    state: *mut c_void,
    workspace: sys::ggml_backend_buffer_t,
    user_data: *mut c_void,
) -> sys::ggml_status {
    // SAFETY: ggml passes the registration's user data.
    let d = unsafe { data(user_data) };
    // SAFETY: ggml passes n_nodes live nodes for the duration of the call.
    let nodes = unsafe { std::slice::from_raw_parts(nodes, n_nodes.max(0) as usize) };
    // SAFETY: state is null (no prepare callback ran) or the Box prepare_trampoline made, which
    // only this execution uses now.
    let state = unsafe { state.cast::<Option<Box<dyn Any + Send>>>().as_mut() }.and_then(|s| s.as_deref_mut());
    let mut run = Execution { backend, nodes, state, workspace };
    match guarded(d, "execute", Err(KernelError("panicked".into())), || d.kernel.execute(&mut run)) {
        Ok(()) => sys::GGML_STATUS_SUCCESS,
        // A kernel that stops because the computation is being aborted reports the abort, as
        // native work would.
        Err(e) if super::sched::cpu_abort_requested(backend) => {
            log::debug!("extension kernel {} stopped by the abort callback: {e}", d.name);
            sys::GGML_STATUS_ABORTED
        }
        Err(e) => {
            log::error!("extension kernel {} failed: {e}", d.name);
            sys::GGML_STATUS_FAILED
        }
    }
}

unsafe extern "C" fn destroy_trampoline(state: *mut c_void, _user_data: *mut c_void) {
    if !state.is_null() {
        // SAFETY: state is the Box prepare_trampoline made; ggml destroys it once.
        let state = unsafe { Box::from_raw(state.cast::<Option<Box<dyn Any + Send>>>()) };
        // A state whose Drop panics must not unwind into C (an abort): the panic is logged.
        if catch_unwind(AssertUnwindSafe(|| drop(state))).is_err() {
            log::error!("an extension kernel's state panicked while it was dropped");
        }
    }
}

/// Registers `kernel` for `device` as `spec` says. A name already registered on the device is
/// refused, and the first registration stays live. Register before capability queries or graph
/// allocation; a scheduler's allocation made before must be rebuilt.
pub fn register_kernel(device: Device, spec: KernelSpec, kernel: impl Kernel) -> Result<()> {
    crate::init();
    let c_name = CString::new(spec.name.as_str()).map_err(|e| Error::TextNul(e.nul_position()))?;
    let (op, ext_op) = match spec.target {
        Target::Op(op) => (op.0, std::ptr::null_mut()),
        Target::Ext(ext) => (sys::GGML_OP_CUSTOM, ext.raw()),
    };
    let data = Box::into_raw(Box::new(KernelData { kernel: Box::new(kernel), name: spec.name.clone() }));
    let desc = sys::ggml_ext_kernel_desc {
        name: c_name.as_ptr(),
        op,
        ext_op,
        priority: spec.priority,
        supports: Some(supports_trampoline),
        preferred: Some(preferred_trampoline),
        match_: spec.fusion.then_some(match_trampoline as _),
        prepare: Some(prepare_trampoline),
        execute: Some(execute_trampoline),
        destroy: Some(destroy_trampoline),
        user_data: data.cast(),
    };
    // SAFETY: desc is fully initialized; ggml copies it and the name, and keeps user_data, which
    // stays allocated for the process when the registration succeeds; the shim catches.
    let registered = unsafe { crate::shim::sluice_ext_register_kernel(device.raw(), &desc) };
    // After an exception data is left allocated: whether ggml kept it is unknown.
    crate::shim::caught("ggml_ext_register_kernel")?;
    if registered {
        return Ok(());
    }
    // SAFETY: refused: ggml kept no pointer to data.
    drop(unsafe { Box::from_raw(data) });
    Err(Error::Extension {
        call: "ggml_ext_register_kernel",
        detail: format!("kernel {} is already registered on {}, or its target is invalid", spec.name, device.name()),
    })
}

/// The name of the single-node kernel `device` would run `node` with (`None`: the native
/// implementation, or nothing).
pub fn selected_kernel(device: Device, node: TensorView<'_>) -> Option<String> {
    // SAFETY: device is a live device; node a live tensor; the result is a registration's name,
    // alive for the process.
    let p = unsafe { sys::ggml_ext_selected_kernel(device.raw(), node.raw()) };
    // SAFETY: non-null names are NUL-terminated.
    (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

impl Backend {
    /// Runs `f(ith, nth)` on every thread of this CPU backend's configured thread pool (pinned to
    /// its CPUs when it has some) through `ggml_ext_cpu_parallel_v1`, and returns when all have
    /// finished. A set abort flag stops it before it starts ([`Error::Aborted`]).
    pub fn cpu_parallel(&self, f: impl Fn(usize, usize) + Sync) -> Result<()> {
        super::sched::cpu_parallel(self.raw(), &f)
    }
}
