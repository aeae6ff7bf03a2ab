//! Memory facts: `/proc/meminfo`, and the memory limit of this process's cgroup (v1 or v2).

use std::path::PathBuf;

use crate::root::SysRoot;

/// One `Key:   N kB` field of `/proc/meminfo` under `root`, in bytes.
pub fn meminfo(root: &SysRoot, key: &str) -> Option<u64> {
    meminfo_field(&root.read("/proc/meminfo")?, key)
}

/// Parses one `Key:   N kB` line of a meminfo text into bytes.
pub fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Which cgroup hierarchy holds the memory controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The legacy per-controller hierarchy (`memory.limit_in_bytes`).
    V1,
    /// The unified hierarchy (`memory.max`).
    V2,
}

/// This process's memory cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMemory {
    /// The hierarchy.
    pub version: CgroupVersion,
    /// The cgroup's directory (under the root).
    pub dir: PathBuf,
    /// The tightest limit of the cgroup and its ancestors, bytes; `None` when unlimited.
    pub limit: Option<u64>,
    /// Current usage (page cache included), bytes.
    pub usage: Option<u64>,
}

/// Memory as the machine and the cgroup see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryProbe {
    /// `MemTotal`, bytes.
    pub total: Option<u64>,
    /// `MemAvailable`, bytes.
    pub available: Option<u64>,
    /// The memory cgroup, when one can be found.
    pub cgroup: Option<CgroupMemory>,
}

impl MemoryProbe {
    /// Reads memory facts under `root`.
    pub fn probe(root: &SysRoot) -> MemoryProbe {
        MemoryProbe {
            total: meminfo(root, "MemTotal:"),
            available: meminfo(root, "MemAvailable:"),
            cgroup: cgroup_memory(root),
        }
    }
}

/// A mount of a cgroup hierarchy: where it is, and which cgroup path it shows as its root.
pub(crate) struct CgroupMount {
    /// The mount point.
    pub(crate) point: String,
    /// The cgroup path shown at the mount point.
    pub(crate) root: String,
}

/// The cgroup mounts of `/proc/self/mountinfo`: (v1 memory, v2).
pub(crate) fn cgroup_mounts(mountinfo: &str) -> (Option<CgroupMount>, Option<CgroupMount>) {
    controller_mounts(mountinfo, "memory")
}

/// The v1 hierarchy of `controller` and the v2 hierarchy, as `/proc/self/mountinfo` lists them.
pub(crate) fn controller_mounts(mountinfo: &str, controller: &str) -> (Option<CgroupMount>, Option<CgroupMount>) {
    let (mut v1, mut v2) = (None, None);
    for line in mountinfo.lines() {
        let Some((pre, post)) = line.split_once(" - ") else { continue };
        let pre: Vec<&str> = pre.split_whitespace().collect();
        let post: Vec<&str> = post.split_whitespace().collect();
        if pre.len() < 5 || post.is_empty() {
            continue;
        }
        let mount = CgroupMount { point: pre[4].to_string(), root: pre[3].to_string() };
        match post[0] {
            "cgroup2" => v2 = v2.or(Some(mount)),
            "cgroup" if post.get(2).is_some_and(|o| o.split(',').any(|o| o == controller)) => v1 = v1.or(Some(mount)),
            _ => {}
        }
    }
    (v1, v2)
}

fn cgroup_memory(root: &SysRoot) -> Option<CgroupMemory> {
    let membership = root.read("/proc/self/cgroup")?;
    let (v1_mount, v2_mount) = cgroup_mounts(&root.read("/proc/self/mountinfo")?);
    let v1_path = membership.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers.split(',').any(|c| c == "memory").then(|| path.to_string())
    });
    let v2_path = membership.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string));
    let (version, mount, path, limit_file, usage_file) = match (v1_mount, v1_path, v2_mount, v2_path) {
        (Some(m), Some(p), _, _) => (CgroupVersion::V1, m, p, "memory.limit_in_bytes", "memory.usage_in_bytes"),
        (_, _, Some(m), Some(p)) => (CgroupVersion::V2, m, p, "memory.max", "memory.current"),
        _ => return None,
    };
    let relative = path.strip_prefix(mount.root.as_str()).unwrap_or(&path).trim_start_matches('/');
    let base = root.path(&mount.point);
    let dir = if relative.is_empty() { base.clone() } else { base.join(relative) };
    let mut limit = None::<u64>;
    let mut at = dir.clone();
    loop {
        let value = std::fs::read_to_string(at.join(limit_file)).ok().and_then(|t| parse_limit(&t));
        if let Some(v) = value {
            limit = Some(limit.map_or(v, |l| l.min(v)));
        }
        if at == base || !at.pop() {
            break;
        }
    }
    let usage = std::fs::read_to_string(dir.join(usage_file)).ok().and_then(|t| t.trim().parse().ok());
    Some(CgroupMemory { version, dir, limit, usage })
}

/// A cgroup limit file's value: `max` (v2) or a huge number (v1's "unlimited") is no limit.
fn parse_limit(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    (v < 1 << 60).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo_lines() {
        let text = "MemTotal:        8000000 kB\nMemAvailable:    6000000 kB\n";
        assert_eq!(meminfo_field(text, "MemAvailable:"), Some(6_000_000 * 1024));
        assert_eq!(meminfo_field(text, "SwapTotal:"), None);
    }

    fn tree(files: &[(&str, &str)]) -> (tempfile::TempDir, SysRoot) {
        let dir = tempfile::tempdir().unwrap();
        let root = SysRoot::new(dir.path());
        for (path, text) in files {
            let p = root.path(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        (dir, root)
    }

    #[test]
    fn finds_a_v2_limit_through_the_tightest_ancestor() {
        let (_d, root) = tree(&[
            ("/proc/self/cgroup", "0::/system.slice/sluice.service\n"),
            ("/proc/self/mountinfo", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"),
            ("/sys/fs/cgroup/system.slice/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/system.slice/sluice.service/memory.max", "max\n"),
            ("/sys/fs/cgroup/system.slice/sluice.service/memory.current", "5000\n"),
        ]);
        let cg = MemoryProbe::probe(&root).cgroup.unwrap();
        assert_eq!((cg.version, cg.limit, cg.usage), (CgroupVersion::V2, Some(1 << 30), Some(5000)));
    }

    #[test]
    fn prefers_the_v1_memory_controller_on_hybrid_machines() {
        let (_d, root) = tree(&[
            ("/proc/self/cgroup", "4:memory:/bench\n0::/\n"),
            (
                "/proc/self/mountinfo",
                "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
            ),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("/sys/fs/cgroup/memory/bench/memory.limit_in_bytes", "536870912\n"),
        ]);
        let cg = MemoryProbe::probe(&root).cgroup.unwrap();
        assert_eq!((cg.version, cg.limit), (CgroupVersion::V1, Some(512 << 20)));
        assert!(cg.dir.ends_with("sys/fs/cgroup/memory/bench"));
    }

    #[test]
    fn this_machine_reports_its_memory() {
        let m = MemoryProbe::probe(&SysRoot::default());
        assert!(m.total.unwrap() >= m.available.unwrap());
    }
}
