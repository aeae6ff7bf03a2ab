//! The exception-catching wrappers of `shim.cpp`: same signatures as the llama.cpp functions
//! they wrap, and [`caught`], which turns an exception thrown in the last call on this thread
//! into an [`Error`].

use std::ffi::{c_char, CStr};

use llama_cpp_sys_2 as sys;

use crate::Error;

unsafe extern "C" {
    fn sluice_shim_take_error(buf: *mut c_char, len: usize) -> bool;
    pub(crate) fn sluice_model_tensor(model: *const sys::llama_model, name: *const c_char) -> *const sys::ggml_tensor;
    pub(crate) fn sluice_gguf_init_from_file(
        fname: *const c_char,
        params: sys::gguf_init_params,
    ) -> *mut sys::gguf_context;
    pub(crate) fn sluice_model_load_from_file(
        path: *const c_char,
        params: sys::llama_model_params,
    ) -> *mut sys::llama_model;
    pub(crate) fn sluice_init_from_model(
        model: *mut sys::llama_model,
        params: sys::llama_context_params,
    ) -> *mut sys::llama_context;
    pub(crate) fn sluice_decode(ctx: *mut sys::llama_context, batch: sys::llama_batch) -> i32;
    pub(crate) fn sluice_tokenize(
        vocab: *const sys::llama_vocab,
        text: *const c_char,
        text_len: i32,
        tokens: *mut sys::llama_token,
        n_tokens_max: i32,
        add_special: bool,
        parse_special: bool,
        abort: *const u8,
    ) -> i32;
    pub(crate) fn sluice_ext_register_op(desc: *const sys::ggml_ext_op_desc) -> sys::ggml_ext_op_t;
    pub(crate) fn sluice_ext_find_op(name: *const c_char) -> sys::ggml_ext_op_t;
    pub(crate) fn sluice_ext_op_create(
        ctx: *mut sys::ggml_context,
        op: sys::ggml_ext_op_t,
        srcs: *mut *mut sys::ggml_tensor,
        n_srcs: i32,
        attrs: *const std::ffi::c_void,
    ) -> *mut sys::ggml_tensor;
    pub(crate) fn sluice_ext_register_kernel(
        device: sys::ggml_backend_dev_t,
        desc: *const sys::ggml_ext_kernel_desc,
    ) -> bool;
    pub(crate) fn sluice_sched_new(
        backends: *mut sys::ggml_backend_t,
        bufts: *mut sys::ggml_backend_buffer_type_t,
        n_backends: i32,
        graph_size: usize,
        parallel: bool,
        op_offload: bool,
    ) -> sys::ggml_backend_sched_t;
    pub(crate) fn sluice_sched_reserve(sched: sys::ggml_backend_sched_t, graph: *mut sys::ggml_cgraph) -> bool;
    pub(crate) fn sluice_sched_alloc_graph(sched: sys::ggml_backend_sched_t, graph: *mut sys::ggml_cgraph) -> bool;
    pub(crate) fn sluice_sched_graph_compute(
        sched: sys::ggml_backend_sched_t,
        graph: *mut sys::ggml_cgraph,
    ) -> sys::ggml_status;
    pub(crate) fn sluice_token_to_piece(
        vocab: *const sys::llama_vocab,
        token: sys::llama_token,
        buf: *mut c_char,
        length: i32,
        lstrip: i32,
        special: bool,
    ) -> i32;
}

/// `Err` with the message of the exception the last shimmed call on this thread threw in
/// `call`, if it threw.
pub(crate) fn caught(call: &'static str) -> Result<(), Error> {
    let mut buf = [0 as c_char; 2048];
    // SAFETY: buf is writable for its length; the shim writes a NUL-terminated message into it.
    if !unsafe { sluice_shim_take_error(buf.as_mut_ptr(), buf.len()) } {
        return Ok(());
    }
    // SAFETY: the shim NUL-terminated the message within buf.
    let message = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    Err(Error::Exception { call, message })
}
