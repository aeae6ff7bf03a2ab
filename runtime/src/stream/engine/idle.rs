//! `overlap = "auto"`: single-token decodes overlap their reads while other processes leave the
//! run's cores idle, and read serially while they do not. An overlapped layer's compute threads
//! wait for the lanes and the lanes for a core: on a board whose other services keep the cores
//! busy, a thread that loses its core stalls the layer, where a serial decode only waits for its
//! reads (docs/benchmarks.md: 0.75x serial overlapped beside two busy processes, 1.06-1.26x idle).

use std::time::Duration;

use sluice_hal::contention::CpuContention;

/// Decodes read serially while other processes keep more than this many CPUs of the run's cores
/// busy: a quarter of one (two busy processes beside a decode on two cores read as about one).
pub const BUSY_CPUS: f64 = 0.25;

/// The wall time over which other processes' use of the cores is measured.
pub const WINDOW: Duration = Duration::from_millis(250);

/// Whether decodes overlap now, from the other processes' use of the run's cores.
#[derive(Debug)]
pub struct IdleCores {
    contention: CpuContention,
    /// The last answer (for the log of each change).
    overlapping: Option<bool>,
}

impl IdleCores {
    /// Watches `cpus` (the compute and I/O cores; every allowed CPU when empty).
    pub fn new(cpus: &[usize]) -> IdleCores {
        IdleCores { contention: CpuContention::new(cpus, WINDOW), overlapping: None }
    }

    /// Whether a decode overlaps its reads now: other processes used less than [`BUSY_CPUS`] of
    /// the cores over the last whole window. Serial before the first window has passed and where
    /// `/proc/stat` cannot be read.
    pub fn overlap(&mut self) -> bool {
        let others = self.contention.others();
        let overlap = others.is_some_and(|busy| busy < BUSY_CPUS);
        if self.overlapping != Some(overlap) {
            match others {
                Some(busy) if overlap => log::debug!("decodes overlap their reads: others use {busy:.2} of the cores"),
                Some(busy) => log::debug!("decodes read serially: other processes keep {busy:.2} of the cores busy"),
                None => log::debug!("decodes read serially until the cores' use is measured"),
            }
            self.overlapping = Some(overlap);
        }
        overlap
    }
}
