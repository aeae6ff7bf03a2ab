//! The operands of a `MUL_MAT_ID` node as the routed product reads them, and the layout of its
//! workspace.

use std::ffi::c_int;

use llama_cpp_sys_2 as sys;

use super::super::kernel::KernelError;
use super::super::op::GgmlOp;
use super::err;
use crate::TensorView;

/// The operands of one `MUL_MAT_ID` node, checked as ggml-cpu asserts them.
pub(super) struct Shape {
    pub(super) wtype: sys::ggml_type,
    pub(super) vec_dot: unsafe extern "C" fn(
        c_int,
        *mut f32,
        usize,
        *const std::ffi::c_void,
        usize,
        *const std::ffi::c_void,
        usize,
        c_int,
    ),
    /// The conversion of the activations, when they are not already of the `vec_dot_type`.
    pub(super) from_float: Option<unsafe extern "C" fn(*const f32, *mut std::ffi::c_void, i64)>,
    pub(super) ne00: i64,
    pub(super) ne01: i64,
    pub(super) n_as: i64,
    pub(super) nb01: usize,
    pub(super) nb02: usize,
    pub(super) ne10: i64,
    pub(super) ne11: i64,
    pub(super) ne12: i64,
    pub(super) nb11: usize,
    pub(super) nb12: usize,
    pub(super) src1_cont: bool,
    pub(super) n_ids: i64,
    pub(super) ids_nb: [usize; 2],
    pub(super) dst_nb: [usize; 2],
    /// Bytes of one converted activation row.
    pub(super) row_size: usize,
}

/// Where each part of the workspace lies (byte offsets from a 64-aligned base).
pub(super) struct Layout {
    pub(super) conv: usize,
    pub(super) offsets: usize,
    pub(super) rows: usize,
    pub(super) state: usize,
    pub(super) total: usize,
}

pub(super) const ALIGN: usize = 64;

/// Schedule words per expert: the next chunk to hand out, whether its weights are ready, and
/// how many of its chunks are done.
pub(super) const STATE_WORDS: usize = 3;

pub(super) fn align(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Shape {
    pub(super) fn of(node: TensorView<'_>) -> Result<Shape, KernelError> {
        // SAFETY: a live node (TensorView's contract).
        let t = unsafe { &*node.raw() };
        if GgmlOp(t.op) != GgmlOp::MUL_MAT_ID {
            return Err(err(format!("{} is not a MUL_MAT_ID node", node.name())));
        }
        let (src0, src1, ids) = match (node.src(0), node.src(1), node.src(2)) {
            (Some(a), Some(b), Some(c)) => (a, b, c),
            _ => return Err(err(format!("{} lacks an operand", node.name()))),
        };
        // SAFETY: live sources of a live node.
        let (w, a, i) = unsafe { (&*src0.raw(), &*src1.raw(), &*ids.raw()) };
        // SAFETY: w.type_ is a type of a live tensor; ggml's CPU trait table covers every type.
        let traits = unsafe { sys::ggml_get_type_traits_cpu(w.type_).as_ref() }
            .ok_or_else(|| err(format!("{}: no CPU traits for {}", src0.name(), src0.ty().name())))?;
        let vec_dot = traits
            .vec_dot
            .ok_or_else(|| err(format!("{}: no CPU dot product for {}", src0.name(), src0.ty().name())))?;
        let vdt = traits.vec_dot_type;
        // SAFETY: type-table lookups for valid types.
        let (w_size, a_size, vdt_blck) =
            unsafe { (sys::ggml_type_size(w.type_), sys::ggml_type_size(a.type_), sys::ggml_blck_size(vdt)) };
        let from_float = if a.type_ == vdt {
            None
        } else {
            if a.type_ != sys::GGML_TYPE_F32 {
                return Err(err(format!("{}: activations of type {} ", node.name(), src1.ty().name())));
            }
            // SAFETY: as for the weights' traits.
            let f = unsafe { sys::ggml_get_type_traits_cpu(vdt).as_ref() }.and_then(|t| t.from_float);
            Some(f.ok_or_else(|| err(format!("{}: no CPU conversion to the dot-product type", node.name())))?)
        };
        let ok = t.type_ == sys::GGML_TYPE_F32
            && t.nb[0] == 4
            && t.nb[0] <= t.nb[1]
            && t.nb[1] <= t.nb[2]
            && t.nb[2] <= t.nb[3]
            && w.nb[0] == w_size
            && a.nb[0] == a_size
            && w.ne[3] == 1
            && a.ne[3] == 1
            && a.ne[0] == w.ne[0]
            && vdt_blck > 0
            && a.ne[0] % vdt_blck == 0
            && i.type_ == sys::GGML_TYPE_I32
            && i.ne[1] == a.ne[2]
            && t.ne[0] == w.ne[1]
            && t.ne[1] == i.ne[0]
            && t.ne[2] == a.ne[2]
            && a.ne[1] >= 1
            && w.extra.is_null()
            && i32::try_from(w.ne[0]).is_ok()
            && u32::try_from(w.ne[2]).is_ok();
        if !ok {
            return Err(err(format!(
                "{}: operands of a shape or layout ggml-cpu's MUL_MAT_ID does not take",
                node.name()
            )));
        }
        // SAFETY: a valid type and a row length that is a multiple of its block size (checked).
        let row_size = unsafe { sys::ggml_row_size(vdt, a.ne[0]) };
        Ok(Shape {
            wtype: w.type_,
            vec_dot,
            from_float,
            ne00: w.ne[0],
            ne01: w.ne[1],
            n_as: w.ne[2],
            nb01: w.nb[1],
            nb02: w.nb[2],
            ne10: a.ne[0],
            ne11: a.ne[1],
            ne12: a.ne[2],
            nb11: a.nb[1],
            nb12: a.nb[2],
            // SAFETY: a live tensor.
            src1_cont: unsafe { sys::ggml_is_contiguous(a) },
            n_ids: i.ne[0],
            ids_nb: [i.nb[0], i.nb[1]],
            dst_nb: [t.nb[1], t.nb[2]],
            row_size,
        })
    }

    pub(super) fn slots(&self) -> usize {
        (self.n_ids * self.ne12) as usize
    }

    pub(super) fn layout(&self) -> Layout {
        let n_as = self.n_as as usize;
        let conv_bytes = if self.from_float.is_some() { self.row_size * (self.ne11 * self.ne12) as usize } else { 0 };
        let conv = 0;
        let offsets = align(conv + conv_bytes, 8);
        let rows = align(offsets + (n_as + 1) * 4, 8);
        let state = align(rows + self.slots() * 8, ALIGN);
        let end = state + n_as * STATE_WORDS * 4;
        // Slack to align the buffer's base.
        Layout { conv, offsets, rows, state, total: end + ALIGN }
    }
}
