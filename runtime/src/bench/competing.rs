//! Competing load: threads that keep the CPUs busy while the benchmark's configurations run, as
//! the other services on a board would (`sluice bench --competing N`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Threads spinning until dropped.
pub struct CompetingLoad {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl CompetingLoad {
    /// Starts `n` threads, each busy on whatever CPU the scheduler gives it.
    pub fn start(n: u32) -> Result<CompetingLoad, super::BenchError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut load = CompetingLoad { stop, threads: Vec::new() };
        for i in 0..n {
            let stop = Arc::clone(&load.stop);
            let spin = move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            };
            // Dropped on an error: stops the threads already started.
            let thread = std::thread::Builder::new().name(format!("sluice-busy-{i}")).spawn(spin);
            load.threads.push(thread.map_err(|e| super::BenchError::Io("starting a competing load thread".into(), e))?);
        }
        Ok(load)
    }
}

impl Drop for CompetingLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threads_spin_until_dropped() {
        let load = CompetingLoad::start(2).unwrap();
        assert_eq!(load.threads.len(), 2);
        assert!(load.threads.iter().all(|t| !t.is_finished()));
        drop(load);
    }
}
