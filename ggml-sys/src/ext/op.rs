//! Application operators: a versioned name, attribute bytes, and output inference.

use std::ffi::{c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::{Error, GgmlType, Result, TensorView};

/// A built-in ggml operation (`enum ggml_op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlOp(pub(crate) sys::ggml_op);

impl GgmlOp {
    /// `GGML_OP_ADD`.
    pub const ADD: GgmlOp = GgmlOp(sys::GGML_OP_ADD);
    /// `GGML_OP_MUL`.
    pub const MUL: GgmlOp = GgmlOp(sys::GGML_OP_MUL);
    /// `GGML_OP_SCALE`.
    pub const SCALE: GgmlOp = GgmlOp(sys::GGML_OP_SCALE);
    /// `GGML_OP_RMS_NORM`.
    pub const RMS_NORM: GgmlOp = GgmlOp(sys::GGML_OP_RMS_NORM);
    /// `GGML_OP_MUL_MAT`.
    pub const MUL_MAT: GgmlOp = GgmlOp(sys::GGML_OP_MUL_MAT);
    /// `GGML_OP_MUL_MAT_ID`.
    pub const MUL_MAT_ID: GgmlOp = GgmlOp(sys::GGML_OP_MUL_MAT_ID);
    /// `GGML_OP_CUSTOM`: what registered operators are.
    pub const CUSTOM: GgmlOp = GgmlOp(sys::GGML_OP_CUSTOM);

    /// ggml's name of the operation (`ADD`, `MUL_MAT_ID`, ...).
    pub fn name(self) -> &'static str {
        // SAFETY: ggml_op_name indexes a static table; every GgmlOp holds a valid op.
        let p = unsafe { sys::ggml_op_name(self.0) };
        if p.is_null() {
            return "";
        }
        // SAFETY: static NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
    }
}

/// Infers an operator's output (type and shape) from its inputs and attribute bytes; `None`
/// when the inputs are invalid for it.
pub type InferFn = dyn Fn(&[TensorView<'_>], &[u8]) -> Option<(GgmlType, [i64; 4])> + Send + Sync;

/// What ggml keeps of a registered operator's callbacks (leaked: registrations are forever).
struct OpData {
    infer: Box<InferFn>,
    attr_size: usize,
}

/// A registered operator. Registrations live for the whole process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtOp {
    raw: NonNull<sys::ggml_ext_op>,
}

// SAFETY: a registered operator is immutable and lives for the process; ggml's registry is
// thread-safe.
unsafe impl Send for ExtOp {}
// SAFETY: as above.
unsafe impl Sync for ExtOp {}

impl ExtOp {
    pub(crate) fn raw(self) -> *mut sys::ggml_ext_op {
        self.raw.as_ptr()
    }

    /// The operator of a node, if it computes a registered one.
    pub fn of(node: TensorView<'_>) -> Option<ExtOp> {
        // SAFETY: node is a live tensor; the call only reads its op and op_params.
        NonNull::new(unsafe { sys::ggml_ext_op_of(node.raw()) }).map(|raw| ExtOp { raw })
    }

    /// The registered name.
    pub fn name(self) -> &'static str {
        // SAFETY: the name is owned by the registration, which lives for the process.
        let p = unsafe { sys::ggml_ext_op_name(self.raw()) };
        if p.is_null() {
            return "";
        }
        // SAFETY: non-null names are NUL-terminated and live for the process.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
    }

    /// A node's attribute bytes, if it computes a registered operator.
    pub fn attrs<'a>(node: TensorView<'a>) -> Option<&'a [u8]> {
        let op = ExtOp::of(node)?;
        // SAFETY: the node computes `op`, so its op_params hold the operator's attr_size bytes
        // of attributes at the returned address, alive as long as the node.
        let p = unsafe { sys::ggml_ext_op_attrs(node.raw()) };
        let size = op.attr_size();
        // SAFETY: see above: size bytes at p belong to the node's op_params.
        Some(if p.is_null() || size == 0 { &[] } else { unsafe { std::slice::from_raw_parts(p.cast::<u8>(), size) } })
    }

    /// Bytes of attributes the operator takes.
    pub fn attr_size(self) -> usize {
        // SAFETY: self is a live registration.
        unsafe { sys::ggml_ext_op_attr_size(self.raw()) }
    }
}

unsafe extern "C" fn infer_trampoline(
    srcs: *const *mut sys::ggml_tensor,
    n_srcs: c_int,
    attrs: *const c_void,
    ty: *mut sys::ggml_type,
    ne: *mut i64,
    user_data: *mut c_void,
) -> bool {
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: user_data is the leaked OpData of this registration.
        let data = unsafe { &*(user_data as *const OpData) };
        let views: Vec<TensorView<'_>> = (0..n_srcs.max(0) as usize)
            // SAFETY: ggml passes n_srcs live, non-null tensors (ggml_ext_op_create checks them).
            .map(|i| unsafe { TensorView::from_raw(*srcs.add(i)) })
            .collect();
        let attr_bytes = if data.attr_size == 0 || attrs.is_null() {
            &[][..]
        } else {
            // SAFETY: ggml passes the caller's attr_size bytes of attributes.
            unsafe { std::slice::from_raw_parts(attrs.cast::<u8>(), data.attr_size) }
        };
        (data.infer)(&views, attr_bytes)
    }));
    match result {
        Ok(Some((out_ty, shape))) => {
            // SAFETY: ggml passes a writable type and GGML_MAX_DIMS (4) writable extents.
            unsafe {
                *ty = out_ty.0;
                std::ptr::copy_nonoverlapping(shape.as_ptr(), ne, 4);
            }
            true
        }
        Ok(None) => false,
        Err(_) => {
            log::error!("an extension operator's output inference panicked; the node is refused");
            false
        }
    }
}

/// Registers an operator under `name` (versioned and unique, e.g. `sluice.scale_add.v1`) taking
/// `attr_size` bytes of plain attributes, whose output `infer` gives. A name already registered
/// is refused, and the first registration stays live.
pub fn register_op(
    name: &str,
    attr_size: usize,
    infer: impl Fn(&[TensorView<'_>], &[u8]) -> Option<(GgmlType, [i64; 4])> + Send + Sync + 'static,
) -> Result<ExtOp> {
    crate::init();
    let c_name = CString::new(name).map_err(|e| Error::TextNul(e.nul_position()))?;
    let data = Box::into_raw(Box::new(OpData { infer: Box::new(infer), attr_size }));
    let desc = sys::ggml_ext_op_desc {
        name: c_name.as_ptr(),
        attr_size,
        infer: Some(infer_trampoline),
        user_data: data.cast(),
    };
    // SAFETY: desc is fully initialized; ggml copies the name and keeps user_data, which is
    // leaked below when the registration succeeds. The shim catches what the registry throws.
    let raw = unsafe { crate::shim::sluice_ext_register_op(&desc) };
    // After an exception data is left allocated: whether ggml kept it is unknown.
    crate::shim::caught("ggml_ext_register_op")?;
    match NonNull::new(raw) {
        // data stays allocated for the process: ggml holds it as the registration's user data.
        Some(raw) => Ok(ExtOp { raw }),
        None => {
            // SAFETY: the registration was refused, so ggml kept no pointer to data.
            drop(unsafe { Box::from_raw(data) });
            Err(Error::Extension {
                call: "ggml_ext_register_op",
                detail: format!("operator {name} is already registered, or its {attr_size} bytes of attributes exceed what ggml keeps in op_params"),
            })
        }
    }
}

/// The operator registered under `name`, if any.
pub fn find_op(name: &str) -> Option<ExtOp> {
    crate::init();
    let c_name = CString::new(name).ok()?;
    // SAFETY: c_name is NUL-terminated; the registry is thread-safe; the shim catches.
    let raw = unsafe { crate::shim::sluice_ext_find_op(c_name.as_ptr()) };
    crate::shim::caught("ggml_ext_find_op").ok()?;
    NonNull::new(raw).map(|raw| ExtOp { raw })
}
