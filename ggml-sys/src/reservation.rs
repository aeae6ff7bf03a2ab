//! Anonymous memory that mirrors one tensor's bytes in the model file, for streaming.
//!
//! A [`Reservation`] maps `MAP_NORESERVE` anonymous memory for a tensor whose data sits at
//! `file_offset` in its file, with the tensor's base chosen so that `base ≡ file_offset (mod
//! page)`. A page-aligned window of the file then lands at a page-aligned address, exactly where
//! the tensor's bytes belong: an `O_DIRECT` read goes straight into place with no bounce copy
//! (the window's extra bytes are the neighbouring slices' own file bytes). Pages are committed
//! when written and given back with [`Reservation::release`].

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use std::sync::atomic::Ordering;

use memmap2::{Advice, MmapOptions, MmapRaw, UncheckedAdvice};

/// The system page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Page-congruent anonymous memory for one tensor (a memmap2 anonymous map, unmapped when the
/// last owner drops it: a model keeps the reservations its tensors were rebound to alive until
/// it is freed, see `Model::keep_alive`).
pub struct Reservation {
    map: MmapRaw,
    /// File offset of the first byte of the mapping (page-aligned).
    file_base: u64,
    /// File offset and size of the tensor.
    file_offset: u64,
    size: u64,
}

impl Reservation {
    /// Reserves address space for a tensor of `size` bytes at `file_offset`.
    pub fn new(file_offset: u64, size: u64) -> io::Result<Reservation> {
        let page = page_size();
        let phase = file_offset % page;
        let map_len = (phase + size).div_ceil(page).max(1) * page;
        let map_len = usize::try_from(map_len).map_err(|_| io::Error::other("tensor too large to map"))?;
        // Private anonymous memory without swap reserved for it (MAP_NORESERVE): pages are
        // committed only when a read writes them.
        let map = MmapRaw::from(MmapOptions::new().len(map_len).no_reserve_swap().map_anon()?);
        // Small pages only: a transparent huge page would commit 2 MiB for a 4 KiB expert
        // window and keep it after a release, beyond what the cache accounts. Best effort.
        let _ = map.advise(Advice::NoHugePage);
        Ok(Reservation { map, file_base: file_offset - phase, file_offset, size })
    }

    fn map_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn map_len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn base_ptr(&self) -> *mut u8 {
        // SAFETY: file_offset - file_base < page <= map_len, so the result is inside the mapping.
        unsafe { self.map_ptr().add((self.file_offset - self.file_base) as usize) }
    }

    /// File offset of the tensor.
    pub fn file_offset(&self) -> u64 {
        self.file_offset
    }

    /// Size of the tensor in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The page-aligned file window `[start, end)` that covers the tensor bytes `[from, to)`
    /// (offsets relative to the tensor), clipped to the mapping.
    pub fn window(&self, from: u64, to: u64) -> (u64, u64) {
        let page = page_size();
        let start = (self.file_offset + from) / page * page;
        let end = ((self.file_offset + to).div_ceil(page) * page).min(self.file_base + self.map_len() as u64);
        (start.max(self.file_base), end)
    }

    /// Reads the file window `[file_start, file_start + len)` from `fd` into its place in the
    /// mapping (`pread`, retried on short reads; stops early at end of file). With an `O_DIRECT`
    /// descriptor, `file_start` and `len` must be multiples of the device's block size (page
    /// multiples always are). Returns the bytes read.
    pub fn read_window(&self, fd: BorrowedFd<'_>, file_start: u64, len: usize) -> io::Result<usize> {
        let end = file_start.checked_add(len as u64).ok_or_else(|| io::Error::other("window overflows"))?;
        if file_start < self.file_base || end > self.file_base + self.map_len() as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "window {file_start}..{end} is outside the reservation {}..{}",
                    self.file_base,
                    self.file_base + self.map_len() as u64
                ),
            ));
        }
        let mut done = 0usize;
        while done < len {
            let off = file_start + done as u64;
            // SAFETY: off - file_base + (len - done) <= map_len (checked above), so the
            // destination range lies inside this live mapping; pread writes at most len - done
            // bytes there.
            let n = unsafe {
                libc::pread(
                    fd.as_raw_fd(),
                    self.map_ptr().add((off - self.file_base) as usize).cast(),
                    len - done,
                    off as libc::off_t,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                break;
            }
            done += n as usize;
        }
        Ok(done)
    }

    /// Copies the tensor bytes `[from, from + out.len())` (relative to the tensor) into `out`,
    /// for checking what a read landed; `false` (and nothing copied) when the range runs past
    /// the tensor. Pages never read, or given back, read as zeros.
    ///
    /// The copy uses relaxed atomic loads, never a shared slice: another lane may be reading a
    /// neighbouring slice's window into a page this range shares (the kernel writes the same
    /// file bytes there), and a release may drop pages under it.
    pub fn copy_to(&self, from: u64, out: &mut [u8]) -> bool {
        if from.checked_add(out.len() as u64).is_none_or(|to| to > self.size) {
            return false;
        }
        // SAFETY: from + out.len() <= size (checked above) and the tensor's bytes lie inside the
        // mapping, so the range starts inside this live mapping.
        let src = unsafe { self.base_ptr().add(from as usize) };
        let mut i = 0usize;
        while i < out.len() {
            let p = src.wrapping_add(i);
            if p as usize % 8 == 0 && out.len() - i >= 8 {
                // SAFETY: p is 8-aligned and p..p+8 lies inside the mapping, which outlives this
                // borrow of self; Rust code reads the mapping only through atomics (this
                // function), and writes reach it only from the kernel (pread, madvise), so no
                // non-atomic Rust access races with the load.
                let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(p.cast()) }.load(Ordering::Relaxed);
                out[i..i + 8].copy_from_slice(&word.to_ne_bytes());
                i += 8;
            } else {
                // SAFETY: p lies inside the mapping (i < out.len()); as above for the access.
                out[i] = unsafe { std::sync::atomic::AtomicU8::from_ptr(p) }.load(Ordering::Relaxed);
                i += 1;
            }
        }
        true
    }

    /// Bytes of the mapping in memory now (`mincore`): what the reservation really holds.
    pub fn resident_bytes(&self) -> u64 {
        // SAFETY: map/map_len is this live, page-aligned mapping.
        unsafe { crate::pagecache::resident_bytes(self.map_ptr().cast(), self.map_len()) }.unwrap_or(0)
    }

    /// Gives back the pages wholly inside the tensor bytes `[from, to)` (relative to the
    /// tensor, clamped to it). Boundary pages that a neighbouring slice may share stay; the
    /// mapping's first and last pages, which hold no other slice, go with the tensor's first and
    /// last bytes. Returns the bytes released.
    pub fn release(&self, from: u64, to: u64) -> u64 {
        let to = to.min(self.size);
        let from = from.min(to);
        let page = page_size();
        let map_end = self.file_base + self.map_len() as u64;
        let start = if from == 0 { self.file_base } else { (self.file_offset + from).div_ceil(page) * page };
        let end = if to == self.size { map_end } else { (self.file_offset + to) / page * page };
        if end <= start {
            return 0;
        }
        let len = (end - start) as usize;
        // SAFETY: [start, end) lies inside the mapping [file_base, map_end) (from and to are
        // clamped to the tensor, which the mapping covers). MADV_DONTNEED on private anonymous
        // memory drops the pages' contents (later reads see zeros): no reference into the
        // mapping exists (the type hands none out), and ggml reads only the slices the streamer
        // made resident again before they are used.
        let released = unsafe {
            self.map.unchecked_advise_range(UncheckedAdvice::DontNeed, (start - self.file_base) as usize, len)
        };
        if released.is_ok() {
            len as u64
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn windows_land_in_place_and_release_is_page_exact() {
        let page = page_size();
        let dir = std::env::temp_dir().join(format!("ggml-sys-res-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..4 * page as usize + 1000).map(|i| (i % 251) as u8).collect();
        std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // A tensor at an odd offset, 3000 bytes into the second page.
        let (off, size) = (page + 3000, 2 * page + 500);
        let r = Reservation::new(off, size).unwrap();
        assert_eq!(r.base_ptr() as u64 % page, off % page);
        let (ws, we) = r.window(100, 200);
        assert_eq!((ws, we), (page, 2 * page));
        let n = r.read_window(std::os::fd::AsFd::as_fd(&file), ws, (we - ws) as usize).unwrap();
        assert_eq!(n as u64, we - ws);
        // SAFETY: the window covering tensor bytes 100..200 was just read into the live mapping.
        let got = unsafe { std::slice::from_raw_parts(r.base_ptr().add(100), 100) };
        assert_eq!(got, &data[(off + 100) as usize..(off + 200) as usize]);
        // copy_to sees the same bytes, from any alignment; a range past the tensor is refused.
        for at in [100u64, 101, 107] {
            let mut copy = vec![0u8; 93];
            assert!(r.copy_to(at, &mut copy));
            assert_eq!(copy, &data[(off + at) as usize..(off + at + 93) as usize]);
        }
        assert!(!r.copy_to(size - 10, &mut [0u8; 11]));
        assert!(!r.copy_to(u64::MAX, &mut [0u8; 2]));
        // Releasing a range smaller than a page frees nothing; the whole tensor frees the whole
        // mapping, head and tail pages included.
        assert_eq!(r.release(100, 200), 0);
        assert_eq!(r.release(0, size), 3 * page);
        assert!(r.read_window(std::os::fd::AsFd::as_fd(&file), 0, 10).is_err());
        // A range past the tensor is clamped to it: nothing beyond the mapping is touched.
        let (ws, we) = r.window(0, size);
        r.read_window(std::os::fd::AsFd::as_fd(&file), ws, (we - ws) as usize).unwrap();
        assert!(r.resident_bytes() >= 2 * page);
        assert_eq!(r.release(0, u64::MAX), 3 * page, "clamped to the mapping");
        if !emulated() {
            assert_eq!(r.resident_bytes(), 0);
        }
        assert_eq!(r.release(u64::MAX - 1, u64::MAX), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Whether the tests run under qemu-user (`make aarch64`), whose madvise is a hint it may
    /// ignore and whose /proc describes the emulator.
    fn emulated() -> bool {
        std::env::var_os("SLUICE_TEST_RUNNER").is_some_and(|r| !r.is_empty())
    }

    #[test]
    fn reservations_never_use_transparent_huge_pages() {
        if emulated() {
            eprintln!("skipped: under qemu-user madvise is a hint and /proc/self/smaps the emulator's");
            return;
        }
        let r = Reservation::new(0, 8 << 20).unwrap();
        let start = format!("{:x}-", r.map_ptr() as usize);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let flags = smaps.lines().skip_while(|l| !l.starts_with(&start)).find(|l| l.starts_with("VmFlags:"));
        let flags = flags.unwrap_or_else(|| panic!("mapping {start} not in /proc/self/smaps"));
        assert!(flags.split_whitespace().any(|f| f == "nh"), "{flags}");
    }
}
