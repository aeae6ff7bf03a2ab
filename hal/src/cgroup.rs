//! Memory cgroups of our own: give a child process the RAM of a small board (page cache is
//! charged to it too). Needs root (or a delegated hierarchy); v1 and v2 are both handled.

use std::io;
use std::path::{Path, PathBuf};

use crate::memory::{cgroup_mounts, CgroupVersion};
use crate::root::SysRoot;

/// Why a memory cgroup cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither a v1 memory hierarchy nor a v2 hierarchy is mounted.
    #[error("no memory cgroup hierarchy is mounted (looked for a v1 `memory` or a v2 mount in /proc/self/mountinfo)")]
    NoHierarchy,
    /// The kernel refused to create or configure it.
    #[error("cannot set up memory cgroup {}: {source} (creating cgroups needs root, or a delegated hierarchy)", dir.display())]
    Setup {
        /// The cgroup directory.
        dir: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// A memory cgroup this process created; removed on drop (once empty).
#[derive(Debug)]
pub struct MemoryCgroup {
    dir: PathBuf,
    version: CgroupVersion,
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    std::fs::write(dir.join(file), value)
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl MemoryCgroup {
    /// Creates cgroup `name` at the top of the memory hierarchy with a hard limit of `limit`
    /// bytes, keeping its anonymous memory out of swap.
    pub fn create(name: &str, limit: u64) -> Result<MemoryCgroup, CgroupError> {
        let root = SysRoot::default();
        let (v1, v2) = cgroup_mounts(&root.read("/proc/self/mountinfo").unwrap_or_default());
        let (mount, version) = match (v1, v2) {
            (Some(m), _) => (m, CgroupVersion::V1),
            (None, Some(m)) => (m, CgroupVersion::V2),
            (None, None) => return Err(CgroupError::NoHierarchy),
        };
        let dir = PathBuf::from(&mount.point).join(name);
        let setup = |source| CgroupError::Setup { dir: dir.clone(), source };
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(setup(e)),
        }
        let cg = MemoryCgroup { dir: dir.clone(), version };
        match version {
            CgroupVersion::V1 => {
                write(&dir, "memory.limit_in_bytes", &limit.to_string()).map_err(setup)?;
                // Keep anonymous memory out of swap. (A memory+swap limit would do it too, but
                // then v1 stops counting limit hits in memory.failcnt.)
                let _ = write(&dir, "memory.swappiness", "0");
            }
            CgroupVersion::V2 => {
                if let Some(parent) = dir.parent() {
                    let _ = write(parent, "cgroup.subtree_control", "+memory");
                }
                write(&dir, "memory.max", &limit.to_string()).map_err(setup)?;
                let _ = write(&dir, "memory.swap.max", "0");
            }
        }
        Ok(cg)
    }

    /// The cgroup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The highest usage seen (page cache included), bytes.
    pub fn peak(&self) -> Option<u64> {
        match self.version {
            CgroupVersion::V1 => read_u64(&self.dir.join("memory.max_usage_in_bytes")),
            CgroupVersion::V2 => read_u64(&self.dir.join("memory.peak")),
        }
    }

    /// How many times usage hit the limit (v1 `memory.failcnt`, v2 `max` of `memory.events`).
    pub fn limit_hits(&self) -> Option<u64> {
        match self.version {
            CgroupVersion::V1 => read_u64(&self.dir.join("memory.failcnt")),
            CgroupVersion::V2 => std::fs::read_to_string(self.dir.join("memory.events"))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("max ").and_then(|v| v.trim().parse().ok())),
        }
    }
}

/// Moves the calling process into the cgroup at `dir` (its memory from now on is charged there).
pub fn join(dir: &Path) -> io::Result<()> {
    write(dir, "cgroup.procs", &std::process::id().to_string())
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Its processes have exited by now; the kernel may take a moment to notice.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        log::warn!("could not remove memory cgroup {}", self.dir.display());
    }
}
