//! CPU sets: which CPUs this process may run on, and pinning the calling thread.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Errors of CPU affinity calls.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// The kernel refused the affinity call.
    #[error("sched_{call}affinity failed: {source}")]
    Affinity {
        /// `get` or `set`.
        call: &'static str,
        /// The errno.
        source: nix::Error,
    },
    /// A CPU number is beyond what an affinity mask can hold.
    #[error("CPU {cpu} is out of range (the affinity mask holds CPUs 0..{max})")]
    OutOfRange {
        /// The CPU asked for.
        cpu: usize,
        /// The mask's capacity.
        max: usize,
    },
    /// An empty CPU list was given.
    #[error("an empty CPU list cannot be pinned to")]
    Empty,
}

/// The CPUs the calling thread may run on (its affinity mask, which honours taskset, cgroup
/// cpusets and systemd's CPUAffinity), in ascending order.
pub fn allowed_cpus() -> Result<Vec<usize>, CpuError> {
    let set = sched_getaffinity(Pid::from_raw(0)).map_err(|source| CpuError::Affinity { call: "get", source })?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
}

/// Pins the calling thread to `cpus`.
pub fn pin_current_thread(cpus: &[usize]) -> Result<(), CpuError> {
    if cpus.is_empty() {
        return Err(CpuError::Empty);
    }
    let mut set = CpuSet::new();
    for &cpu in cpus {
        set.set(cpu).map_err(|_| CpuError::OutOfRange { cpu, max: CpuSet::count() })?;
    }
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|source| CpuError::Affinity { call: "set", source })
}

/// A default compute thread count: one per allowed CPU (1 if the mask cannot be read).
pub fn default_threads() -> u32 {
    allowed_cpus().map(|c| c.len().max(1) as u32).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_is_visible_through_getaffinity() {
        let all = allowed_cpus().unwrap();
        assert!(!all.is_empty());
        let last = *all.last().unwrap();
        std::thread::spawn(move || {
            pin_current_thread(&[last]).unwrap();
            assert_eq!(allowed_cpus().unwrap(), vec![last]);
        })
        .join()
        .unwrap();
        // The pin applied to the spawned thread only.
        assert_eq!(allowed_cpus().unwrap(), all);
    }

    #[test]
    fn bad_cpu_lists_are_errors() {
        assert!(matches!(pin_current_thread(&[]), Err(CpuError::Empty)));
        assert!(matches!(pin_current_thread(&[1 << 20]), Err(CpuError::OutOfRange { .. })));
    }
}
