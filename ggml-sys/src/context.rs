//! An inference context: decode, logits, greedy choice, memory clear, and the eval callback.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::threadpool::{ThreadPool, Threads};
use crate::{Batch, Error, GgmlType, Model, Result, TensorView};

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
    /// Context length in tokens, over all sequences: each of the `n_seq` sequences holds
    /// `n_ctx / n_seq` positions in a KV cache of its own.
    pub n_ctx: u32,
    /// Sequences the context keeps apart (1 to [`MAX_SEQUENCES`]): the slots of a server.
    pub n_seq: u32,
    /// Largest batch passed to one decode.
    pub n_batch: u32,
    /// Physical batch (ubatch) size.
    pub n_ubatch: u32,
    /// Compute threads: how many, and where they run.
    pub threads: Threads,
    /// The KV cache's element type for keys (llama.cpp's default: f16).
    pub type_k: GgmlType,
    /// The KV cache's element type for values (a quantized one needs flash attention, which
    /// llama.cpp then turns on).
    pub type_v: GgmlType,
}

/// The most sequences a context can keep (llama.cpp's `LLAMA_MAX_SEQ`).
pub const MAX_SEQUENCES: u32 = 256;

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
    // Sequences kept apart (the context's n_seq_max).
    n_seq: u32,
    // The thread pool attached to raw; dropped after raw is freed (a ComputeThreads handle may
    // keep it alive longer: freeing it then only stops its threads).
    pool: Option<Arc<ThreadPool>>,
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
        if params.n_seq == 0 || params.n_seq > MAX_SEQUENCES || params.n_ctx < params.n_seq {
            return Err(Error::Sequences { n_seq: params.n_seq, n_ctx: params.n_ctx });
        }
        p.n_ctx = params.n_ctx;
        p.n_batch = params.n_batch;
        p.n_ubatch = params.n_ubatch;
        p.n_seq_max = params.n_seq;
        p.kv_unified = false;
        p.n_threads = params.threads.count.max(1) as i32;
        p.n_threads_batch = p.n_threads;
        p.type_k = params.type_k.0;
        p.type_v = params.type_v.0;
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
            if (params.type_k, params.type_v) != (GgmlType::F16, GgmlType::F16) {
                let (k, v) = (params.type_k.name(), params.type_v.name());
                return Err(Error::KvCacheTypes { n_ctx: params.n_ctx, n_batch: params.n_batch, k, v });
            }
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
            Some(Arc::new(pool))
        };
        Ok(Context { raw, n_vocab: model.n_vocab(), n_seq: params.n_seq, pool, callback, abort: None, model })
    }

    /// A handle on the context's compute threads (when it has its own pool: pinned threads).
    pub fn compute_threads(&self) -> Option<crate::ComputeThreads> {
        self.pool.as_ref().map(|p| crate::ComputeThreads::new(Arc::clone(p)))
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

    /// `seq` as llama.cpp's id, when this context has it (llama.cpp asserts on others).
    fn seq_id(&self, seq: u32) -> Result<sys::llama_seq_id> {
        if seq < self.n_seq {
            Ok(seq as sys::llama_seq_id)
        } else {
            Err(Error::NoSequence { seq, n_seq: self.n_seq })
        }
    }

    /// Forgets sequence `seq`'s cached positions from `pos` on (rejected draft tokens, the
    /// tail a new prompt does not share); `Err` when the model's memory cannot drop a tail
    /// (recurrent state) or there is no such sequence.
    pub fn forget_from(&mut self, seq: u32, pos: i32) -> Result<()> {
        let id = self.seq_id(seq)?;
        // SAFETY: live context; the memory handle belongs to it; id < n_seq_max (checked above,
        // what llama.cpp asserts); p1 = -1 means "to the end".
        let ok = unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.raw), id, pos.max(0), -1) };
        if ok {
            Ok(())
        } else {
            Err(Error::Decode { status: -1, meaning: "the model's memory cannot forget rejected draft tokens" })
        }
    }

    /// Forgets everything sequence `seq` holds (every memory can).
    pub fn forget_sequence(&mut self, seq: u32) -> Result<()> {
        let id = self.seq_id(seq)?;
        // SAFETY: live context; id < n_seq_max; p0 = p1 = -1 is the whole sequence, which every
        // memory type removes.
        unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.raw), id, -1, -1) };
        Ok(())
    }

    /// How many positions sequence `seq` holds (its last position + 1; 0 when empty).
    pub fn positions_held(&self, seq: u32) -> Result<u32> {
        let id = self.seq_id(seq)?;
        // SAFETY: live context; the memory handle belongs to it; id < n_seq_max.
        let max = unsafe { sys::llama_memory_seq_pos_max(sys::llama_get_memory(self.raw), id) };
        Ok((max + 1).max(0) as u32)
    }

    /// Sequence `seq`'s state (its KV cells, or recurrent state), as llama.cpp serializes it.
    pub fn sequence_state(&self, seq: u32) -> Result<Vec<u8>> {
        let id = self.seq_id(seq)?;
        // SAFETY: live context, valid id; llama.cpp catches its own exceptions in the state
        // functions (0 on error) and asserts only on the id and on device states (not used).
        let size = unsafe { sys::llama_state_seq_get_size(self.raw, id) };
        if size == 0 {
            return Err(Error::SequenceState("llama.cpp could not size the sequence's state"));
        }
        let mut bytes = vec![0u8; size];
        // SAFETY: bytes has room for `size` bytes, the size llama.cpp just reported for this id.
        let written = unsafe { sys::llama_state_seq_get_data(self.raw, bytes.as_mut_ptr(), size, id) };
        if written != size {
            return Err(Error::SequenceState("llama.cpp wrote a sequence state of another size than it said"));
        }
        Ok(bytes)
    }

    /// Puts back a state [`Context::sequence_state`] returned (from a context of the same
    /// model and shape) into sequence `seq`, replacing what it held. On failure the sequence is
    /// left empty. Only bytes this process or a checked file produced belong here: llama.cpp
    /// trusts their positions.
    pub fn set_sequence_state(&mut self, seq: u32, state: &[u8]) -> Result<()> {
        let id = self.seq_id(seq)?;
        // SAFETY: live context, valid id; `state` is readable for its length; llama.cpp reads
        // within that length and reports a short or mismatched state (another stream count,
        // layer count or cache type) by catching its own exception and returning 0.
        let read = unsafe { sys::llama_state_seq_set_data(self.raw, state.as_ptr(), state.len(), id) };
        if read == 0 {
            self.forget_sequence(seq)?;
            return Err(Error::SequenceState("llama.cpp refused the saved sequence state (another model or shape)"));
        }
        Ok(())
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
