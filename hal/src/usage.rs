//! This process's resource usage: page faults and resident memory at an instant, and the wall
//! time and storage bytes of one phase.

use std::time::Duration;

/// Process resource usage at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Major page faults so far.
    pub major_faults: u64,
    /// Resident anonymous memory, bytes.
    pub rss_anon: u64,
    /// Resident file-backed memory, bytes.
    pub rss_file: u64,
    /// Resident shared memory (the streamer's expert pool where it is mapped), bytes.
    pub rss_shmem: u64,
    /// The highest resident size so far (`VmHWM`), bytes.
    pub rss_peak: u64,
}

impl Usage {
    /// Reads the current usage (zeros where the kernel does not say).
    pub fn sample() -> Usage {
        let major_faults = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
            .map(|u| u.major_page_faults().max(0) as u64)
            .unwrap_or(0);
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kb = |key: &str| crate::memory::meminfo_field(&status, key).unwrap_or(0);
        Usage {
            major_faults,
            rss_anon: kb("RssAnon:"),
            rss_file: kb("RssFile:"),
            rss_shmem: kb("RssShmem:"),
            rss_peak: kb("VmHWM:"),
        }
    }

    /// The resident size: anonymous, file-backed and shared memory.
    pub fn rss(&self) -> u64 {
        self.rss_anon + self.rss_file + self.rss_shmem
    }
}

/// Measures one phase (opening a model): its wall time and the bytes this process read from
/// storage meanwhile (`read_bytes` of `/proc/self/io`).
#[derive(Debug, Clone, Copy)]
pub struct PhaseMeter {
    start: std::time::Instant,
    read_before: Option<u64>,
}

impl PhaseMeter {
    /// Starts measuring now.
    pub fn start() -> PhaseMeter {
        PhaseMeter { start: std::time::Instant::now(), read_before: crate::storage::process_read_bytes() }
    }

    /// Wall time and storage bytes read since [`PhaseMeter::start`] (`None` where the kernel
    /// does not report `read_bytes`).
    pub fn finish(&self) -> (Duration, Option<u64>) {
        let read = self.read_before.and_then(|b| Some(crate::storage::process_read_bytes()?.saturating_sub(b)));
        (self.start.elapsed(), read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_reads_this_process() {
        assert!(Usage::sample().rss() > 0);
    }
}
