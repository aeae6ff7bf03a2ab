//! The compute service a board runs on: the profile's choice against what this build has.

use super::caps::BuildCaps;
use super::profile::{BoardProfile, ServiceName};
use super::BoardError;

/// The compute service a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeService {
    /// ggml's CPU thread pool on the compute cores.
    Cpu,
    /// Dense layers on the GPU, experts kept in CPU buffers and streamed.
    Cuda {
        /// Layers offloaded.
        n_gpu_layers: u32,
    },
}

impl ComputeService {
    /// Layers offloaded to a GPU (0 on the cpu service).
    pub fn gpu_layers(&self) -> u32 {
        match self {
            ComputeService::Cpu => 0,
            ComputeService::Cuda { n_gpu_layers } => *n_gpu_layers,
        }
    }

    /// Whether layers are offloaded to a GPU.
    pub fn offloads(&self) -> bool {
        matches!(self, ComputeService::Cuda { n_gpu_layers } if *n_gpu_layers > 0)
    }
}

/// The compute service the profile names, if this build has it (the cpu service instead when
/// the profile allows that fallback), and how extension work reaches it.
pub(super) fn compute_service(
    p: &BoardProfile,
    caps: BuildCaps,
    origin: &str,
    notes: &mut Vec<String>,
) -> Result<(ComputeService, String), BoardError> {
    let compute = match (p.compute.service, caps.gpu) {
        (ServiceName::Cpu, _) => ComputeService::Cpu,
        (ServiceName::Cuda, true) => ComputeService::Cuda { n_gpu_layers: p.compute.n_gpu_layers },
        (ServiceName::Cuda, false) if p.compute.cpu_fallback => {
            notes.push("compute.service = \"cuda\" but this build has no CUDA (or its driver finds no GPU): running on the cpu service (compute.cpu_fallback); a `--features cuda` build on the board runs it on the GPU".into());
            ComputeService::Cpu
        }
        (ServiceName::Cuda, false) => return Err(BoardError::NoCuda { origin: origin.to_string() }),
    };
    let via = match (compute, caps.cuda_ordinal) {
        (ComputeService::Cpu, _) if caps.cpu_parallel => {
            "ggml_ext_cpu_parallel_v1 on the compute cores' thread pool".to_string()
        }
        (ComputeService::Cpu, _) => {
            notes.push("this ggml lacks ggml_ext_cpu_parallel_v1 (vendor patch 0005): no extension kernels".into());
            "the thread pool only (no extension service)".to_string()
        }
        (ComputeService::Cuda { .. }, Some(ordinal)) => {
            format!("CUDA device {ordinal} (ggml_ext_cuda_device_v1), its stream lent by ggml_ext_cuda_context_v1")
        }
        (ComputeService::Cuda { .. }, None) => return Err(BoardError::NoCudaService { origin: origin.to_string() }),
    };
    Ok((compute, via))
}
