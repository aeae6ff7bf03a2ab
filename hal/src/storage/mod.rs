//! Storage: which block device holds a file, how it wants to be read (direct-I/O alignment,
//! block sizes, largest request), what medium it is, and page-cache helpers.

mod throughput;

pub use throughput::{measure_direct_read, ReadThroughput};

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::root::SysRoot;

/// How long a batch of reads (a model's header, a layer's experts, or a compute thread's wait
/// for one expert) may take before it fails naming what it read: a device that stopped
/// answering.
pub const READ_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// The kind of storage a file lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// An SD card (`mmcblk*` whose card type is `SD`).
    Sd,
    /// Soldered eMMC (`mmcblk*` whose card type is `MMC`).
    Emmc,
    /// An NVMe SSD.
    Nvme,
    /// A virtual machine's virtio disk.
    Virtio,
    /// Anything else (USB or SATA disks, loop devices), or no block device at all (tmpfs).
    Other,
}

impl Medium {
    /// The names [`Medium::from_name`] takes.
    pub const NAMES: [&'static str; 5] = ["sd", "emmc", "nvme", "virtio", "other"];

    /// The medium named `name` (one of [`Medium::NAMES`]).
    pub fn from_name(name: &str) -> Option<Medium> {
        Some(match name {
            "sd" => Medium::Sd,
            "emmc" => Medium::Emmc,
            "nvme" => Medium::Nvme,
            "virtio" => Medium::Virtio,
            "other" => Medium::Other,
            _ => return None,
        })
    }

    /// The lowercase name used in profiles and reports.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Sd => "sd",
            Medium::Emmc => "emmc",
            Medium::Nvme => "nvme",
            Medium::Virtio => "virtio",
            Medium::Other => "other",
        }
    }
}

/// Direct-I/O alignment from `statx(STATX_DIOALIGN)` (Linux 6.1+).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// Alignment of the memory buffer, bytes.
    pub memory: u32,
    /// Alignment of the file offset and length, bytes.
    pub offset: u32,
}

/// What the probe found about the storage holding a file or a file system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageProbe {
    /// The whole disk's name (`mmcblk0`, `nvme0n1`, `vda`); `None` when not on a block device.
    pub disk: Option<String>,
    /// The partition's name, when the file system is on one.
    pub partition: Option<String>,
    /// The medium.
    pub medium: Medium,
    /// `queue/logical_block_size`, bytes.
    pub logical_block: Option<u64>,
    /// `queue/physical_block_size`, bytes.
    pub physical_block: Option<u64>,
    /// `queue/optimal_io_size`, bytes (0 or absent: the device states none).
    pub optimal_io: Option<u64>,
    /// `queue/max_sectors_kb` in bytes: the largest single request.
    pub max_request: Option<u64>,
    /// `queue/rotational`.
    pub rotational: Option<bool>,
    /// `STATX_DIOALIGN` of the file, when probing a real file on a kernel that reports it.
    pub dio: Option<DioAlign>,
}

impl StorageProbe {
    /// Probes the device holding `file` (a real path), reading sysfs under `root`.
    pub fn for_file(root: &SysRoot, file: &Path) -> std::io::Result<StorageProbe> {
        let dev = std::fs::metadata(file)?.dev();
        let mut probe = StorageProbe::for_device(root, nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
        probe.dio = dio_align(file);
        Ok(probe)
    }

    /// Probes the device that holds the root file system according to `root`'s
    /// `/proc/self/mountinfo`.
    pub fn for_root_fs(root: &SysRoot) -> Option<StorageProbe> {
        let mountinfo = root.read("/proc/self/mountinfo")?;
        let line = mountinfo.lines().find(|l| l.split_whitespace().nth(4) == Some("/"))?;
        let (major, minor) = line.split_whitespace().nth(2)?.split_once(':')?;
        Some(StorageProbe::for_device(root, major.parse().ok()?, minor.parse().ok()?))
    }

    /// The whole disk holding `file` (a real path), as `major:minor`: the device a read-rate
    /// limit applies to. `None` for a file system without a block device (tmpfs, overlay).
    pub fn disk_of_file(root: &SysRoot, file: &Path) -> Option<(u64, u64)> {
        let dev = std::fs::metadata(file).ok()?.dev();
        let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
        let dev_dir = std::fs::canonicalize(root.path(format!("/sys/dev/block/{major}:{minor}"))).ok()?;
        let disk_dir = if dev_dir.join("partition").exists() { dev_dir.parent()?.to_path_buf() } else { dev_dir };
        let text = std::fs::read_to_string(disk_dir.join("dev")).ok()?;
        let (ma, mi) = text.trim().split_once(':')?;
        Some((ma.parse().ok()?, mi.parse().ok()?))
    }

    /// Probes block device `major:minor` under `root`.
    pub fn for_device(root: &SysRoot, major: u64, minor: u64) -> StorageProbe {
        let Some(dev_dir) = std::fs::canonicalize(root.path(format!("/sys/dev/block/{major}:{minor}"))).ok() else {
            return StorageProbe::none();
        };
        let is_partition = dev_dir.join("partition").exists();
        let disk_dir = if is_partition { dev_dir.parent().map(Path::to_path_buf) } else { Some(dev_dir.clone()) };
        let Some(disk_dir) = disk_dir else { return StorageProbe::none() };
        let name = |d: &Path| d.file_name().map(|n| n.to_string_lossy().into_owned());
        let disk = name(&disk_dir);
        let read = |f: &str| -> Option<u64> { std::fs::read_to_string(disk_dir.join(f)).ok()?.trim().parse().ok() };
        StorageProbe {
            medium: medium_of(disk.as_deref().unwrap_or(""), &disk_dir),
            partition: if is_partition { name(&dev_dir) } else { None },
            disk,
            logical_block: read("queue/logical_block_size"),
            physical_block: read("queue/physical_block_size"),
            optimal_io: read("queue/optimal_io_size"),
            max_request: read("queue/max_sectors_kb").filter(|&k| k > 0).map(|k| k * 1024),
            rotational: read("queue/rotational").map(|r| r != 0),
            dio: None,
        }
    }

    fn none() -> StorageProbe {
        StorageProbe {
            disk: None,
            partition: None,
            medium: Medium::Other,
            logical_block: None,
            physical_block: None,
            optimal_io: None,
            max_request: None,
            rotational: None,
            dio: None,
        }
    }

    /// The alignment direct reads must keep (offset and length): `STATX_DIOALIGN` where known,
    /// else the logical block size, else 4096.
    pub fn direct_alignment(&self) -> u64 {
        match self.dio {
            Some(d) if d.offset > 0 => u64::from(d.offset),
            _ => self.logical_block.filter(|&b| b > 0).unwrap_or(4096),
        }
    }
}

/// `STATX_DIOALIGN` of `file`; `None` where the kernel or file system does not report it (Jetson
/// kernels 5.10/5.15, tmpfs before 6.6).
fn dio_align(file: &Path) -> Option<DioAlign> {
    use rustix::fs::{statx, AtFlags, StatxFlags, CWD};
    let st = statx(CWD, file, AtFlags::empty(), StatxFlags::DIOALIGN).ok()?;
    (st.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && st.stx_dio_offset_align > 0)
        .then_some(DioAlign { memory: st.stx_dio_mem_align, offset: st.stx_dio_offset_align })
}

/// The medium of disk `name` whose sysfs directory is `dir`.
fn medium_of(name: &str, dir: &Path) -> Medium {
    if name.starts_with("mmcblk") {
        return match std::fs::read_to_string(dir.join("device/type")).map(|t| t.trim().to_string()).as_deref() {
            Ok("MMC") => Medium::Emmc,
            _ => Medium::Sd,
        };
    }
    if name.starts_with("nvme") {
        return Medium::Nvme;
    }
    if name.starts_with("vd") || dir.components().any(|c| c.as_os_str().to_string_lossy().starts_with("virtio")) {
        return Medium::Virtio;
    }
    Medium::Other
}

/// Asks the kernel to drop `path`'s clean pages from the page cache
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`), so the next read of it comes from the device.
pub fn drop_cached(path: &Path) -> std::io::Result<()> {
    drop_cached_range(&std::fs::File::open(path)?, 0, 0)
}

/// Asks the kernel to drop `len` bytes of `file`'s clean pages from `offset` (0: to the end)
/// from the page cache, as [`drop_cached`] does for a whole file: a scan or a download larger
/// than the board's memory then does not push out what the board is running.
pub fn drop_cached_range(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    let (offset, len) = (i64::try_from(offset).unwrap_or(i64::MAX), i64::try_from(len).unwrap_or(i64::MAX));
    nix::fcntl::posix_fadvise(file, offset, len, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .map_err(std::io::Error::from)
}

/// Bytes this process's reads have returned so far, from storage or the page cache (`rchar` of
/// `/proc/self/io`; each call adds its own read of that file, about a hundred bytes), if the
/// kernel reports it.
pub fn process_read_chars() -> Option<u64> {
    self_io("rchar")
}

/// Bytes this process has caused to be read from storage so far (`read_bytes` of
/// `/proc/self/io`), if the kernel reports it.
pub fn process_read_bytes() -> Option<u64> {
    self_io("read_bytes")
}

/// The counter `field` of `/proc/self/io`, if the kernel reports it.
fn self_io(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|rest| rest.strip_prefix(':')))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_a_file_from_the_cache_works_and_read_bytes_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![1u8; 1 << 16]).unwrap();
        drop_cached(&p).unwrap();
        assert!(drop_cached(&dir.path().join("missing")).is_err());
        assert!(process_read_bytes().is_some());
    }
}
