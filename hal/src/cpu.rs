//! CPUs: the topology under a root (online CPUs, clusters, capacity, frequency), which CPUs
//! this process may run on, and pinning the calling thread.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use crate::cpulist;
use crate::root::SysRoot;

/// One online CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuInfo {
    /// CPU number.
    pub id: usize,
    /// `topology/cluster_id` (CPUs sharing a cluster share an L2/L3 and a frequency domain).
    pub cluster_id: Option<i64>,
    /// `cpu_capacity` (arm64: relative performance, 1024 = the fastest core).
    pub capacity: Option<u64>,
    /// `cpufreq/cpuinfo_max_freq` in kHz.
    pub max_freq_khz: Option<u64>,
}

/// A group of CPUs with the same cluster id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    /// The cluster id (`-1` where the kernel reports none).
    pub id: i64,
    /// Its online CPUs, ascending.
    pub cpus: Vec<usize>,
    /// The largest `cpu_capacity` among them.
    pub capacity: Option<u64>,
    /// The largest maximum frequency among them, kHz.
    pub max_freq_khz: Option<u64>,
}

/// The CPUs of a machine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuTopology {
    /// CPUs that can ever be brought online (`/sys/devices/system/cpu/possible`).
    pub possible: Vec<usize>,
    /// CPUs online now (a Jetson power mode takes some offline).
    pub online: Vec<usize>,
    /// Facts about each online CPU.
    pub cpus: Vec<CpuInfo>,
}

impl CpuTopology {
    /// Reads the topology under `root`. Missing files leave fields empty: the caller decides
    /// what an unknown topology means.
    pub fn probe(root: &SysRoot) -> CpuTopology {
        let list = |f: &str| root.read(format!("/sys/devices/system/cpu/{f}")).and_then(|t| cpulist::parse(&t).ok());
        let online = list("online").unwrap_or_default();
        let possible = list("possible").unwrap_or_else(|| online.clone());
        let cpus = online
            .iter()
            .map(|&id| {
                let dir = format!("/sys/devices/system/cpu/cpu{id}");
                CpuInfo {
                    id,
                    // x86 and some VMs report 65535 or -1: no cluster.
                    cluster_id: root
                        .read(format!("{dir}/topology/cluster_id"))
                        .and_then(|t| t.parse().ok())
                        .filter(|&id: &i64| (0..65535).contains(&id)),
                    capacity: root.read_u64(format!("{dir}/cpu_capacity")),
                    max_freq_khz: root.read_u64(format!("{dir}/cpufreq/cpuinfo_max_freq")),
                }
            })
            .collect();
        CpuTopology { possible, online, cpus }
    }

    /// The online CPUs grouped by cluster id, in ascending id order.
    pub fn clusters(&self) -> Vec<Cluster> {
        let mut clusters: Vec<Cluster> = Vec::new();
        for c in &self.cpus {
            let id = c.cluster_id.unwrap_or(-1);
            let cluster = match clusters.iter_mut().position(|k| k.id == id) {
                Some(i) => &mut clusters[i],
                None => {
                    clusters.push(Cluster { id, cpus: Vec::new(), capacity: None, max_freq_khz: None });
                    clusters.last_mut().expect("just pushed")
                }
            };
            cluster.cpus.push(c.id);
            cluster.capacity = cluster.capacity.max(c.capacity);
            cluster.max_freq_khz = cluster.max_freq_khz.max(c.max_freq_khz);
        }
        clusters.sort_by_key(|k| k.id);
        clusters
    }
}

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
    fn this_machine_has_a_topology() {
        let t = CpuTopology::probe(&SysRoot::default());
        assert!(!t.online.is_empty() && t.online.iter().all(|c| t.possible.contains(c)));
        assert_eq!(t.clusters().iter().map(|k| k.cpus.len()).sum::<usize>(), t.online.len());
    }

    #[test]
    fn bad_cpu_lists_are_errors() {
        assert!(matches!(pin_current_thread(&[]), Err(CpuError::Empty)));
        assert!(matches!(pin_current_thread(&[1 << 20]), Err(CpuError::OutOfRange { .. })));
    }
}
