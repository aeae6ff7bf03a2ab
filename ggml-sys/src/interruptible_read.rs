//! A read that a process can leave behind: through io_uring, a thread waiting for a read waits
//! in an interruptible sleep, so a process that gave up on storage that never answers exits at
//! once (the read completes, or not, in the kernel). A `pread` of an `O_DIRECT` file waits
//! uninterruptibly instead, and the process's exit waits with it. Where io_uring cannot be set up
//! (an old kernel, `kernel.io_uring_disabled`, a seccomp filter), reads fall back to `pread`.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

thread_local! {
    /// This thread's ring: `None` until its first read, then `Some(None)` where io_uring is
    /// unavailable.
    static RING: RefCell<Option<Option<IoUring>>> = const { RefCell::new(None) };
}

/// Reads at most `len` bytes of `fd` at `offset` into `dst`, as `pread` does (a short count at
/// the end of the file; `Interrupted` is retried here).
///
/// # Safety
/// `dst..dst + len` must be writable memory that stays mapped for as long as the process runs
/// (the kernel may complete a read the caller can no longer wait for only at the process's exit).
pub(crate) unsafe fn read_at(fd: RawFd, dst: *mut u8, len: usize, offset: u64) -> io::Result<usize> {
    RING.with(|cell| {
        let mut cell = cell.borrow_mut();
        let ring = cell.get_or_insert_with(|| match IoUring::new(2) {
            Ok(ring) => Some(ring),
            Err(e) => {
                log::debug!("io_uring is unavailable ({e}): reads use pread");
                None
            }
        });
        if let Some(ring) = ring {
            // SAFETY: the caller's contract.
            match unsafe { ring_read(ring, fd, dst, len, offset) } {
                Ok(n) => return Ok(n),
                Err(RingError::Read(e)) => return Err(e),
                Err(RingError::Unusable(e)) => {
                    log::warn!("io_uring refused a read ({e}): this thread reads with pread from now on");
                    *cell = Some(None);
                }
            }
        }
        // SAFETY: the caller's contract.
        unsafe { pread(fd, dst, len, offset) }
    })
}

/// How a read through the ring failed.
enum RingError {
    /// The read failed (its completion's error).
    Read(io::Error),
    /// The ring did not take the read: nothing is in flight, and the ring is not to be used again
    /// (its queue may still hold the entry).
    Unusable(io::Error),
}

/// `pread`, retried when interrupted.
///
/// # Safety
/// As [`read_at`].
unsafe fn pread(fd: RawFd, dst: *mut u8, len: usize, offset: u64) -> io::Result<usize> {
    loop {
        // SAFETY: the caller guarantees dst..dst + len is writable; pread writes at most len bytes.
        let n = unsafe { libc::pread(fd, dst.cast(), len, offset as libc::off_t) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One read through `ring`, waited for until it completes: once the kernel has taken it, this
/// returns only with its completion.
///
/// # Safety
/// As [`read_at`].
unsafe fn ring_read(ring: &mut IoUring, fd: RawFd, dst: *mut u8, len: usize, offset: u64) -> Result<usize, RingError> {
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    let read = opcode::Read::new(types::Fd(fd), dst, len).offset(offset).build();
    // SAFETY: the entry points at dst..dst + len, which the caller keeps writable and mapped; once
    // the kernel takes it, this thread waits for its completion before returning.
    unsafe { ring.submission().push(&read) }
        .map_err(|_| RingError::Unusable(io::Error::other("its submission queue is full")))?;
    loop {
        if let Err(e) = ring.submit_and_wait(1) {
            if !ring.submission().is_empty() {
                // Not taken: nothing in flight.
                return Err(RingError::Unusable(e));
            }
            // Taken and in flight (the wait was interrupted, or the kernel was short of room for
            // a moment): keep waiting for its completion.
            if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        if let Some(done) = ring.completion().next() {
            let n = done.result();
            return if n >= 0 { Ok(n as usize) } else { Err(RingError::Read(io::Error::from_raw_os_error(-n))) };
        }
    }
}
