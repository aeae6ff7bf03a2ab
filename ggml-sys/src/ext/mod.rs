//! The operator-extension mechanism of the patched ggml (vendor patch 0005, `ggml-ext.h`):
//! application operators ([`register_op`]), kernels and fusion rules for a device
//! ([`register_kernel`]), and the backend services their kernels run through
//! ([`Backend::cpu_parallel`]), with the graphs, backends and scheduler to use them.
//!
//! Registrations live for the whole process: their callbacks and user data are leaked on
//! purpose, so they stay alive until every graph and backend that may dispatch to them is gone.
//! Callbacks catch panics and report them through ggml's error path (a failed status, or "not
//! supported").

mod graph;
mod kernel;
mod op;
pub mod routed;
mod sched;

pub use graph::{Graph, GraphBuilder, Node};
pub use kernel::{
    register_kernel, selected_kernel, Execution, GraphNodes, Kernel, KernelError, KernelSpec, Prepared, Target,
};
pub use op::{find_op, register_op, ExtOp, GgmlOp};
pub use sched::{Backend, Device, Scheduler};

use llama_cpp_sys_2 as sys;

/// ggml's status code in words.
fn status_name(status: sys::ggml_status) -> &'static str {
    match status {
        sys::GGML_STATUS_SUCCESS => "success",
        sys::GGML_STATUS_ABORTED => "aborted",
        sys::GGML_STATUS_ALLOC_FAILED => "allocation failed",
        sys::GGML_STATUS_FAILED => "failed",
        _ => "unknown status",
    }
}

/// `Ok` for `GGML_STATUS_SUCCESS`, else [`crate::Error::Graph`] (or [`crate::Error::Aborted`]).
fn check_status(call: &'static str, status: sys::ggml_status) -> crate::Result<()> {
    match status {
        sys::GGML_STATUS_SUCCESS => Ok(()),
        sys::GGML_STATUS_ABORTED => Err(crate::Error::Aborted),
        s => Err(crate::Error::Graph { call, status: status_name(s) }),
    }
}
