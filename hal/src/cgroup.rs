//! Memory cgroups of our own: give a child process the RAM of a small board (page cache is
//! charged to it too). Needs root (or a delegated hierarchy); v1 and v2 are both handled.

use std::io;
use std::path::{Path, PathBuf};

use crate::memory::{cgroup_mounts, controller_mounts, CgroupVersion};
use crate::root::SysRoot;

/// Why a memory cgroup cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither a v1 memory hierarchy nor a v2 hierarchy is mounted.
    #[error("no memory cgroup hierarchy is mounted (looked for a v1 `memory` or a v2 mount in /proc/self/mountinfo)")]
    NoHierarchy,
    /// No I/O controller to limit read rates with (v1 `blkio` is not mounted).
    #[error("no blkio cgroup hierarchy is mounted beside the v1 memory hierarchy, so reads cannot be throttled")]
    NoIoController,
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

/// Creates the cgroup directory `dir` (one that exists already is taken as it is).
fn make_dir(dir: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            Err(CgroupError::Setup { dir: dir.to_path_buf(), source: e })
        }
        _ => Ok(()),
    }
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
        make_dir(&dir)?;
        let setup = |source| CgroupError::Setup { dir: dir.clone(), source };
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

/// A read-rate limit on one block device for the processes of a memory cgroup: a board's
/// storage speed on a faster machine. v1: a `blkio` cgroup of the same name
/// (`blkio.throttle.read_bps_device`), which the processes join as well; v2: `io.max` in the
/// memory cgroup's own directory. Lifted on drop (the v1 cgroup is removed once empty).
#[derive(Debug)]
pub struct ReadThrottle {
    dir: PathBuf,
    /// The v1 `blkio` cgroup this created (removed on drop); `None` on v2.
    owned: Option<PathBuf>,
    /// The file and the line that lift the limit (reads it holds back then go at once).
    lift: (&'static str, String),
}

impl ReadThrottle {
    /// Limits reads from the whole disk `device` (`major:minor`) to `bytes_per_s` for the
    /// processes of `memory`.
    pub fn create(memory: &MemoryCgroup, device: (u64, u64), bytes_per_s: u64) -> Result<ReadThrottle, CgroupError> {
        let (major, minor) = device;
        let name = memory.dir.file_name().map(PathBuf::from).unwrap_or_default();
        match memory.version {
            CgroupVersion::V1 => {
                let root = SysRoot::default();
                let (blkio, _) = controller_mounts(&root.read("/proc/self/mountinfo").unwrap_or_default(), "blkio");
                let blkio = blkio.ok_or(CgroupError::NoIoController)?;
                let dir = PathBuf::from(&blkio.point).join(name);
                make_dir(&dir)?;
                let setup = |source| CgroupError::Setup { dir: dir.clone(), source };
                let lift = ("blkio.throttle.read_bps_device", format!("{major}:{minor} 0"));
                let throttle = ReadThrottle { dir: dir.clone(), owned: Some(dir.clone()), lift };
                write(&dir, "blkio.throttle.read_bps_device", &format!("{major}:{minor} {bytes_per_s}"))
                    .map_err(setup)?;
                Ok(throttle)
            }
            CgroupVersion::V2 => {
                let dir = memory.dir.clone();
                if let Some(parent) = dir.parent() {
                    let _ = write(parent, "cgroup.subtree_control", "+io");
                }
                write(&dir, "io.max", &format!("{major}:{minor} rbps={bytes_per_s}"))
                    .map_err(|source| CgroupError::Setup { dir: dir.clone(), source })?;
                Ok(ReadThrottle { dir, owned: None, lift: ("io.max", format!("{major}:{minor} rbps=max")) })
            }
        }
    }

    /// The cgroup directory a process joins to be throttled (on v2, the memory cgroup's).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ReadThrottle {
    fn drop(&mut self) {
        let _ = write(&self.dir, self.lift.0, &self.lift.1);
        if let Some(dir) = &self.owned {
            remove_when_empty(dir);
        }
    }
}

/// Removes the cgroup at `dir` once its processes have gone (the kernel may take a moment).
fn remove_when_empty(dir: &Path) {
    for _ in 0..50 {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    log::warn!("could not remove cgroup {}", dir.display());
}

/// Moves the calling process into the cgroup at `dir` (its memory from now on is charged there).
pub fn join(dir: &Path) -> io::Result<()> {
    write(dir, "cgroup.procs", &std::process::id().to_string())
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Its processes have exited by now.
        remove_when_empty(&self.dir);
    }
}
