//! An inference context: decode, logits, greedy choice, memory clear, and the eval callback.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::threadpool::{ThreadPool, Threads};
use crate::{Batch, Error, Model, Result, TensorView};

/// When the eval callback is being called for a graph node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalPhase {
    /// Before scheduling: answer `true` to have the node computed alone and be called again
    /// with [`EvalPhase::Computed`]; `false` lets it run grouped with its neighbours.
    Ask,
    /// The node asked for has been computed and synchronized; its consumers have not run yet.
    /// Answer `true` to continue; `false` stops the graph.
    Computed,
}

/// The eval callback: called on ggml's compute path between nodes. It must not block on anything
/// but work it started itself. A panic is caught and logged, stops the graph, and fails the
/// decode with [`Error::CallbackPanicked`].
pub type EvalCallback<'m> = Box<dyn FnMut(TensorView<'_>, EvalPhase) -> bool + Send + 'm>;

/// The eval callback at the heap address llama.cpp holds, and whether it panicked in the
/// decode under way.
struct CallbackCell<'m> {
    callback: EvalCallback<'m>,
    panicked: bool,
}

/// Context sizes and threads.
#[derive(Debug, Clone)]
pub struct ContextParams {
    /// Context length in tokens.
    pub n_ctx: u32,
    /// Largest batch passed to one decode.
    pub n_batch: u32,
    /// Physical batch (ubatch) size.
    pub n_ubatch: u32,
    /// Compute threads: how many, and where they run.
    pub threads: Threads,
}

/// The bytes a context holds, as llama.cpp accounts them (vendor patch 0003), summed over every
/// buffer type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemorySizes {
    /// Model weights in backend buffers (0 for weights left in the file mapping).
    pub model: u64,
    /// Context memory: the KV cache.
    pub context: u64,
    /// Compute buffers reserved for the graph.
    pub compute: u64,
}

/// An inference context over a borrowed [`Model`].
pub struct Context<'m> {
    raw: *mut sys::llama_context,
    n_vocab: usize,
    // The thread pool attached to raw; dropped after raw is freed.
    _pool: Option<ThreadPool>,
    // The callback cell whose address llama.cpp holds as cb_eval_user_data (from
    // Box::into_raw; freed in Drop after raw).
    callback: Option<*mut CallbackCell<'m>>,
    // The abort flag whose address llama.cpp holds as abort_callback_data; dropped after raw.
    abort: Option<Arc<AtomicBool>>,
    model: &'m Model,
}

// SAFETY: a llama_context may be used from any one thread at a time; Context is not Sync, and the
// callback it owns is Send.
unsafe impl Send for Context<'_> {}

unsafe extern "C" fn eval_trampoline(t: *mut sys::ggml_tensor, ask: bool, ud: *mut c_void) -> bool {
    // SAFETY: ud came from Box::into_raw of the CallbackCell the Context owns, which outlives
    // every decode that can call this; ggml calls the callback from one thread at a time, and
    // nothing else touches the cell while a decode runs.
    let cell = unsafe { &mut *ud.cast::<CallbackCell<'_>>() };
    if cell.panicked {
        return false;
    }
    // SAFETY: ggml passes a live graph node that is not written while the callback runs.
    let view = unsafe { TensorView::from_raw(t) };
    let phase = if ask { EvalPhase::Ask } else { EvalPhase::Computed };
    match catch_unwind(AssertUnwindSafe(|| (cell.callback)(view, phase))) {
        Ok(answer) => answer,
        Err(_) => {
            log::error!("eval callback panicked at node {}; stopping the graph", view.name());
            cell.panicked = true;
            false
        }
    }
}

unsafe extern "C" fn abort_trampoline(data: *mut c_void) -> bool {
    // SAFETY: data is the address of the AtomicBool inside the Arc the Context holds in `abort`,
    // which outlives every decode that can call this.
    let flag = unsafe { &*data.cast::<AtomicBool>() };
    flag.load(Ordering::Relaxed)
}

fn decode_meaning(status: i32) -> &'static str {
    match status {
        1 => "no KV cache slot for the batch: the context is full",
        2 => "aborted",
        -1 => "invalid batch",
        _ => "compute error",
    }
}

impl<'m> Context<'m> {
    /// Creates a context over `model`, with an optional eval callback.
    pub fn new(model: &'m Model, params: &ContextParams, callback: Option<EvalCallback<'m>>) -> Result<Context<'m>> {
        // SAFETY: returns a plain struct of defaults.
        let mut p = unsafe { sys::llama_context_default_params() };
        p.n_ctx = params.n_ctx;
        p.n_batch = params.n_batch;
        p.n_ubatch = params.n_ubatch;
        p.n_seq_max = 1;
        p.n_threads = params.threads.count.max(1) as i32;
        p.n_threads_batch = p.n_threads;
        p.no_perf = true;
        let callback = callback.map(|callback| Box::into_raw(Box::new(CallbackCell { callback, panicked: false })));
        if let Some(cell) = callback {
            p.cb_eval = Some(eval_trampoline);
            p.cb_eval_user_data = cell.cast();
        }
        let free_callback = || {
            if let Some(cell) = callback {
                // SAFETY: the cell came from Box::into_raw above and no llama_context holds it.
                drop(unsafe { Box::from_raw(cell) });
            }
        };
        // SAFETY: model.raw() is live for 'm; p is fully initialized; the callback cell (if any)
        // is owned by the returned Context and so outlives the llama_context.
        let raw = unsafe { crate::shim::sluice_init_from_model(model.raw(), p) };
        if let Err(e) = crate::shim::caught("llama_init_from_model") {
            free_callback();
            model.check_workers()?;
            return Err(e);
        }
        if raw.is_null() {
            free_callback();
            model.check_workers()?;
            return Err(Error::ContextCreate { n_ctx: params.n_ctx, n_batch: params.n_batch });
        }
        let pool = if params.threads.cpus.is_empty() {
            None
        } else {
            let pool = match ThreadPool::new(&params.threads) {
                Ok(pool) => pool,
                Err(e) => {
                    // SAFETY: raw is the live context just created and not yet shared.
                    unsafe { sys::llama_free(raw) };
                    free_callback();
                    return Err(e);
                }
            };
            // SAFETY: raw is live; the pool outlives it (both owned by the returned Context, the
            // pool dropped after llama_free). The same pool serves single-token and batch decodes.
            unsafe { sys::llama_attach_threadpool(raw, pool.raw(), pool.raw()) };
            Some(pool)
        };
        Ok(Context { raw, n_vocab: model.n_vocab(), _pool: pool, callback, abort: None, model })
    }

    /// The context length.
    pub fn n_ctx(&self) -> u32 {
        // SAFETY: live context.
        unsafe { sys::llama_n_ctx(self.raw) }
    }

    /// What this context and its model hold. Over a metadata-only model, the sizes the
    /// allocations would have.
    pub fn memory_sizes(&self) -> MemorySizes {
        // SAFETY: live context; the call only reads its buffer bookkeeping.
        let m = unsafe { sys::llama_get_memory_sizes(self.raw) };
        MemorySizes { model: m.model as u64, context: m.context as u64, compute: m.compute as u64 }
    }

    /// [`Context::memory_sizes`] on this process's CPU device and host buffers only: without
    /// what RPC workers hold.
    pub fn local_memory_sizes(&self) -> MemorySizes {
        // SAFETY: returns the process-wide CPU device (NULL only in a build without one).
        let cpu = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
        self.device_sizes(cpu)
    }

    /// [`Context::memory_sizes`] on one RPC worker only: its share of the model, KV cache and
    /// compute buffers.
    pub fn worker_memory_sizes(&self, worker: &crate::RpcDevice) -> MemorySizes {
        self.device_sizes(worker.raw())
    }

    fn device_sizes(&self, dev: sys::ggml_backend_dev_t) -> MemorySizes {
        if dev.is_null() {
            return MemorySizes { model: 0, context: 0, compute: 0 };
        }
        // SAFETY: live context and a live device; the call only reads buffer bookkeeping.
        let m = unsafe { sys::llama_get_device_memory_sizes(self.raw, dev) };
        MemorySizes { model: m.model as u64, context: m.context as u64, compute: m.compute as u64 }
    }

    /// Makes every later decode check `flag` between graph nodes: once it is set, the decode
    /// stops and returns [`Error::Aborted`]. `None` removes the check.
    pub fn set_abort_flag(&mut self, flag: Option<Arc<AtomicBool>>) {
        match &flag {
            // SAFETY: live context; the flag's address stays valid while self.abort holds the
            // Arc, which is replaced only here, after llama.cpp has been given the new address.
            Some(f) => unsafe {
                sys::llama_set_abort_callback(self.raw, Some(abort_trampoline), Arc::as_ptr(f).cast_mut().cast())
            },
            // SAFETY: live context; no callback, no data.
            None => unsafe { sys::llama_set_abort_callback(self.raw, None, std::ptr::null_mut()) },
        }
        self.abort = flag;
    }

    /// Runs the model over `batch`. A panic of the eval callback during it is an error.
    pub fn decode(&mut self, batch: &Batch) -> Result<()> {
        let running = self.model.begin_decode();
        // SAFETY: live context; the batch arrays are valid for batch.len() tokens.
        let status = unsafe { crate::shim::sluice_decode(self.raw, batch.raw()) };
        drop(running);
        let caught = crate::shim::caught("llama_decode");
        // A lost worker computed nothing: whatever the status says, its result is not the model's.
        self.model.check_workers()?;
        caught?;
        if let Some(cell) = self.callback {
            // SAFETY: the decode has returned, so ggml no longer calls the callback; &mut self
            // excludes any other access to the cell.
            let cell = unsafe { &mut *cell };
            if std::mem::take(&mut cell.panicked) {
                return Err(Error::CallbackPanicked("eval callback"));
            }
        }
        if status == 2 && self.abort.as_ref().is_some_and(|f| f.load(Ordering::Relaxed)) {
            return Err(Error::Aborted);
        }
        if status != 0 {
            return Err(Error::Decode { status, meaning: decode_meaning(status) });
        }
        Ok(())
    }

    /// The logits of batch position `i` of the last decode (`-1`: the last position).
    pub fn logits(&self, i: i32) -> Result<&[f32]> {
        // SAFETY: live context; llama.cpp range-checks i and returns NULL when invalid.
        let p = unsafe { sys::llama_get_logits_ith(self.raw, i) };
        if p.is_null() {
            return Err(Error::NoLogits(i));
        }
        // SAFETY: a logits row holds n_vocab floats and stays valid until the next decode, which
        // needs &mut self.
        Ok(unsafe { std::slice::from_raw_parts(p, self.n_vocab) })
    }

    /// The llama.cpp handle, for the sampler.
    pub(crate) fn raw(&self) -> *mut sys::llama_context {
        self.raw
    }

    /// Forgets every cached position (KV cache cleared, data too).
    pub fn clear_memory(&mut self) {
        // SAFETY: live context; the memory handle belongs to it.
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.raw), true) };
    }

    /// Forgets the cached positions from `pos` on (rejected draft tokens); `Err` when the
    /// model's memory cannot drop a tail (recurrent state).
    pub fn forget_from(&mut self, pos: i32) -> Result<()> {
        // SAFETY: live context; the memory handle belongs to it; sequence 0 is the only one used
        // and p1 = -1 means "to the end".
        let ok = unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.raw), 0, pos, -1) };
        if ok {
            Ok(())
        } else {
            Err(Error::Decode { status: -1, meaning: "the model's memory cannot forget rejected draft tokens" })
        }
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: raw came from llama_init_from_model and is freed exactly once, before the
        // thread pool (a field, dropped after this body) and the callback cell it points into.
        unsafe { sys::llama_free(self.raw) };
        if let Some(cell) = self.callback.take() {
            // SAFETY: the cell came from Box::into_raw in Context::new; the llama_context that
            // held its address is freed.
            drop(unsafe { Box::from_raw(cell) });
        }
    }
}
