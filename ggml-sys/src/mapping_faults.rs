//! A failing disk under llama.cpp's file mapping. A model loaded resident (or its dense weights
//! under `--dense mmap`) is read by page faults on the mapping: a page the storage cannot read,
//! or one past the end of a file truncated while mapped, raises SIGBUS, which would end the
//! process with no word. [`name_mapped_model`] installs a handler that turns such a fault into
//! one message naming the model and exit status 1. Other SIGBUS faults (not a mapped file's) get
//! the default action back and end the process as before.

use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Once;

/// The message the handler writes: a leaked, never freed byte string (one per model loaded).
static MESSAGE: AtomicPtr<Vec<u8>> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Once = Once::new();

/// Names `model` in the message a failed read through a file mapping ends the process with, and
/// installs the SIGBUS handler (once per process).
pub fn name_mapped_model(model: &Path) {
    let text = format!(
        "error: reading the model {} through llama.cpp's file mapping failed (the storage returned an I/O error, or the file was truncated while in use); streamed runs with --dense anon (the default) read with sluice's own reader, which reports the failing tensor and keeps serving\n",
        model.display()
    );
    // The message this replaces is leaked, not freed: a handler running now may be writing it.
    let _ = MESSAGE.swap(Box::into_raw(Box::new(text.into_bytes())), Ordering::AcqRel);
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler has the
        // SA_SIGINFO signature and only calls async-signal-safe functions (write, signal, _exit).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
                log::warn!("cannot install the SIGBUS handler: {}", std::io::Error::last_os_error());
            }
        }
    });
}

/// The SIGBUS handler: for a fault on a mapped file (`BUS_ADRERR`), the message and exit 1;
/// otherwise the default action, taken when the faulting instruction runs again.
extern "C" fn on_sigbus(_signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler; MESSAGE holds null or
    // a leaked Vec that is never freed; write, signal and _exit are async-signal-safe.
    unsafe {
        if !info.is_null() && (*info).si_code == libc::BUS_ADRERR {
            let message = MESSAGE.load(Ordering::Acquire);
            if !message.is_null() {
                let bytes = &*message;
                libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len());
            }
            libc::_exit(1);
        }
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}
