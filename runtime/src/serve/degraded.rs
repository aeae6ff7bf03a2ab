//! A server whose RPC worker is gone: requests fail with 503 until the worker answers again.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::error::ApiError;
use super::job::{Event, Job};
use super::shared::{Shared, IDLE_BEAT};

/// How often a degraded server tries to reach its lost worker.
const WORKER_RETRY: Duration = Duration::from_secs(1);

/// Fails the jobs that arrive while a worker is gone, until `endpoint` answers (true) or every
/// sender is gone (false).
pub fn wait_for_worker(endpoint: &str, shared: &Shared, jobs: &Receiver<Job>) -> bool {
    let mut last_try = Instant::now();
    loop {
        shared.beat();
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
            Err(RecvTimeoutError::Disconnected) => return false,
        }
        if last_try.elapsed() >= WORKER_RETRY {
            last_try = Instant::now();
            match ggml_sys::RpcDevice::connect(endpoint).and_then(|d| d.memory()) {
                Ok(_) => return true,
                Err(e) => log::debug!("still waiting: {e}"),
            }
        }
    }
}
