//! Whether standard output was closed when the process started. Rust's runtime replaces a closed
//! standard descriptor with `/dev/null` before `main`, which then cannot be told from a
//! `/dev/null` the caller opened (Python's `subprocess.DEVNULL` and supervisors open it
//! read-write, as the runtime does). A constructor that runs before the runtime's start looks at
//! descriptor 1 first. It lives here because declaring a constructor is unsafe, and every
//! `unsafe` of the project lives in this crate.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set before `main` when descriptor 1 was not open.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

// SAFETY: runs before main, with the Rust runtime not yet started: it only calls fcntl (a plain
// system call on an integer, no allocation, no Rust std state) and stores to an atomic.
#[ctor::ctor(unsafe)]
fn look_at_stdout() {
    // SAFETY: F_GETFD on a descriptor number reads its flags; an unopened one gives EBADF.
    let closed = unsafe { libc::fcntl(1, libc::F_GETFD) } == -1;
    STDOUT_CLOSED.store(closed, Ordering::Relaxed);
}

/// Whether descriptor 1 (standard output) was closed when the process started.
pub fn stdout_was_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}
