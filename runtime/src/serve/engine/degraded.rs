//! A server whose RPC worker is gone: requests fail with 503 until the worker answers again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use crate::serve::error::ApiError;
use crate::serve::job::{Event, Job};
use crate::serve::shared::{Shared, IDLE_BEAT};

/// How long a degraded server waits between two tries to reach its lost worker.
const WORKER_RETRY: Duration = Duration::from_secs(1);

/// Fails the jobs that arrive while a worker is gone, until `endpoint` answers (true) or every
/// sender is gone (false). The worker is tried on a thread of its own: a try against a worker
/// that accepts connections but does not answer lasts the connect and handshake bounds, and the
/// jobs meanwhile get their 503 at once and the engine keeps beating.
pub fn wait_for_worker(endpoint: &str, shared: &Shared, jobs: &Receiver<Job>) -> bool {
    let back = Arc::new(AtomicBool::new(false));
    let given_up = Arc::new(AtomicBool::new(false));
    {
        let (endpoint, back, given_up) = (endpoint.to_string(), Arc::clone(&back), Arc::clone(&given_up));
        std::thread::spawn(move || {
            while !given_up.load(Ordering::SeqCst) {
                match ggml_sys::RpcDevice::connect(&endpoint).and_then(|d| d.memory()) {
                    Ok(_) => return back.store(true, Ordering::SeqCst),
                    Err(e) => log::debug!("still waiting: {e}"),
                }
                std::thread::sleep(WORKER_RETRY);
            }
        });
    }
    loop {
        shared.beat();
        if back.load(Ordering::SeqCst) {
            return true;
        }
        match jobs.recv_timeout(IDLE_BEAT) {
            Ok(job) => {
                shared.dequeued();
                let _ = job.events.send(Event::Failed(ApiError::new(
                    503,
                    "server_error",
                    format!("the RPC worker at {endpoint} is gone; retry once it is back"),
                )));
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                given_up.store(true, Ordering::SeqCst);
                return false;
            }
        }
    }
}
