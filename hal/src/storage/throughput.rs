//! The storage ceiling: how fast a file can be read with `O_DIRECT` at a given request size and
//! number of parallel readers, measured on the file itself.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

/// The result of [`measure_direct_read`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadThroughput {
    /// Bytes read.
    pub bytes: u64,
    /// Wall time of the reads.
    pub elapsed: Duration,
    /// Whether the reads bypassed the page cache (`false`: the file system refused `O_DIRECT`
    /// and the file was read buffered after dropping it from the page cache).
    pub direct: bool,
}

impl ReadThroughput {
    /// MiB per second.
    pub fn mib_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s == 0.0 {
            0.0
        } else {
            self.bytes as f64 / (1u64 << 20) as f64 / s
        }
    }
}

/// Reads up to `limit` bytes of `path` from its start in requests of `request` bytes (rounded
/// down to `align`), with `lanes` threads taking requests round-robin, each into its own
/// `align`-aligned buffer. Uses `O_DIRECT`; where the file system refuses it (`EINVAL`), drops
/// the file from the page cache and reads buffered, reporting `direct: false`.
pub fn measure_direct_read(
    path: &Path,
    request: usize,
    lanes: usize,
    align: usize,
    limit: u64,
) -> io::Result<ReadThroughput> {
    let align = align.max(512).next_power_of_two();
    let request = (request / align).max(1) * align;
    let len = std::fs::metadata(path)?.len().min(limit) / align as u64 * align as u64;
    let direct = match std::fs::OpenOptions::new().read(true).custom_flags(o_direct()).open(path) {
        Ok(f) => probe_read(&f, align).map(|()| true).or_else(|e| fallback(e, path))?,
        Err(e) => fallback(e, path)?,
    };
    let lanes = lanes.max(1);
    let start = Instant::now();
    let bytes = std::thread::scope(|s| -> io::Result<u64> {
        let handles: Vec<_> = (0..lanes)
            .map(|lane| {
                s.spawn(move || -> io::Result<u64> {
                    let f = open(path, direct)?;
                    let mut raw = vec![0u8; request + align];
                    let at = raw.as_ptr().align_offset(align);
                    let buf = &mut raw[at..at + request];
                    let mut total = 0u64;
                    let mut off = lane as u64 * request as u64;
                    while off < len {
                        let want = (len - off).min(request as u64) as usize;
                        f.read_exact_at(&mut buf[..want], off)?;
                        total += want as u64;
                        off += (lanes * request) as u64;
                    }
                    Ok(total)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("reader panicked")))).sum()
    })?;
    Ok(ReadThroughput { bytes, elapsed: start.elapsed(), direct })
}

fn o_direct() -> i32 {
    nix::fcntl::OFlag::O_DIRECT.bits()
}

fn open(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(o_direct());
    }
    o.open(path)
}

/// One aligned direct read, to find out whether the file system takes `O_DIRECT`.
fn probe_read(f: &File, align: usize) -> io::Result<()> {
    let mut raw = vec![0u8; 2 * align];
    let at = raw.as_ptr().align_offset(align);
    f.read_at(&mut raw[at..at + align], 0).map(|_| ())
}

/// `EINVAL` means no direct I/O here: read buffered from a dropped page cache instead.
fn fallback(e: io::Error, path: &Path) -> io::Result<bool> {
    if e.raw_os_error() != Some(nix::libc::EINVAL) {
        return Err(e);
    }
    log::warn!("{}: O_DIRECT refused ({e}); measuring buffered reads", path.display());
    super::drop_cached(path)?;
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_byte_once_across_lanes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; (1 << 20) + 4096 + 100]).unwrap();
        for lanes in [1, 3] {
            let t = measure_direct_read(&p, 64 << 10, lanes, 4096, u64::MAX).unwrap();
            assert_eq!(t.bytes, (1 << 20) + 4096, "{lanes} lanes");
        }
        let t = measure_direct_read(&p, 64 << 10, 2, 4096, 100_000).unwrap();
        assert_eq!(t.bytes, 98_304);
    }
}
