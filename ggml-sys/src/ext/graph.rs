//! Building ggml graphs: a context of tensor metadata, operations over its tensors, and the
//! forward graph of an output.

use std::marker::PhantomData;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use super::op::ExtOp;
use super::sched::Backend;
use crate::{Error, GgmlType, Result, TensorView};

/// A ggml context holding tensor metadata only (no data: a scheduler or [`GraphBuilder::alloc_on`]
/// allocates it).
pub struct GraphBuilder {
    ctx: NonNull<sys::ggml_context>,
    buffers: std::cell::RefCell<Vec<sys::ggml_backend_buffer_t>>,
    /// Tensors made, and the most the context has room for (ggml aborts beyond).
    made: std::cell::Cell<usize>,
    max_tensors: usize,
    /// Whether the one graph the context has room for was made.
    graph_made: std::cell::Cell<bool>,
}

/// A tensor of a [`GraphBuilder`]. An operation takes nodes that live at least as long as the
/// builder it is called on, so no graph ever points into a builder dropped before it.
#[derive(Clone, Copy)]
pub struct Node<'c> {
    raw: NonNull<sys::ggml_tensor>,
    _ctx: PhantomData<&'c GraphBuilder>,
}

impl<'c> Node<'c> {
    /// A read-only view.
    pub fn view(self) -> TensorView<'c> {
        // SAFETY: the tensor lives as long as its builder ('c).
        unsafe { TensorView::from_raw(self.raw.as_ptr()) }
    }

    /// Names the tensor (at most 63 bytes are kept).
    pub fn named(self, name: &str) -> Node<'c> {
        let c = std::ffi::CString::new(name.replace('\0', "")).unwrap_or_default();
        // SAFETY: a live tensor; ggml copies at most 63 bytes of the NUL-terminated name.
        unsafe { sys::ggml_set_name(self.raw.as_ptr(), c.as_ptr()) };
        self
    }

    /// Marks the tensor as a graph input (allocated first, set by the caller).
    pub fn input(self) -> Node<'c> {
        // SAFETY: a live tensor.
        unsafe { sys::ggml_set_input(self.raw.as_ptr()) };
        self
    }

    /// Marks the tensor as a graph output (kept until the graph ends).
    pub fn output(self) -> Node<'c> {
        // SAFETY: a live tensor.
        unsafe { sys::ggml_set_output(self.raw.as_ptr()) };
        self
    }

    /// Writes the tensor's bytes (exactly its size) into its allocated buffer.
    pub fn write(self, bytes: &[u8]) -> Result<()> {
        write_tensor(self.raw.as_ptr(), bytes)
    }

    /// Reads the tensor's bytes from its allocated buffer.
    pub fn read(self) -> Result<Vec<u8>> {
        read_tensor(self.raw.as_ptr())
    }
}

/// A tensor's name for errors.
fn name_of(t: *const sys::ggml_tensor) -> String {
    // SAFETY: callers pass live tensors.
    unsafe { TensorView::from_raw(t) }.name().to_string()
}

/// Whether a live tensor has data in a buffer (its own, or its view source's).
fn allocated(t: *const sys::ggml_tensor) -> bool {
    // SAFETY: callers pass live tensors; view_src is live when set.
    unsafe {
        !(*t).data.is_null()
            && (!(*t).buffer.is_null() || (!(*t).view_src.is_null() && !(*(*t).view_src).buffer.is_null()))
    }
}

/// Copies a tensor's bytes out of its buffer (any backend).
pub(crate) fn read_tensor(t: *const sys::ggml_tensor) -> Result<Vec<u8>> {
    if !allocated(t) {
        return Err(Error::NotAllocated(name_of(t)));
    }
    // SAFETY: a live tensor.
    let n = unsafe { sys::ggml_nbytes(t) };
    let mut out = vec![0u8; n];
    // SAFETY: the tensor is allocated (checked) and out holds its n bytes.
    unsafe { sys::ggml_backend_tensor_get(t, out.as_mut_ptr().cast(), 0, n) };
    Ok(out)
}

/// Copies `bytes` (exactly the tensor's size) into a tensor's buffer.
pub(crate) fn write_tensor(t: *mut sys::ggml_tensor, bytes: &[u8]) -> Result<()> {
    if !allocated(t) {
        return Err(Error::NotAllocated(name_of(t)));
    }
    // SAFETY: a live tensor.
    let n = unsafe { sys::ggml_nbytes(t) };
    if bytes.len() != n {
        return Err(Error::Extension {
            call: "ggml_backend_tensor_set",
            detail: format!("{} bytes for tensor {} of {n}", bytes.len(), name_of(t)),
        });
    }
    // SAFETY: the tensor is allocated (checked) and bytes holds exactly its size.
    unsafe { sys::ggml_backend_tensor_set(t, bytes.as_ptr().cast(), 0, n) };
    Ok(())
}

/// The result of a ggml constructor, or the error naming it.
fn made<'c>(raw: *mut sys::ggml_tensor, call: &'static str) -> Result<Node<'c>> {
    NonNull::new(raw)
        .map(|raw| Node { raw, _ctx: PhantomData })
        .ok_or_else(|| Error::Extension { call, detail: "ggml refused the operation's inputs".into() })
}

/// Whether two tensors' shapes broadcast as ggml's binary operations need (`b` repeats into `a`).
fn can_repeat(b: TensorView<'_>, a: TensorView<'_>) -> bool {
    a.ne().iter().zip(b.ne()).all(|(&x, y)| y > 0 && x % y == 0)
}

impl GraphBuilder {
    /// A context for up to `max_tensors` tensors and one graph.
    pub fn new(max_tensors: usize) -> Result<GraphBuilder> {
        crate::init();
        // SAFETY: pure size arithmetic.
        let mem_size = unsafe {
            sys::ggml_tensor_overhead() * max_tensors + sys::ggml_graph_overhead_custom(max_tensors.max(1), false)
        };
        let params = sys::ggml_init_params { mem_size, mem_buffer: std::ptr::null_mut(), no_alloc: true };
        // SAFETY: params is fully initialized; ggml allocates the metadata arena itself.
        let ctx = NonNull::new(unsafe { sys::ggml_init(params) })
            .ok_or(Error::Graph { call: "ggml_init", status: "allocation failed" })?;
        Ok(GraphBuilder {
            ctx,
            buffers: std::cell::RefCell::new(Vec::new()),
            made: std::cell::Cell::new(0),
            max_tensors,
            graph_made: std::cell::Cell::new(false),
        })
    }

    /// The context, once it is known to have room for one more tensor.
    fn ctx_for(&self, call: &'static str) -> Result<*mut sys::ggml_context> {
        if self.made.get() >= self.max_tensors {
            return Err(Error::Extension {
                call,
                detail: format!("the builder holds its {} tensors", self.max_tensors),
            });
        }
        self.made.set(self.made.get() + 1);
        Ok(self.ctx.as_ptr())
    }

    /// A new tensor of `ty` with up to four extents `ne`.
    pub fn tensor(&self, ty: GgmlType, ne: &[i64]) -> Result<Node<'_>> {
        if ne.is_empty() || ne.len() > 4 || ne.iter().any(|&n| n <= 0) || ty.row_size(ne[0]) == 0 {
            return Err(Error::Extension {
                call: "ggml_new_tensor",
                detail: format!("invalid shape {ne:?} for {}", ty.name()),
            });
        }
        // SAFETY: a live context with room (ctx_for); ne holds ne.len() valid extents.
        let ctx = self.ctx_for("ggml_new_tensor")?;
        // SAFETY: see above.
        made(unsafe { sys::ggml_new_tensor(ctx, ty.0, ne.len() as i32, ne.as_ptr()) }, "ggml_new_tensor")
    }

    fn binary<'c>(
        &'c self,
        a: Node<'c>,
        b: Node<'c>,
        call: &'static str,
        f: unsafe extern "C" fn(
            *mut sys::ggml_context,
            *mut sys::ggml_tensor,
            *mut sys::ggml_tensor,
        ) -> *mut sys::ggml_tensor,
    ) -> Result<Node<'c>> {
        if !can_repeat(b.view(), a.view()) {
            return Err(Error::Extension {
                call,
                detail: "the second operand does not broadcast into the first".into(),
            });
        }
        let ctx = self.ctx_for(call)?;
        // SAFETY: a context with room; live tensors with broadcastable shapes (checked).
        made(unsafe { f(ctx, a.raw.as_ptr(), b.raw.as_ptr()) }, call)
    }

    /// `a + b` (b broadcast).
    pub fn add<'c>(&'c self, a: Node<'c>, b: Node<'c>) -> Result<Node<'c>> {
        self.binary(a, b, "ggml_add", sys::ggml_add)
    }

    /// `a + b` written into `a`'s memory (an explicit in-place node, a view of `a`).
    pub fn add_inplace<'c>(&'c self, a: Node<'c>, b: Node<'c>) -> Result<Node<'c>> {
        self.binary(a, b, "ggml_add_inplace", sys::ggml_add_inplace)
    }

    /// `a * b` elementwise (b broadcast).
    pub fn mul<'c>(&'c self, a: Node<'c>, b: Node<'c>) -> Result<Node<'c>> {
        self.binary(a, b, "ggml_mul", sys::ggml_mul)
    }

    /// `a * s`.
    pub fn scale<'c>(&'c self, a: Node<'c>, s: f32) -> Result<Node<'c>> {
        let ctx = self.ctx_for("ggml_scale")?;
        // SAFETY: a context with room and a live tensor.
        made(unsafe { sys::ggml_scale(ctx, a.raw.as_ptr(), s) }, "ggml_scale")
    }

    /// RMS norm over rows of `a`.
    pub fn rms_norm<'c>(&'c self, a: Node<'c>, eps: f32) -> Result<Node<'c>> {
        let ctx = self.ctx_for("ggml_rms_norm")?;
        // SAFETY: a context with room and a live tensor.
        made(unsafe { sys::ggml_rms_norm(ctx, a.raw.as_ptr(), eps) }, "ggml_rms_norm")
    }

    /// A registered operator over `srcs` with attribute bytes `attrs` (exactly its size).
    pub fn ext<'c>(&'c self, op: ExtOp, srcs: &[Node<'c>], attrs: &[u8]) -> Result<Node<'c>> {
        if attrs.len() != op.attr_size() {
            return Err(Error::Extension {
                call: "ggml_ext_op_create",
                detail: format!("{} takes {} bytes of attributes, not {}", op.name(), op.attr_size(), attrs.len()),
            });
        }
        let mut raws: Vec<*mut sys::ggml_tensor> = srcs.iter().map(|n| n.raw.as_ptr()).collect();
        let ctx = self.ctx_for("ggml_ext_op_create")?;
        // SAFETY: a context with room; live tensors; attrs holds the operator's attribute bytes;
        // ggml copies them and checks the inputs through the operator's inference; the shim
        // catches.
        let raw = unsafe {
            crate::shim::sluice_ext_op_create(
                ctx,
                op.raw(),
                raws.as_mut_ptr(),
                raws.len() as i32,
                attrs.as_ptr().cast(),
            )
        };
        crate::shim::caught("ggml_ext_op_create")?;
        NonNull::new(raw).map(|raw| Node { raw, _ctx: PhantomData }).ok_or_else(|| Error::Extension {
            call: "ggml_ext_op_create",
            detail: format!("{} refused its inputs", op.name()),
        })
    }

    /// The forward graph computing `out` (one per builder).
    pub fn graph<'c>(&'c self, out: Node<'c>) -> Result<Graph<'c>> {
        if self.graph_made.replace(true) {
            return Err(Error::Extension { call: "ggml_new_graph", detail: "a builder makes one graph".into() });
        }
        // SAFETY: a live context with room for its one graph of max_tensors nodes (reserved in
        // new), as many as the builder can make, so ggml never finds the graph full.
        let raw = unsafe { sys::ggml_new_graph_custom(self.ctx.as_ptr(), self.max_tensors.max(1), false) };
        // SAFETY: raw is a live graph of this context; out a live tensor.
        unsafe { sys::ggml_build_forward_expand(raw, out.raw.as_ptr()) };
        Ok(Graph { raw, _ctx: PhantomData })
    }

    /// Allocates every tensor of the builder in one buffer of `backend` (for
    /// [`Backend::compute`]); the buffer is freed with the builder.
    pub fn alloc_on(&self, backend: &Backend) -> Result<()> {
        // SAFETY: a live context whose tensors are unallocated and a live backend.
        let buf = unsafe { sys::ggml_backend_alloc_ctx_tensors(self.ctx.as_ptr(), backend.raw()) };
        if buf.is_null() {
            return Err(Error::Graph { call: "ggml_backend_alloc_ctx_tensors", status: "allocation failed" });
        }
        self.buffers.borrow_mut().push(buf);
        Ok(())
    }
}

impl Drop for GraphBuilder {
    fn drop(&mut self) {
        for &b in self.buffers.borrow().iter() {
            // SAFETY: buffers this builder allocated, freed once.
            unsafe { sys::ggml_backend_buffer_free(b) };
        }
        // SAFETY: ctx is live and freed once.
        unsafe { sys::ggml_free(self.ctx.as_ptr()) };
    }
}

/// A forward graph of a [`GraphBuilder`].
pub struct Graph<'c> {
    raw: *mut sys::ggml_cgraph,
    _ctx: PhantomData<&'c GraphBuilder>,
}

impl Graph<'_> {
    pub(crate) fn raw(&self) -> *mut sys::ggml_cgraph {
        self.raw
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        // SAFETY: a live graph.
        unsafe { sys::ggml_graph_n_nodes(self.raw).max(0) as usize }
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The name of the first node or input that has no data (never allocated, or detached
    /// from a scheduler's buffers); `None` when every one has.
    pub(crate) fn unallocated(&self) -> Option<String> {
        for i in 0..self.len() {
            // SAFETY: i < n_nodes of a live graph.
            let node = unsafe { sys::ggml_graph_node(self.raw, i as i32) };
            // SAFETY: nodes of a live graph are live; their sources too.
            let srcs = unsafe { (*node).src };
            for t in std::iter::once(node).chain(srcs.into_iter().filter(|s| !s.is_null())) {
                // SAFETY: a live tensor.
                let empty = unsafe { sys::ggml_nbytes(t) } == 0;
                if !empty && !allocated(t) {
                    return Some(name_of(t));
                }
            }
        }
        None
    }
}
