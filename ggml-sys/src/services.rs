//! What the linked ggml offers beyond the CPU: GPU offload, and the backend extension services of
//! the operator-extension mechanism, looked up by name on every registered backend.

use std::ffi::{CStr, CString};

use llama_cpp_sys_2 as sys;

/// The extension services the runtime can use when the linked ggml provides them.
pub const EXTENSION_SERVICES: [&str; 3] =
    ["ggml_ext_cpu_parallel_v1", "ggml_ext_cuda_context_v1", "ggml_ext_cuda_device_v1"];

/// One extension service and the backend that provides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceLookup {
    /// The service's name.
    pub name: &'static str,
    /// The registered backend that returned an address for it (`None`: absent everywhere).
    pub backend: Option<String>,
}

/// Looks up each of [`EXTENSION_SERVICES`] through `ggml_backend_reg_get_proc_address` on every
/// registered backend.
pub fn extension_services() -> Vec<ServiceLookup> {
    crate::init();
    // SAFETY: no preconditions once the backends are initialized.
    let n = unsafe { sys::ggml_backend_reg_count() };
    EXTENSION_SERVICES
        .iter()
        .map(|&name| {
            let c_name = CString::new(name).expect("service names hold no NUL");
            let backend = (0..n).find_map(|i| {
                // SAFETY: i < ggml_backend_reg_count(); registrations live for the process.
                let reg = unsafe { sys::ggml_backend_reg_get(i) };
                // SAFETY: reg is a live registration; c_name is NUL-terminated. The returned
                // address is only compared with NULL, never called.
                let addr = unsafe { sys::ggml_backend_reg_get_proc_address(reg, c_name.as_ptr()) };
                // SAFETY: reg_name returns a static NUL-terminated string.
                (!addr.is_null())
                    .then(|| unsafe { CStr::from_ptr(sys::ggml_backend_reg_name(reg)) }.to_string_lossy().into_owned())
            });
            ServiceLookup { name, backend }
        })
        .collect()
}

/// The registered backends' names (`CPU`, `CUDA`, ...).
pub fn backends() -> Vec<String> {
    crate::init();
    // SAFETY: as in extension_services.
    let n = unsafe { sys::ggml_backend_reg_count() };
    (0..n)
        .map(|i| {
            // SAFETY: i is in range; the name is a static NUL-terminated string.
            unsafe { CStr::from_ptr(sys::ggml_backend_reg_name(sys::ggml_backend_reg_get(i))) }
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// Whether this build can offload layers to a GPU: a GPU device is registered (a `cuda` build
/// on a machine whose GPU its driver finds). llama.cpp's own `llama_supports_gpu_offload` also
/// says yes for the RPC backend, which every sluice build has, so it is not asked.
pub fn supports_gpu_offload() -> bool {
    crate::init();
    // SAFETY: no preconditions once the backends are initialized.
    let n = unsafe { sys::ggml_backend_dev_count() };
    (0..n).any(|i| {
        // SAFETY: i < ggml_backend_dev_count(); devices live for the process.
        let kind = unsafe { sys::ggml_backend_dev_type(sys::ggml_backend_dev_get(i)) };
        kind == sys::GGML_BACKEND_DEVICE_TYPE_GPU || kind == sys::GGML_BACKEND_DEVICE_TYPE_IGPU
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cpu_backend_offers_the_parallel_service_of_vendor_patch_0005() {
        assert!(super::backends().iter().any(|b| b == "CPU"));
        let found = super::extension_services();
        assert_eq!(found.len(), 3);
        assert_eq!(found[0].backend.as_deref(), Some("CPU"), "{found:?}");
        let cuda = super::backends().iter().any(|b| b == "CUDA");
        assert!(found[1..].iter().all(|s| s.backend.is_some() == cuda), "{found:?}");
        // The RPC backend, in every build, is no GPU.
        assert!(super::backends().iter().any(|b| b == "RPC"));
        if !cuda {
            assert!(!super::supports_gpu_offload());
        }
    }
}
