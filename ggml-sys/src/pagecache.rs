//! Page-cache residency of file ranges (`mincore` over a fresh read-only mapping), to measure
//! what opening a model actually read.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::page_size;

/// Bytes of `[start, start + len)` of `file` that are in the page cache now, counted in whole
/// pages (the range is widened to page boundaries). Mapping and checking read nothing.
pub fn cached_bytes(file: &File, start: u64, len: u64) -> io::Result<u64> {
    if len == 0 {
        return Ok(0);
    }
    let page = page_size();
    let first = start / page * page;
    let end = (start + len).div_ceil(page) * page;
    let map_len = usize::try_from(end - first).map_err(|_| io::Error::other("range too large"))?;
    // SAFETY: a fresh shared read-only mapping of the file; nothing in this process reads or
    // writes through it, and it is unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            first as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: addr/map_len is the live mapping made above.
    let resident = unsafe { resident_bytes(addr, map_len) };
    // SAFETY: unmapping the mapping made above, exactly once.
    unsafe { libc::munmap(addr, map_len) };
    resident
}

/// Bytes of the pages of `[addr, addr + len)` that are in memory (`mincore`).
///
/// # Safety
/// `addr` must be page-aligned and `[addr, addr + len)` a live mapping of this process.
pub(crate) unsafe fn resident_bytes(addr: *mut libc::c_void, len: usize) -> io::Result<u64> {
    let page = page_size() as usize;
    let mut present = vec![0u8; len.div_ceil(page)];
    // SAFETY: the caller's mapping; present has one byte per page of it.
    if unsafe { libc::mincore(addr, len, present.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(present.iter().filter(|&&b| b & 1 == 1).count() as u64 * page as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_just_written_is_cached() {
        let path = std::env::temp_dir().join(format!("ggml-sys-pc-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 3 * page_size() as usize]).unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(cached_bytes(&f, 0, 3 * page_size()).unwrap(), 3 * page_size());
        assert_eq!(cached_bytes(&f, 10, 0).unwrap(), 0);
        std::fs::remove_file(&path).unwrap();
    }
}
