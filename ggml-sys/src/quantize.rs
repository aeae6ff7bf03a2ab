//! Model quantization through `llama_model_quantize`.

use std::ffi::CString;
use std::path::Path;

use llama_cpp_sys_2 as sys;

use crate::{Error, Result};

/// Target types for [`quantize`] (llama.cpp's `LLAMA_FTYPE_*` mixes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    /// 8-bit blocks of 32 (`Q8_0`).
    Q8_0,
    /// The 4-bit k-quant mix (`Q4_K_M`: Q4_K with Q6_K for sensitive tensors).
    Q4KM,
    /// 6-bit k-quants (`Q6_K`).
    Q6K,
    /// MXFP4 routed experts and Q8_0 elsewhere (`MXFP4_MOE`, as gpt-oss ships).
    Mxfp4Moe,
    /// bfloat16 matrices (`BF16`).
    Bf16,
}

impl QuantType {
    fn ftype(self) -> sys::llama_ftype {
        match self {
            QuantType::Q8_0 => sys::LLAMA_FTYPE_MOSTLY_Q8_0,
            QuantType::Q4KM => sys::LLAMA_FTYPE_MOSTLY_Q4_K_M,
            QuantType::Q6K => sys::LLAMA_FTYPE_MOSTLY_Q6_K,
            QuantType::Mxfp4Moe => sys::LLAMA_FTYPE_MOSTLY_MXFP4_MOE,
            QuantType::Bf16 => sys::LLAMA_FTYPE_MOSTLY_BF16,
        }
    }
}

/// Quantizes the model at `input` into `output` with `n_threads` threads (0: llama.cpp picks).
pub fn quantize(input: &Path, output: &Path, ty: QuantType, n_threads: u32) -> Result<()> {
    crate::init();
    let c_in = CString::new(input.as_os_str().as_encoded_bytes()).map_err(|_| Error::PathNul(input.into()))?;
    let c_out = CString::new(output.as_os_str().as_encoded_bytes()).map_err(|_| Error::PathNul(output.into()))?;
    // SAFETY: returns a plain struct of defaults (all pointers NULL).
    let mut params = unsafe { sys::llama_model_quantize_default_params() };
    params.ftype = ty.ftype();
    params.nthread = n_threads.min(i32::MAX as u32) as i32;
    // SAFETY: both paths are NUL-terminated and params is a fully initialized struct that
    // outlives the call.
    let status = unsafe { sys::llama_model_quantize(c_in.as_ptr(), c_out.as_ptr(), &params) };
    if status != 0 {
        return Err(Error::Quantize { input: input.into(), output: output.into() });
    }
    Ok(())
}
