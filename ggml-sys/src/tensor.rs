//! A read-only view of a live ggml graph tensor, as handed to the eval callback.

use std::ffi::CStr;
use std::marker::PhantomData;

use llama_cpp_sys_2 as sys;

use crate::GgmlType;

/// A borrowed, read-only view of a `ggml_tensor` that is alive for `'a` (the duration of one
/// eval-callback call, or of the model that owns a weight).
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    raw: *const sys::ggml_tensor,
    _life: PhantomData<&'a sys::ggml_tensor>,
}

impl<'a> TensorView<'a> {
    /// # Safety
    /// `raw` must be non-null and point to a `ggml_tensor` that stays valid and is not written
    /// by anyone else for `'a`.
    pub(crate) unsafe fn from_raw(raw: *const sys::ggml_tensor) -> Self {
        TensorView { raw, _life: PhantomData }
    }

    pub(crate) fn raw(&self) -> *const sys::ggml_tensor {
        self.raw
    }

    fn t(&self) -> &'a sys::ggml_tensor {
        // SAFETY: from_raw's contract: raw is valid and unaliased by writers for 'a.
        unsafe { &*self.raw }
    }

    /// The tensor's identity: its address, the same in every graph that uses it while it lives.
    pub fn key(&self) -> usize {
        self.raw as usize
    }

    /// The tensor's name (`blk.0.ffn_up_exps.weight`, `ffn_moe_topk-3`, ...).
    pub fn name(&self) -> &'a str {
        // SAFETY: ggml keeps `name` NUL-terminated within its 64 bytes.
        unsafe { CStr::from_ptr(self.t().name.as_ptr()) }.to_str().unwrap_or("")
    }

    /// The layer whose router ranking this is, when it is llama.cpp's top-k node of a MoE layer
    /// (`ffn_moe_topk-<il>`).
    pub fn moe_topk_layer(&self) -> Option<u32> {
        self.name().strip_prefix("ffn_moe_topk-")?.parse().ok()
    }

    /// The operation that produces it (`NONE` for weights, `MUL_MAT_ID`, `VIEW`, ...).
    pub fn op_name(&self) -> &'static str {
        crate::ext::GgmlOp(self.t().op).name()
    }

    /// Element type.
    pub fn ty(&self) -> GgmlType {
        GgmlType(self.t().type_)
    }

    /// Shape in ggml order.
    pub fn ne(&self) -> [i64; 4] {
        self.t().ne
    }

    /// Byte strides in ggml order.
    pub fn nb(&self) -> [usize; 4] {
        self.t().nb
    }

    /// Total bytes of the tensor's data (`ggml_nbytes`).
    pub fn n_bytes(&self) -> usize {
        // SAFETY: raw is a valid tensor (from_raw's contract).
        unsafe { sys::ggml_nbytes(self.raw) }
    }

    /// The `i`-th source operand, if present (`i < 10`).
    pub fn src(&self, i: usize) -> Option<TensorView<'a>> {
        let p = *self.t().src.get(i)?;
        // SAFETY: graph sources live at least as long as the node that reads them.
        (!p.is_null()).then(|| unsafe { TensorView::from_raw(p) })
    }

    /// The address of the tensor's data (null before allocation). An address only: use
    /// [`TensorView::host_bytes`] to read it.
    pub fn data_addr(&self) -> usize {
        self.t().data as usize
    }

    /// The tensor's data address and size, when its buffer lives in host memory and it is
    /// allocated.
    fn host_span(&self) -> Option<(*mut u8, usize)> {
        let t = self.t();
        if t.data.is_null() {
            return None;
        }
        // A view (no own buffer) lives in its view_src's buffer.
        let buffer = if t.buffer.is_null() && !t.view_src.is_null() {
            // SAFETY: view_src is a live tensor of the same graph.
            unsafe { (*t.view_src).buffer }
        } else {
            t.buffer
        };
        // SAFETY: buffer is either null (checked) or a live backend buffer of this graph.
        if buffer.is_null() || !unsafe { sys::ggml_backend_buffer_is_host(buffer) } {
            return None;
        }
        Some((t.data.cast::<u8>(), self.n_bytes()))
    }

    /// Whether the tensor's bytes live in host memory and are allocated (what
    /// [`TensorView::read_host_bytes`] and [`TensorView::write_host_bytes`] need). No reference
    /// into them is ever handed out: the graph's kernels write them while a view exists.
    pub fn has_host_bytes(&self) -> bool {
        self.host_span().is_some()
    }

    /// A copy of `len` bytes of the tensor from `offset`, when its buffer lives in host memory
    /// and the range is inside the tensor.
    pub fn read_host_bytes(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let (data, size) = self.host_span()?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: [offset, offset + len) lies within the tensor's host bytes (checked); the
        // node is computed and ggml is paused between nodes while a view is used (eval callback),
        // so nothing writes them during the copy; `out` is a separate allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.add(offset), out.as_mut_ptr(), len) };
        Some(out)
    }

    /// The i32 element at `[i0, i1]`, read through the tensor's strides (a view's rows may lie
    /// far apart), when its buffer lives in host memory and the element lies inside its bytes.
    pub fn i32_at(&self, i0: usize, i1: usize) -> Option<i32> {
        let [nb0, nb1, ..] = self.nb();
        let at = i0.checked_mul(nb0)?.checked_add(i1.checked_mul(nb1)?)?;
        let raw = self.read_host_bytes(at, 4)?;
        Some(i32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]))
    }

    /// Overwrites the tensor's bytes from `offset` with `bytes`, when its buffer lives in host
    /// memory and the range is inside the tensor. For the eval callback's computed phase only: the
    /// node's consumers (which then read the new bytes) have not run. Returns whether it wrote.
    pub fn write_host_bytes(&self, offset: usize, bytes: &[u8]) -> bool {
        let Some((data, size)) = self.host_span() else { return false };
        if offset.checked_add(bytes.len()).is_none_or(|end| end > size) {
            return false;
        }
        // SAFETY: [offset, offset + len) lies within the tensor's host bytes (checked above);
        // during the eval callback ggml's compute is paused between nodes, so nothing else
        // reads or writes this tensor, and no Rust reference into the bytes exists (this type
        // hands out copies only); `bytes` is the caller's separate memory.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(offset), bytes.len()) };
        true
    }
}

impl std::fmt::Debug for TensorView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorView")
            .field("name", &self.name())
            .field("op", &self.op_name())
            .field("ty", &self.ty())
            .field("ne", &self.ne())
            .finish()
    }
}

/// A weight tensor of a loaded model, found in a graph during capture. Valid for as long as the
/// model (`'m`) lives: llama.cpp allocates weight tensors once at load and frees them with the
/// model. The handle is not `Send`: it is used on the thread that found it, and
/// [`WeightTensor::rebind`] checks that no decode of another thread runs over the model.
#[derive(Clone, Copy)]
pub struct WeightTensor<'m> {
    raw: *mut sys::ggml_tensor,
    model: &'m crate::Model,
}

impl<'a> TensorView<'a> {
    /// This tensor as a weight of `model`, if it is one of `model`'s tensors (looked up by name
    /// in the model, and the same tensor) and lives in a host weights buffer (not a graph
    /// intermediate, and not on a device or an RPC worker, whose data pointer is not this
    /// process's memory).
    pub fn as_weight<'m>(&self, model: &'m crate::Model) -> Option<WeightTensor<'m>> {
        let t = self.t();
        if t.buffer.is_null() || !t.view_src.is_null() || model.tensor_named(self.name()) != Some(self.raw) {
            return None;
        }
        // SAFETY: buffer is a live backend buffer (non-null, checked).
        let (usage, host) =
            unsafe { (sys::ggml_backend_buffer_get_usage(t.buffer), sys::ggml_backend_buffer_is_host(t.buffer)) };
        (usage == sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS && host)
            .then_some(WeightTensor { raw: self.raw.cast_mut(), model })
    }
}

impl<'m> WeightTensor<'m> {
    /// A read-only view of the tensor.
    pub fn view(&self) -> TensorView<'m> {
        // SAFETY: weight tensors live as long as the model ('m).
        unsafe { TensorView::from_raw(self.raw) }
    }

    /// Points the tensor's data at `reservation`'s base, so ggml's kernels read the tensor from
    /// there. The model keeps the reservation alive until it is freed, so the pointer never
    /// dangles. Allowed between decodes, and from the eval callback of a decode this thread runs
    /// over the model (before the node that reads the tensor computes); refused with
    /// [`crate::Error::RebindWhileDecoding`] while a decode of another thread runs over the
    /// model, which could be reading the tensor. No decode can start during the write.
    pub fn rebind(&self, reservation: std::sync::Arc<crate::Reservation>) -> crate::Result<()> {
        let base = reservation.base_ptr();
        let raw = self.raw;
        self.model
            .while_no_other_decode(|| {
                // SAFETY: raw is a live weight tensor of the model (as_weight checked it); no
                // decode of another thread runs or can start (the model's decode gate is held),
                // and a decode of this thread has not computed the node reading it yet (the
                // caller's contract above, which only ordering in this thread can break); the new
                // data pointer refers to memory the model keeps alive (below).
                unsafe { (*raw).data = base.cast() };
            })
            .ok_or_else(|| crate::Error::RebindWhileDecoding { tensor: self.view().name().to_string() })?;
        self.model.keep_alive(reservation);
        Ok(())
    }
}
