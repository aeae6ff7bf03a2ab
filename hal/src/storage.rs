//! Storage helpers.

use std::path::Path;

/// Asks the kernel to drop `path`'s clean pages from the page cache
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`), so the next read of it comes from the device.
pub fn drop_cached(path: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(path)?;
    nix::fcntl::posix_fadvise(&f, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED).map_err(std::io::Error::from)
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
}
