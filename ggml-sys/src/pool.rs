//! Committed memory for streamed experts: a pool of pages that reads land in.
//!
//! An [`ExpertPool`] is a `memfd` whose pages are all allocated when the pool is made and never
//! given back to the kernel while it lives. A [`crate::Reservation`] that uses a pool maps some
//! of its free pages (`MAP_FIXED | MAP_SHARED | MAP_POPULATE`) under a slice's own pages before a
//! read writes them ([`crate::Reservation::place`]), and maps fresh anonymous memory back when it
//! releases them, which returns the pages. The slice stays at its address, so every kernel (the
//! streamed one and ggml-cpu's) reads it where it always did; what changes is that a read lands
//! in pages that are already there, their page-table entries filled in one call, instead of
//! faulting in and zeroing fresh pages one by one.
//!
//! A placement takes its pages as a few runs of the pool (first fit, freed runs merged again),
//! so slices of any size share one pool and it never fragments into failure: a placement fails
//! only when fewer pages are free than it needs.
//!
//! A placement that a read may still be writing (an `O_DIRECT` read pins its pages when it
//! starts; a batch given up after a timeout can leave one with the device) is not reused until
//! that read has finished, even when its slice was released meanwhile: the pinned pages would
//! otherwise receive the late bytes under another slice.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One placement's pages and what is being done with them.
struct Placement {
    /// Runs of the pool, in page units: (first page, pages).
    runs: Vec<(u64, u64)>,
    /// Reads writing them now.
    writers: u32,
    /// Released while being written: free once the writers finish.
    draining: bool,
}

/// The pool's bookkeeping.
struct Pages {
    /// Free runs: first page -> pages.
    free: BTreeMap<u64, u64>,
    free_pages: u64,
    placements: HashMap<u64, Placement>,
    next_id: u64,
}

impl Pages {
    /// Takes `n` pages, first fit, as few runs as that gives.
    fn take(&mut self, mut n: u64) -> Option<Vec<(u64, u64)>> {
        if n > self.free_pages {
            return None;
        }
        self.free_pages -= n;
        let mut runs = Vec::new();
        while n > 0 {
            let (start, len) = self.free.pop_first()?;
            let used = len.min(n);
            if len > used {
                self.free.insert(start + used, len - used);
            }
            runs.push((start, used));
            n -= used;
        }
        Some(runs)
    }

    /// Returns `runs` to the free list, merged with their free neighbours.
    fn give(&mut self, runs: &[(u64, u64)]) {
        for &(mut start, mut len) in runs {
            self.free_pages += len;
            if let Some((&s, &l)) = self.free.range(..start).next_back() {
                if s + l == start {
                    self.free.remove(&s);
                    (start, len) = (s, l + len);
                }
            }
            if let Some(l) = self.free.remove(&(start + len)) {
                len += l;
            }
            self.free.insert(start, len);
        }
    }
}

/// A pool of committed pages for expert slices.
pub struct ExpertPool {
    fd: OwnedFd,
    pages: u64,
    state: Mutex<Pages>,
    /// Placements that found too few free pages (and landed in fresh anonymous pages instead).
    misses: AtomicU64,
}

impl std::fmt::Debug for ExpertPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertPool").field("bytes", &self.bytes()).finish()
    }
}

/// A placement's pages in the pool: its id and its runs as (file offset, bytes).
pub(crate) struct Taken {
    pub(crate) id: u64,
    pub(crate) runs: Vec<(u64, u64)>,
}

impl ExpertPool {
    /// A pool of `bytes` (rounded up to whole pages), all of it allocated now. `name` labels
    /// the memfd (`/proc/PID/maps` shows it).
    pub fn new(name: &str, bytes: u64) -> io::Result<ExpertPool> {
        let page = crate::page_size();
        let pages = bytes.div_ceil(page);
        let total = pages
            .checked_mul(page)
            .and_then(|t| libc::off_t::try_from(t).ok())
            .filter(|&t| t > 0)
            .ok_or_else(|| io::Error::other(format!("a pool of {bytes} bytes cannot be made")))?;
        let cname = std::ffi::CString::new(format!("sluice-{name}")).map_err(io::Error::other)?;
        // SAFETY: cname is a valid NUL-terminated string; memfd_create returns a new descriptor
        // or -1.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a descriptor memfd_create just opened, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain calls on the descriptor just opened; no memory is passed.
        let sized =
            unsafe { libc::ftruncate(fd.as_raw_fd(), total) == 0 && libc::fallocate(fd.as_raw_fd(), 0, 0, total) == 0 };
        if !sized {
            return Err(io::Error::last_os_error());
        }
        let state =
            Pages { free: BTreeMap::from([(0, pages)]), free_pages: pages, placements: HashMap::new(), next_id: 0 };
        Ok(ExpertPool { fd, pages, state: Mutex::new(state), misses: AtomicU64::new(0) })
    }

    /// Bytes the pool holds (all of them committed).
    pub fn bytes(&self) -> u64 {
        self.pages * crate::page_size()
    }

    /// Bytes free now.
    pub fn free_bytes(&self) -> u64 {
        self.lock().free_pages * crate::page_size()
    }

    /// Placements that found too few free pages since the pool was made.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pages> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Takes `bytes` (whole pages) for a placement with one writer, or `None` (counted as a
    /// miss) when fewer are free.
    pub(crate) fn take(&self, bytes: u64) -> Option<Taken> {
        let page = crate::page_size();
        let mut s = self.lock();
        let Some(runs) = s.take(bytes.div_ceil(page)) else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let id = s.next_id;
        s.next_id += 1;
        s.placements.insert(id, Placement { runs: runs.clone(), writers: 1, draining: false });
        Some(Taken { id, runs: runs.into_iter().map(|(p, n)| (p * page, n * page)).collect() })
    }

    /// Another read begins writing placement `id`.
    pub(crate) fn begin_write(&self, id: u64) {
        if let Some(p) = self.lock().placements.get_mut(&id) {
            p.writers += 1;
        }
    }

    /// A read has finished writing placement `id`: a released one with no writer left is freed.
    pub(crate) fn end_write(&self, id: u64) {
        let mut s = self.lock();
        let Some(p) = s.placements.get_mut(&id) else { return };
        p.writers = p.writers.saturating_sub(1);
        if p.draining && p.writers == 0 {
            let p = s.placements.remove(&id).map(|p| p.runs).unwrap_or_default();
            s.give(&p);
        }
    }

    /// Placement `id`'s slice was released (its pages are no longer mapped there): they are
    /// free now, or once its writers finish.
    pub(crate) fn give_back(&self, id: u64) {
        let mut s = self.lock();
        let Some(p) = s.placements.get_mut(&id) else { return };
        if p.writers > 0 {
            p.draining = true;
            return;
        }
        let p = s.placements.remove(&id).map(|p| p.runs).unwrap_or_default();
        s.give(&p);
    }
}

/// A read's hold on the placement (pool pages under one slice) it writes: its pages are not reused until the hold ends
/// (dropped), even if its slice is released meanwhile.
pub struct SlotWrite {
    pub(crate) pool: std::sync::Arc<ExpertPool>,
    pub(crate) id: u64,
}

impl Drop for SlotWrite {
    fn drop(&mut self) {
        self.pool.end_write(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_take_runs_and_a_released_one_waits_for_its_writer() {
        let page = crate::page_size();
        let pool = ExpertPool::new("test", 5 * page - 1).unwrap();
        assert_eq!(pool.bytes(), 5 * page);
        let a = pool.take(2 * page).unwrap();
        let b = pool.take(page + 1).unwrap();
        assert_eq!(a.runs, vec![(0, 2 * page)]);
        assert_eq!(b.runs, vec![(2 * page, 2 * page)]);
        assert!(pool.take(2 * page).is_none());
        assert_eq!(pool.misses(), 1);
        // a released and written no more: its run is free; c then spans two runs.
        pool.end_write(a.id);
        pool.give_back(a.id);
        let c = pool.take(3 * page).unwrap();
        assert_eq!(c.runs, vec![(0, 2 * page), (4 * page, page)]);
        // b released while its read still writes: its pages wait for that read.
        pool.give_back(b.id);
        assert_eq!(pool.free_bytes(), 0);
        pool.end_write(b.id);
        assert_eq!(pool.free_bytes(), 2 * page);
        pool.end_write(c.id);
        pool.give_back(c.id);
        assert_eq!(pool.free_bytes(), 5 * page);
        assert_eq!(pool.take(5 * page).unwrap().runs, vec![(0, 5 * page)], "freed runs merge again");
    }
}
