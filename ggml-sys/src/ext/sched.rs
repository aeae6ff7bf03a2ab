//! Devices, backends and the backend scheduler, as extension kernels run under them.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use super::graph::Graph;
use super::{check_status, status_name};
use crate::threadpool::{ThreadPool, Threads};
use crate::{Error, EvalPhase, Result, TensorView};

/// A ggml backend device (registered for the process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    raw: sys::ggml_backend_dev_t,
}

// SAFETY: devices are registered once and live for the process; their queries are thread-safe.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    pub(crate) fn raw(self) -> sys::ggml_backend_dev_t {
        self.raw
    }

    /// The CPU device.
    pub fn cpu() -> Device {
        crate::init();
        // SAFETY: the CPU backend is always registered (crate::init loads the backends).
        let raw = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
        assert!(!raw.is_null(), "ggml always registers the CPU device");
        Device { raw }
    }

    /// The device's name (`CPU`, `CUDA0`, ...).
    pub fn name(self) -> String {
        // SAFETY: a live device; the name is a NUL-terminated string it owns.
        unsafe { CStr::from_ptr(sys::ggml_backend_dev_name(self.raw)) }.to_string_lossy().into_owned()
    }

    /// Every device registered (CPU, GPUs, accelerators).
    pub fn all() -> Vec<Device> {
        crate::init();
        // SAFETY: no preconditions once the backends are initialized.
        let n = unsafe { sys::ggml_backend_dev_count() };
        // SAFETY: i < count; devices live for the process.
        (0..n).map(|i| Device { raw: unsafe { sys::ggml_backend_dev_get(i) } }).collect()
    }

    /// The physical CUDA ordinal of this device, found through `ggml_ext_cuda_device_v1` before
    /// any backend exists (`None`: not a CUDA device, or a build without CUDA).
    pub fn cuda_ordinal(self) -> Option<i32> {
        let service = cuda_service::<sys::ggml_ext_cuda_device_v1>(c"ggml_ext_cuda_device_v1")?;
        // SAFETY: the CUDA registry's static table; the function takes any device.
        let ordinal = unsafe { service.ordinal?(self.raw) };
        (ordinal >= 0).then_some(ordinal)
    }

    /// The public capability query: whether the device (natively, or through a registered
    /// single-node kernel) computes `node`.
    pub fn supports(self, node: TensorView<'_>) -> bool {
        // SAFETY: a live device and node.
        unsafe { sys::ggml_backend_dev_supports_op(self.raw, node.raw()) }
    }
}

/// A CPU backend with its own thread pool (pinned when [`Threads::cpus`] names CPUs) and an
/// optional abort flag.
pub struct Backend {
    raw: sys::ggml_backend_t,
    // Dropped after the backend (see Drop): the backend computes with it.
    _pool: Option<ThreadPool>,
    abort: Option<Arc<AtomicBool>>,
}

// SAFETY: a backend is used from one thread at a time (&mut or owning calls), and its worker
// threads are ggml's own.
unsafe impl Send for Backend {}

unsafe extern "C" fn abort_trampoline(data: *mut c_void) -> bool {
    // SAFETY: data is the AtomicBool of the Arc the backend holds while the callback is set.
    catch_unwind(|| unsafe { &*(data as *const AtomicBool) }.load(Ordering::Relaxed)).unwrap_or(true)
}

impl Backend {
    /// A backend of `device` with its default parameters (a CUDA device's backend, say).
    pub fn of(device: Device) -> Result<Backend> {
        // SAFETY: a live device; no parameters.
        let raw = unsafe { sys::ggml_backend_dev_init(device.raw, std::ptr::null()) };
        if raw.is_null() {
            return Err(Error::Graph { call: "ggml_backend_dev_init", status: status_name(sys::GGML_STATUS_FAILED) });
        }
        Ok(Backend { raw, _pool: None, abort: None })
    }

    /// The CUDA device ordinal and stream (a `cudaStream_t`, as an address) of a CUDA backend,
    /// borrowed through `ggml_ext_cuda_context_v1`: work queued on it is ordered with the
    /// backend's own. `None` for other backends.
    pub fn cuda_stream(&self) -> Option<(i32, usize)> {
        let service = cuda_service::<sys::ggml_ext_cuda_context_v1>(c"ggml_ext_cuda_context_v1")?;
        let (mut device, mut stream) = (-1, std::ptr::null_mut());
        // SAFETY: the CUDA registry's static table; borrow checks the backend is a CUDA one and
        // writes both out-parameters only then.
        unsafe { service.borrow?(self.raw, &mut device, &mut stream) }.then_some((device, stream as usize))
    }

    /// A CPU backend computing with `threads`.
    pub fn cpu(threads: &Threads) -> Result<Backend> {
        crate::init();
        // SAFETY: no preconditions; returns null on failure.
        let raw = unsafe { sys::ggml_backend_cpu_init() };
        if raw.is_null() {
            return Err(Error::Graph {
                call: "ggml_backend_cpu_init",
                status: status_name(sys::GGML_STATUS_ALLOC_FAILED),
            });
        }
        let count = threads.count.max(1);
        // SAFETY: raw is a live CPU backend.
        unsafe { sys::ggml_backend_cpu_set_n_threads(raw, count as i32) };
        let pool = if threads.cpus.is_empty() {
            None
        } else {
            let pool = match ThreadPool::new(threads) {
                Ok(p) => p,
                Err(e) => {
                    // SAFETY: raw is live and freed once, here.
                    unsafe { sys::ggml_backend_free(raw) };
                    return Err(e);
                }
            };
            // SAFETY: both live; the pool outlives the backend (field order and Drop).
            unsafe { sys::ggml_backend_cpu_set_threadpool(raw, pool.raw()) };
            Some(pool)
        };
        Ok(Backend { raw, _pool: pool, abort: None })
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_t {
        self.raw
    }

    /// The backend's device.
    pub fn device(&self) -> Device {
        // SAFETY: a live backend.
        Device { raw: unsafe { sys::ggml_backend_get_device(self.raw) } }
    }

    /// Makes computations (and [`Backend::cpu_parallel`]) stop once `flag` is set.
    pub fn set_abort_flag(&mut self, flag: Option<Arc<AtomicBool>>) {
        match flag {
            Some(flag) => {
                let data = Arc::as_ptr(&flag).cast_mut().cast();
                // SAFETY: the callback reads the flag through data, which stays allocated (the
                // Arc is kept in self.abort) until it is replaced or the backend is freed.
                unsafe { sys::ggml_backend_cpu_set_abort_callback(self.raw, Some(abort_trampoline), data) };
                self.abort = Some(flag);
            }
            None => {
                // SAFETY: clearing the callback; no data is referenced afterwards.
                unsafe { sys::ggml_backend_cpu_set_abort_callback(self.raw, None, std::ptr::null_mut()) };
                self.abort = None;
            }
        }
    }

    /// Computes `graph` directly on this backend (`ggml_backend_graph_compute`): its tensors
    /// must have been allocated ([`super::GraphBuilder::alloc_on`]); a graph with a tensor
    /// without data is [`Error::NotAllocated`]. Single-node extension kernels run with
    /// temporary plans; nothing is fused.
    pub fn compute(&self, graph: &Graph<'_>) -> Result<()> {
        if let Some(name) = graph.unallocated() {
            return Err(Error::NotAllocated(name));
        }
        // SAFETY: a live backend and graph whose every tensor has data (checked above).
        let status = unsafe { sys::ggml_backend_graph_compute(self.raw, graph.raw()) };
        check_status("ggml_backend_graph_compute", status)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: raw is live and freed once; the pool (dropped after) is no longer used.
        unsafe { sys::ggml_backend_free(self.raw) };
    }
}

/// The service table `name` of the CUDA registry, when this build has one.
fn cuda_service<T>(name: &CStr) -> Option<&'static T> {
    crate::init();
    // SAFETY: the name is NUL-terminated; returns null when no CUDA backend is registered.
    let reg = unsafe { sys::ggml_backend_reg_by_name(c"CUDA".as_ptr()) };
    if reg.is_null() {
        return None;
    }
    // SAFETY: a live registry; the CUDA registry returns its static table for this name.
    let table = unsafe { sys::ggml_backend_reg_get_proc_address(reg, name.as_ptr()) }.cast::<T>();
    // SAFETY: static tables live for the process.
    unsafe { table.as_ref() }
}

/// The parallel task handed through C: the closure to run.
struct Task<'f> {
    f: &'f (dyn Fn(usize, usize) + Sync),
    panicked: AtomicBool,
}

unsafe extern "C" fn task_trampoline(user_data: *mut c_void, ith: i32, nth: i32) {
    // SAFETY: user_data is the Task that cpu_parallel keeps alive until run returns.
    let task = unsafe { &*(user_data as *const Task<'_>) };
    if catch_unwind(AssertUnwindSafe(|| (task.f)(ith.max(0) as usize, nth.max(1) as usize))).is_err() {
        task.panicked.store(true, Ordering::Relaxed);
    }
}

/// Runs `f` on every thread of the CPU backend `backend` through `ggml_ext_cpu_parallel_v1`.
/// The CPU parallel service table of `backend`'s registry, if it offers one.
fn cpu_service(backend: sys::ggml_backend_t) -> Option<&'static sys::ggml_ext_cpu_parallel_v1> {
    // SAFETY: a live backend; its device and registry live for the process.
    let reg = unsafe { sys::ggml_backend_dev_backend_reg(sys::ggml_backend_get_device(backend)) };
    // SAFETY: reg is live; the name is NUL-terminated.
    let service = unsafe { sys::ggml_backend_reg_get_proc_address(reg, c"ggml_ext_cpu_parallel_v1".as_ptr()) }
        .cast::<sys::ggml_ext_cpu_parallel_v1>();
    // SAFETY: the CPU registry returns a pointer to its static service table (or null).
    unsafe { service.as_ref() }
}

/// Whether `backend` is a CPU backend whose abort callback asks to stop now.
pub(crate) fn cpu_abort_requested(backend: sys::ggml_backend_t) -> bool {
    // SAFETY: backend is live; the service reads its abort callback.
    cpu_service(backend).and_then(|s| s.abort_requested).is_some_and(|f| unsafe { f(backend) })
}

pub(crate) fn cpu_parallel(backend: sys::ggml_backend_t, f: &(dyn Fn(usize, usize) + Sync)) -> Result<()> {
    let run = cpu_service(backend).and_then(|s| s.run).ok_or_else(|| Error::Extension {
        call: "ggml_ext_cpu_parallel_v1",
        detail: "the backend offers no CPU parallel service (not a CPU backend)".into(),
    })?;
    let task = Task { f, panicked: AtomicBool::new(false) };
    // SAFETY: task outlives the call, which returns only after every thread has run it.
    let status = unsafe { run(backend, Some(task_trampoline), (&task as *const Task<'_>).cast_mut().cast()) };
    if task.panicked.load(Ordering::Relaxed) {
        return Err(Error::CallbackPanicked("parallel CPU callback"));
    }
    check_status("ggml_ext_cpu_parallel_v1", status)
}

/// The scheduler's eval callback, boxed at a stable address.
type SchedCallback = Box<dyn FnMut(TensorView<'_>, EvalPhase) -> bool + Send>;

unsafe extern "C" fn sched_eval_trampoline(t: *mut sys::ggml_tensor, ask: bool, user_data: *mut c_void) -> bool {
    // SAFETY: user_data is the Box<SchedCallback> the scheduler owns while it is set; ggml calls
    // it from the computing thread only.
    let cb = unsafe { &mut *(user_data as *mut SchedCallback) };
    // SAFETY: t is a live graph node for the call.
    let view = unsafe { TensorView::from_raw(t) };
    let phase = if ask { EvalPhase::Ask } else { EvalPhase::Computed };
    catch_unwind(AssertUnwindSafe(|| cb(view, phase))).unwrap_or(false)
}

/// ggml's backend scheduler over some backends: splits graphs by device, selects extension
/// kernels and fusion rules, allocates compute buffers and workspace, and computes.
///
/// The graphs it allocates must outlive it (`'b`): when it allocates another graph, and when it
/// is dropped, the tensors it allocated are detached from its buffers (their data reads as
/// unallocated), so no tensor ever points into freed memory.
pub struct Scheduler<'b> {
    raw: sys::ggml_backend_sched_t,
    backends: Vec<sys::ggml_backend_t>,
    callback: Option<Box<SchedCallback>>,
    /// The graphs allocated, whose tensors may point into the scheduler's buffers.
    allocated: Vec<*mut sys::ggml_cgraph>,
    _life: std::marker::PhantomData<&'b Backend>,
}

impl<'b> Scheduler<'b> {
    /// A scheduler over `backends` (highest priority first) for graphs of up to `graph_size`
    /// nodes; `parallel` makes pipeline copies (several copies disable fusion).
    pub fn new(backends: &[&'b Backend], graph_size: usize, parallel: bool) -> Result<Scheduler<'b>> {
        let mut raws: Vec<sys::ggml_backend_t> = backends.iter().map(|b| b.raw).collect();
        // SAFETY: raws holds live backends that outlive the scheduler ('b); null buffer types
        // mean each backend's default; the shim catches.
        let raw = unsafe {
            crate::shim::sluice_sched_new(
                raws.as_mut_ptr(),
                std::ptr::null_mut(),
                raws.len() as i32,
                graph_size,
                parallel,
                true,
            )
        };
        crate::shim::caught("ggml_backend_sched_new")?;
        if raw.is_null() {
            return Err(Error::Graph { call: "ggml_backend_sched_new", status: "failed" });
        }
        Ok(Scheduler { raw, backends: raws, callback: None, allocated: Vec::new(), _life: std::marker::PhantomData })
    }

    /// Sizes the compute buffers (and extension workspace) for `graph` without computing it:
    /// kernels prepare here, before tensors have addresses. Reserving may replace the buffers,
    /// so every graph allocated before is detached first (allocate it again to compute it).
    pub fn reserve(&mut self, graph: &Graph<'_>) -> Result<()> {
        self.detach_all();
        // SAFETY: a live scheduler and graph; no allocated graph points into its buffers; the
        // shim catches.
        let reserved = unsafe { crate::shim::sluice_sched_reserve(self.raw, graph.raw()) };
        crate::shim::caught("ggml_backend_sched_reserve")?;
        if reserved {
            Ok(())
        } else {
            Err(Error::Graph { call: "ggml_backend_sched_reserve", status: "failed" })
        }
    }

    /// Bytes of compute buffer (extension workspace included) the scheduler holds on `backend`
    /// (0 for a backend it does not use).
    pub fn buffer_size(&self, backend: &Backend) -> usize {
        if !self.backends.contains(&backend.raw) {
            return 0;
        }
        // SAFETY: backend is one of the scheduler's (checked: ggml aborts otherwise).
        unsafe { sys::ggml_backend_sched_get_buffer_size(self.raw, backend.raw) }
    }

    /// Allocates `graph`'s tensors (detaching those of every graph allocated before).
    pub fn alloc(&mut self, graph: &'b Graph<'_>) -> Result<()> {
        self.detach_all();
        // SAFETY: a live scheduler and graph; the scheduler must be reset before a new
        // allocation, which reset does.
        unsafe { sys::ggml_backend_sched_reset(self.raw) };
        // SAFETY: as above; the shim catches.
        let allocated = unsafe { crate::shim::sluice_sched_alloc_graph(self.raw, graph.raw()) };
        let caught = crate::shim::caught("ggml_backend_sched_alloc_graph");
        self.allocated.push(graph.raw());
        if allocated && caught.is_ok() {
            return Ok(());
        }
        // Whatever it allocated before failing is detached at once.
        self.detach_all();
        Err(caught.err().unwrap_or(Error::Graph { call: "ggml_backend_sched_alloc_graph", status: "failed" }))
    }

    /// Computes `graph`, which must be the graph last allocated by [`Scheduler::alloc`] (and
    /// not detached since by another allocation or a reservation): anything else is
    /// [`Error::NotAllocated`].
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<()> {
        if self.allocated.last() != Some(&graph.raw()) {
            return Err(Error::NotAllocated("the graph (allocate it with Scheduler::alloc first)".into()));
        }
        // SAFETY: a live scheduler and the graph it allocated last, still attached; the shim
        // catches.
        let status = unsafe { crate::shim::sluice_sched_graph_compute(self.raw, graph.raw()) };
        crate::shim::caught("ggml_backend_sched_graph_compute")?;
        check_status("ggml_backend_sched_graph_compute", status)
    }

    /// Sets (or clears) the eval callback; takes effect at the next allocation.
    pub fn set_eval_callback(&mut self, callback: Option<SchedCallback>) {
        match callback {
            Some(cb) => {
                let mut boxed = Box::new(cb);
                let data = (&mut *boxed as *mut SchedCallback).cast();
                // SAFETY: data stays allocated (self.callback) until replaced or the scheduler
                // is freed.
                unsafe { sys::ggml_backend_sched_set_eval_callback(self.raw, Some(sched_eval_trampoline), data) };
                self.callback = Some(boxed);
            }
            None => {
                // SAFETY: clearing; nothing is referenced afterwards.
                unsafe { sys::ggml_backend_sched_set_eval_callback(self.raw, None, std::ptr::null_mut()) };
                self.callback = None;
            }
        }
    }

    /// The name of the backend a node of the allocated graph was assigned to.
    pub fn backend_of(&self, node: super::Node<'_>) -> Option<String> {
        let node = node.view();
        // SAFETY: a live scheduler; the node belongs to a graph it split.
        let b = unsafe { sys::ggml_backend_sched_get_tensor_backend(self.raw, node.raw().cast_mut()) };
        // SAFETY: non-null backends are live; their names are NUL-terminated.
        (!b.is_null()).then(|| unsafe { CStr::from_ptr(sys::ggml_backend_name(b)) }.to_string_lossy().into_owned())
    }
}

impl Scheduler<'_> {
    /// Detaches the tensors of every graph allocated so far from the scheduler's buffers.
    fn detach_all(&mut self) {
        for graph in self.allocated.drain(..) {
            // SAFETY: graphs allocated by this scheduler outlive it ('b on alloc).
            unsafe { detach(graph) };
        }
    }
}

/// Clears the data of the tensors of `graph` that live in compute buffers (a scheduler's),
/// views of them included; weights and other buffers' tensors keep theirs.
///
/// # Safety
/// `graph` must be a live graph, not being computed.
unsafe fn detach(graph: *mut sys::ggml_cgraph) {
    let compute = |t: *mut sys::ggml_tensor| -> bool {
        // SAFETY: live tensors of a live graph; buffers set on them are live (the scheduler
        // that owns them has not freed them yet).
        unsafe {
            let owner = if (*t).view_src.is_null() { t } else { (*t).view_src };
            let buf = (*owner).buffer;
            !buf.is_null() && sys::ggml_backend_buffer_get_usage(buf) == sys::GGML_BACKEND_BUFFER_USAGE_COMPUTE
        }
    };
    // SAFETY: the caller's contract; node indices are in range, and nodes' sources (the
    // graph's leafs among them) are live tensors.
    unsafe {
        let mut tensors: Vec<*mut sys::ggml_tensor> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for i in 0..sys::ggml_graph_n_nodes(graph) {
            let node = sys::ggml_graph_node(graph, i);
            let srcs = (*node).src.iter().copied().chain([(*node).view_src]);
            for t in std::iter::once(node).chain(srcs) {
                if !t.is_null() && seen.insert(t as usize) {
                    tensors.push(t);
                }
            }
        }
        // Decide for all first: a view's source is cleared in the same pass.
        let clear: Vec<bool> = tensors.iter().map(|&t| compute(t)).collect();
        for (&t, clear) in tensors.iter().zip(clear) {
            if clear {
                (*t).data = std::ptr::null_mut();
                (*t).buffer = std::ptr::null_mut();
            }
        }
    }
}

impl Drop for Scheduler<'_> {
    fn drop(&mut self) {
        self.detach_all();
        // SAFETY: raw is live and freed once; the callback box is dropped after.
        unsafe { sys::ggml_backend_sched_free(self.raw) };
    }
}
