//! Everything the hardware probe finds, in one value.

use std::path::Path;

use crate::board::BoardIdentity;
use crate::cpu::CpuTopology;
use crate::memory::MemoryProbe;
use crate::root::SysRoot;
use crate::storage::StorageProbe;
use crate::thermal::ThermalProbe;

/// The probed board.
#[derive(Debug, Clone)]
pub struct HardwareProbe {
    /// The root it was read under.
    pub root: SysRoot,
    /// Identity.
    pub identity: BoardIdentity,
    /// CPUs.
    pub cpu: CpuTopology,
    /// Memory and cgroup.
    pub memory: MemoryProbe,
    /// Storage of the model file (or of the root file system when no file is given).
    pub storage: Option<StorageProbe>,
    /// Thermal state.
    pub thermal: ThermalProbe,
}

impl HardwareProbe {
    /// Probes under `root`; storage is that of `file` when given (a real path), else of the
    /// root file system.
    pub fn run(root: &SysRoot, file: Option<&Path>) -> HardwareProbe {
        let storage = match file {
            Some(f) => StorageProbe::for_file(root, f).ok(),
            None => StorageProbe::for_root_fs(root),
        };
        HardwareProbe {
            root: root.clone(),
            identity: BoardIdentity::probe(root),
            cpu: CpuTopology::probe(root),
            memory: MemoryProbe::probe(root),
            storage,
            thermal: ThermalProbe::probe(root),
        }
    }
}
