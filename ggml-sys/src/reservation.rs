//! Anonymous memory that mirrors one tensor's bytes in the model file, for streaming.
//!
//! A [`Reservation`] maps `MAP_NORESERVE` anonymous memory for a tensor whose data sits at
//! `file_offset` in its file, with the tensor's base chosen so that `base ≡ file_offset (mod
//! page)`. A page-aligned window of the file then lands at a page-aligned address, exactly where
//! the tensor's bytes belong: an `O_DIRECT` read goes straight into place with no bounce copy
//! (the window's extra bytes are the neighbouring slices' own file bytes). Pages are committed
//! when written and given back with [`Reservation::release`]. A reservation may use an
//! [`ExpertPool`]: then [`Reservation::place`] maps some of its committed pages under a slice's
//! own pages before a read writes them, and the release maps fresh anonymous memory back and
//! returns them to the pool.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::{Advice, MmapOptions, MmapRaw, UncheckedAdvice};

use crate::pool::{ExpertPool, SlotWrite};

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
    /// The pool reads land in (when the streamer gave it one) and its placements here.
    placed: Mutex<Placements>,
}

/// A reservation's pool and the placements mapped now.
#[derive(Default)]
struct Placements {
    pool: Option<Arc<ExpertPool>>,
    /// Offset in the mapping -> (bytes, placement id).
    at: BTreeMap<usize, (usize, u64)>,
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
        Ok(Reservation {
            map,
            file_base: file_offset - phase,
            file_offset,
            size,
            placed: Mutex::new(Placements::default()),
        })
    }

    /// Lands this tensor's slices in `pool`'s pages from now on ([`Reservation::place`]);
    /// `false` if it already uses a pool.
    pub fn use_pool(&self, pool: Arc<ExpertPool>) -> bool {
        let mut placed = self.placements();
        if placed.pool.is_some() {
            return false;
        }
        placed.pool = Some(pool);
        true
    }

    /// Releases the whole tensor ([`Reservation::release`]) and stops using its pool, so that
    /// the pool's memory goes once its owner lets go of it (a model keeps its reservations
    /// until it is freed, longer than the session that streamed into them).
    pub fn leave_pool(&self) {
        let mut placed = self.placements();
        // Taken first, under the lock: a read placed after this finds no pool.
        if let Some(pool) = placed.pool.take() {
            self.unplace_within(&mut placed.at, &pool, 0, self.map_len());
        }
        drop(placed);
        self.release(0, self.size);
    }

    fn placements(&self) -> MutexGuard<'_, Placements> {
        self.placed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pages a slice `[from, to)` (tensor bytes) owns, as file offsets: those wholly inside
    /// it, and the mapping's first and last pages with the tensor's first and last bytes (no
    /// other slice shares them). What [`Reservation::release`] gives back and
    /// [`Reservation::place`] maps pool pages under.
    fn own_pages(&self, from: u64, to: u64) -> Option<(u64, u64)> {
        let to = to.min(self.size);
        let from = from.min(to);
        let page = page_size();
        let map_end = self.file_base + self.map_len() as u64;
        let start = if from == 0 { self.file_base } else { (self.file_offset + from).div_ceil(page) * page };
        let end = if to == self.size { map_end } else { (self.file_offset + to) / page * page };
        (end > start).then_some((start, end))
    }

    /// Maps free pages of the pool under the pages the slice `[from, to)` owns (or finds those
    /// mapped there), so that a read into it lands in committed memory; returns the read's hold
    /// on them. `None`, and the slice's pages stay anonymous (faulted in when written), when the
    /// reservation uses no pool, the slice owns no page, the pool has too few pages free, or
    /// another placement overlaps it.
    pub fn place(&self, from: u64, to: u64) -> Option<SlotWrite> {
        let (start, end) = self.own_pages(from, to)?;
        let (at, len) = ((start - self.file_base) as usize, (end - start) as usize);
        let mut placed = self.placements();
        let pool = Arc::clone(placed.pool.as_ref()?);
        if let Some(&(l, id)) = placed.at.get(&at) {
            if l != len {
                return None;
            }
            pool.begin_write(id);
            return Some(SlotWrite { pool, id });
        }
        if placed.at.range(..at + len).next_back().is_some_and(|(&s, &(l, _))| s + l > at) {
            return None;
        }
        let taken = pool.take(len as u64)?;
        let mut dst = at;
        for &(offset, bytes) in &taken.runs {
            // SAFETY: [dst, dst + bytes) lies inside [at, at + len), a page-aligned range inside
            // this live mapping (own_pages clamps to it) that no placement overlaps (checked
            // under the lock that every mapping change here holds). MAP_FIXED replaces the
            // anonymous pages there with the pool's; the type hands out no reference into the
            // mapping, and the pool hands these pages to no other placement until they are
            // given back.
            let mapped = unsafe {
                libc::mmap(
                    self.map_ptr().add(dst).cast(),
                    bytes as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_SHARED | libc::MAP_POPULATE,
                    pool.raw_fd(),
                    offset as libc::off_t,
                )
            };
            if mapped == libc::MAP_FAILED {
                log::warn!(
                    "mapping expert pool pages failed ({}); reading into fresh pages",
                    io::Error::last_os_error()
                );
                self.unmap_pool_pages(at, len);
                pool.end_write(taken.id);
                pool.give_back(taken.id);
                return None;
            }
            dst += bytes as usize;
        }
        placed.at.insert(at, (len, taken.id));
        Some(SlotWrite { pool, id: taken.id })
    }

    /// Unmaps the placements of `at` (this reservation's, under its lock) that lie wholly inside
    /// `[from, from + len)` of the mapping and gives their pages back to `pool`.
    fn unplace_within(&self, at: &mut BTreeMap<usize, (usize, u64)>, pool: &ExpertPool, from: usize, len: usize) {
        let inside: Vec<(usize, usize, u64)> = at
            .range(from..from + len)
            .filter(|(&s, &(l, _))| s + l <= from + len)
            .map(|(&s, &(l, id))| (s, l, id))
            .collect();
        for (s, l, id) in inside {
            self.unmap_pool_pages(s, l);
            at.remove(&s);
            pool.give_back(id);
        }
    }

    /// Maps fresh anonymous memory (as the reservation's own) over `[at, at + len)` of the
    /// mapping, where pool pages were. Call with the placement lock held.
    fn unmap_pool_pages(&self, at: usize, len: usize) {
        // SAFETY: [at, at + len) is a page-aligned range inside this live mapping where pool
        // pages were mapped (or a failed attempt left it); replacing it with anonymous memory
        // drops the slice's bytes (later reads see zeros), as a release does, and no reference
        // into the mapping exists.
        let ok = unsafe {
            let p = self.map_ptr().add(at).cast();
            libc::mmap(
                p,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            ) != libc::MAP_FAILED
                && libc::madvise(p, len, libc::MADV_NOHUGEPAGE) >= 0
        };
        if !ok {
            log::error!("restoring anonymous memory under expert pool pages failed: {}", io::Error::last_os_error());
        }
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
            // destination range lies inside this mapping, which is never unmapped while the
            // process runs (a release maps fresh memory over its pages); the read writes at most
            // len - done bytes there.
            let n = unsafe {
                crate::interruptible_read::read_at(
                    fd.as_raw_fd(),
                    self.map_ptr().add((off - self.file_base) as usize),
                    len - done,
                    off,
                )
            }?;
            if n == 0 {
                break;
            }
            done += n;
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
    /// last bytes. Pool pages mapped under slices inside the range go back to the pool (once
    /// no read writes them any more). Returns the bytes released.
    pub fn release(&self, from: u64, to: u64) -> u64 {
        let Some((start, end)) = self.own_pages(from, to) else { return 0 };
        let (at, len) = ((start - self.file_base) as usize, (end - start) as usize);
        let mut placed = self.placements();
        if let Some(pool) = placed.pool.clone() {
            self.unplace_within(&mut placed.at, &pool, at, len);
        }
        drop(placed);
        // SAFETY: [start, end) lies inside the mapping [file_base, map_end) (own_pages clamps
        // to the tensor, which the mapping covers). MADV_DONTNEED on private anonymous memory
        // drops the pages' contents (later reads see zeros); on pool pages still mapped (a
        // placement that only straddles the range) it drops page-table entries only. No
        // reference into the mapping exists (the type hands none out), and ggml reads only the
        // slices the streamer made resident again before they are used.
        let released = unsafe { self.map.unchecked_advise_range(UncheckedAdvice::DontNeed, at, len) };
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
        let (dir, data, file) = file_of("res", 4 * page as usize + 1000, 251);
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

    #[test]
    fn slices_land_in_pool_pages_and_release_returns_them() {
        let page = page_size();
        let (dir, data, file) = file_of("pool", 8 * page as usize, 253);
        // Two slices of 3 pages and a half in a tensor one page into the file: the first owns
        // its first page (the mapping's head) to its last whole page, the second from its first
        // whole page to the mapping's tail; 3 pages each.
        let (off, size) = (page, 7 * page);
        let r = Reservation::new(off, size).unwrap();
        let half = size / 2;
        assert!(r.place(0, half).is_none(), "no pool yet");
        let pool = Arc::new(ExpertPool::new("test", 4 * page).unwrap());
        assert!(r.use_pool(Arc::clone(&pool)));
        let first = r.place(0, half).expect("free pages");
        assert_eq!(pool.free_bytes(), page);
        assert!(r.place(half, size).is_none(), "one page is free, the slice owns 3");
        assert_eq!(pool.misses(), 1);
        let (ws, we) = r.window(0, half);
        r.read_window(std::os::fd::AsFd::as_fd(&file), ws, (we - ws) as usize).unwrap();
        drop(first);
        let mut got = vec![0u8; half as usize];
        assert!(r.copy_to(0, &mut got));
        assert_eq!(got, &data[off as usize..(off + half) as usize], "the read landed in the pool, in place");
        assert_eq!(r.release(0, half), 3 * page);
        assert_eq!(pool.free_bytes(), 4 * page, "the release gave the pages back");
        assert!(r.copy_to(0, &mut got));
        assert!(got[..3 * page as usize].iter().all(|&b| b == 0), "the pool's pages are no longer mapped there");
        // Released while a read still writes it: the pages wait for that read.
        let second = r.place(half, size).expect("the pages are free again");
        assert_eq!(r.release(0, size), 7 * page);
        assert_eq!(pool.free_bytes(), page);
        drop(second);
        assert_eq!(pool.free_bytes(), 4 * page);
        // Leaving the pool gives everything back and lets go of it.
        let third = r.place(0, half).expect("free pages");
        drop(third);
        r.leave_pool();
        assert_eq!(pool.free_bytes(), 4 * page);
        assert_eq!(Arc::strong_count(&pool), 1, "the reservation holds the pool no more");
        assert!(r.place(0, half).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file of `len` bytes counting modulo `modulus` in a fresh directory named for `what`:
    /// the directory (to remove), the bytes, and the file open for reading.
    fn file_of(what: &str, len: usize, modulus: usize) -> (std::path::PathBuf, Vec<u8>, std::fs::File) {
        let dir = std::env::temp_dir().join(format!("ggml-sys-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..len).map(|i| (i % modulus) as u8).collect();
        std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        (dir, data, file)
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
