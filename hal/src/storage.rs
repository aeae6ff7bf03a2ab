//! Storage helpers.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The sysfs directory (`/sys/dev/block/MAJ:MIN`, resolved) of the block device holding `path`,
/// under the root `sys` (normally `/sys`). For a partition, the parent disk's directory, which
/// holds the `queue/` settings. `None` for files not on a block device (tmpfs, overlay, NFS).
pub fn block_device_dir(sys: &Path, path: &Path) -> Option<PathBuf> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let dir = std::fs::canonicalize(sys.join(format!("dev/block/{major}:{minor}"))).ok()?;
    if dir.join("partition").exists() {
        dir.parent().map(Path::to_path_buf)
    } else {
        Some(dir)
    }
}

/// The largest single request the device holding `path` accepts (`queue/max_sectors_kb`), in
/// bytes, read under the sysfs root `sys`.
pub fn max_request_bytes(sys: &Path, path: &Path) -> Option<u64> {
    let dir = block_device_dir(sys, path)?;
    let kb: u64 = std::fs::read_to_string(dir.join("queue/max_sectors_kb")).ok()?.trim().parse().ok()?;
    (kb > 0).then_some(kb * 1024)
}

/// Asks the kernel to drop `path`'s clean pages from the page cache
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`), so the next read of it comes from the device.
pub fn drop_cached(path: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(path)?;
    nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .map_err(std::io::Error::from)
}

/// Bytes this process has caused to be read from storage so far (`read_bytes` of
/// `/proc/self/io`), if the kernel reports it.
pub fn process_read_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines().find_map(|l| l.strip_prefix("read_bytes:")).and_then(|v| v.trim().parse().ok())
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

    #[test]
    fn the_device_of_a_real_file_has_a_request_limit() {
        // The test binary itself sits on a real disk here; tmpfs files have no block device.
        let exe = std::env::current_exe().unwrap();
        if let Some(bytes) = max_request_bytes(Path::new("/sys"), &exe) {
            assert!(bytes >= 4096 && bytes % 512 == 0, "{bytes}");
        }
        if Path::new("/dev/shm").is_dir() {
            let f = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
            assert_eq!(max_request_bytes(Path::new("/sys"), f.path()), None);
        }
    }
}
