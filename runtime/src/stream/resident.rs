//! A resident load (`--resident`) under the storage guarantees of the streamed modes: llama.cpp
//! reads every weight with read(2) (its direct-I/O load) instead of mapping the file, so a failing
//! read is an error naming the file rather than a fault in a mapping, and the bytes are copied
//! once; a watchdog ends the process with an error when no read returns within
//! [`LOAD_STALL_BOUND`]; and the file's identity is checked after the load, so a rewrite in place
//! during it (size and modification time restored) is an error, not wrong tokens.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ggml_sys::{Model, ModelParams};

use super::io::FileIdentity;
use crate::generate::GenerateError;

/// How long a resident load may go without a read returning: the lanes' bound per read, plus
/// what llama.cpp's largest read (64 MiB) takes at 6.4 MB/s, a slow SD card's speed.
pub const LOAD_STALL_BOUND: Duration = Duration::from_secs(super::READ_BOUND.as_secs() + 10);

/// How often the watchdog looks at the reads.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// What the watchdog's own look reads, at most (about a hundred bytes).
const OWN_READS: u64 = 1024;

/// Loads `path` resident with `params` (its weights read, not mapped), guarded as the module
/// says. A stall ends the process with exit status 1 after printing why: the read that stalls
/// cannot be interrupted, and waiting on it would wait on the storage.
pub fn load_resident(path: &Path, params: &ModelParams) -> Result<Model, GenerateError> {
    let identity =
        || FileIdentity::of_path(path).map_err(|e| GenerateError::Storage(format!("{}: {e}", path.display())));
    let before = identity()?;
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (done, path) = (Arc::clone(&done), path.to_path_buf());
        std::thread::Builder::new()
            .name("sluice-load-watch".into())
            .spawn(move || watch(&done, &path))
            .map_err(|e| GenerateError::Storage(format!("cannot start the load's watchdog: {e}")))?
    };
    let loaded = crate::generate::load_model_with(path, &ModelParams { direct_io: true, ..params.clone() });
    done.store(true, Ordering::SeqCst);
    let _ = watchdog.join();
    let model = loaded?;
    let after = identity()?;
    match before.change(&after) {
        Some(change) => Err(GenerateError::Storage(format!(
            "{} changed while it was loaded: {change}; the weights read are neither the old file nor the new one, run again",
            path.display()
        ))),
        None => Ok(model),
    }
}

/// Until `done`: ends the process when this process's reads have returned nothing for
/// [`LOAD_STALL_BOUND`].
fn watch(done: &AtomicBool, path: &Path) {
    let read = sluice_hal::storage::process_read_chars;
    let (mut last, mut since) = (read(), Instant::now());
    if last.is_none() {
        log::warn!("/proc/self/io cannot be read: a stall while {} loads is not bounded", path.display());
        return;
    }
    while !done.load(Ordering::SeqCst) {
        std::thread::sleep(WATCH_EVERY);
        let now = read();
        // (more than the watchdog's own read of /proc/self/io since its last look)
        if now.unwrap_or(0) > last.unwrap_or(0) + OWN_READS {
            since = Instant::now();
        }
        last = now;
        if since.elapsed() >= LOAD_STALL_BOUND && !done.load(Ordering::SeqCst) {
            let message = format!(
                "error: loading {} resident: no read returned for {} s (the storage stopped answering)",
                path.display(),
                LOAD_STALL_BOUND.as_secs()
            );
            // (never a panic: a closed standard error still ends the process)
            let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{message}\n").as_bytes());
            ggml_sys::exit_now(1);
        }
    }
}
