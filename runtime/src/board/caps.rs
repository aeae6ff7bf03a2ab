//! What this build of sluice and its llama.cpp can do that a profile may ask for.

/// What this build offers that a profile may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildCaps {
    /// GPU offload (the `cuda` feature and a GPU backend).
    pub gpu: bool,
    /// `ggml_ext_cpu_parallel_v1`: extension work on the CPU backend's pinned pool.
    pub cpu_parallel: bool,
    /// The first CUDA device's physical ordinal, looked up through `ggml_ext_cuda_device_v1`
    /// before any backend is created.
    pub cuda_ordinal: Option<i32>,
}

impl BuildCaps {
    /// What the linked llama.cpp offers.
    pub fn of_this_build() -> BuildCaps {
        let services = ggml_sys::extension_services();
        BuildCaps {
            gpu: ggml_sys::supports_gpu_offload(),
            cpu_parallel: services.iter().any(|s| s.name == "ggml_ext_cpu_parallel_v1" && s.backend.is_some()),
            cuda_ordinal: ggml_sys::ext::Device::all().into_iter().find_map(|d| d.cuda_ordinal()),
        }
    }
}
