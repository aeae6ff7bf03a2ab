//! `overlap = "auto"`: single-token decodes overlap their reads while other processes leave the
//! run's cores idle, and read serially while they do not. An overlapped layer's compute threads
//! wait for the lanes and the lanes for a core: on a board whose other services keep the cores
//! busy, a thread that loses its core stalls the layer, where a serial decode only waits for its
//! reads (docs/benchmarks.md: 0.75x serial overlapped beside two busy processes, 1.06-1.26x idle).

use std::time::Duration;

use sluice_hal::contention::{CpuContention, OthersLoad, SetLoad};

/// Decodes read serially while other processes keep more than this many CPUs of the run's cores
/// busy: a quarter of one (two busy processes beside a decode on two cores read as about one).
pub const BUSY_CPUS: f64 = 0.25;

/// The wall time over which other processes' use of the cores is measured.
pub const WINDOW: Duration = Duration::from_millis(250);

/// Where `overlap = "auto"` reads other processes' use of the run's cores.
#[derive(Debug, Clone, Default)]
pub enum CoresLoad {
    /// Measured: `/proc/stat` less this process's own CPU time, over [`WINDOW`].
    #[default]
    Measured,
    /// What the holder of the [`SetLoad`] sets (tests of the decision, on any machine).
    Set(SetLoad),
}

impl PartialEq for CoresLoad {
    fn eq(&self, other: &CoresLoad) -> bool {
        match (self, other) {
            (CoresLoad::Measured, CoresLoad::Measured) => true,
            (CoresLoad::Set(a), CoresLoad::Set(b)) => a.same(b),
            _ => false,
        }
    }
}

impl Eq for CoresLoad {}

/// Whether decodes overlap now, from the other processes' use of the run's cores.
#[derive(Debug)]
pub struct IdleCores {
    load: Box<dyn OthersLoad>,
    /// The last answer (for the log of each change).
    overlapping: Option<bool>,
}

impl IdleCores {
    /// Watches `cpus` (the compute and I/O cores; every allowed CPU when empty) through `load`.
    pub fn new(cpus: &[usize], load: &CoresLoad) -> IdleCores {
        let load: Box<dyn OthersLoad> = match load {
            CoresLoad::Measured => Box::new(CpuContention::new(cpus, WINDOW)),
            CoresLoad::Set(set) => Box::new(set.clone()),
        };
        IdleCores { load, overlapping: None }
    }

    /// Whether a decode overlaps its reads now: other processes used less than [`BUSY_CPUS`] of
    /// the cores over the last whole window. Serial before the first window has passed and where
    /// `/proc/stat` cannot be read.
    pub fn overlap(&mut self) -> bool {
        let others = self.load.others();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_overlap_while_others_leave_the_cores_idle_and_read_serially_otherwise() {
        let load = SetLoad::default();
        let mut idle = IdleCores::new(&[], &CoresLoad::Set(load.clone()));
        assert!(!idle.overlap(), "serial until the load is known");
        load.set(Some(0.0));
        assert!(idle.overlap(), "idle cores");
        load.set(Some(BUSY_CPUS + 0.01));
        assert!(!idle.overlap(), "busy beyond the bound");
        load.set(Some(BUSY_CPUS - 0.01));
        assert!(idle.overlap(), "below the bound again");
        load.set(None);
        assert!(!idle.overlap(), "unknown again");
    }

    #[test]
    fn loads_are_equal_when_they_read_the_same_thing() {
        let set = SetLoad::default();
        assert_eq!(CoresLoad::Measured, CoresLoad::Measured);
        assert_eq!(CoresLoad::Set(set.clone()), CoresLoad::Set(set));
        assert_ne!(CoresLoad::Set(SetLoad::default()), CoresLoad::Set(SetLoad::default()));
        assert_ne!(CoresLoad::Measured, CoresLoad::Set(SetLoad::default()));
    }
}
