//! Reads paced to a slower device's rate (`--pace-mbps`): measuring a board's storage speed on
//! faster storage.
//!
//! The lanes read as fast as the disk lets them, then each request waits until a device of the
//! paced rate would have served it: requests are served one after another, in the order the
//! lanes issue them, each taking its bytes over the rate. A device that sat idle serves the next
//! request no sooner for it. That is where this differs from a cgroup's I/O throttle (`sluice
//! bench --storage-mbps`), which lets a group that read nothing for a while read above its
//! rate for a while after: a serial decode, idle while it computes, then reads faster than the
//! device it stands for, and looks as if it overlapped its reads.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A device's rate, shared by every lane.
#[derive(Debug)]
pub struct Pace {
    bytes_per_s: u64,
    /// When the device is free for the next request.
    free_at: Mutex<Option<Instant>>,
}

impl Pace {
    /// A device serving `bytes_per_s` (at least 1).
    pub fn new(bytes_per_s: u64) -> Pace {
        Pace { bytes_per_s: bytes_per_s.max(1), free_at: Mutex::new(None) }
    }

    /// Takes the device's next turn for a request of `len` bytes issued at `now`, and returns
    /// when the device has served it: after the requests before it, or `len` over the rate from
    /// `now` when the device is free.
    pub fn reserve(&self, now: Instant, len: usize) -> Instant {
        let mut free_at = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
        let start = free_at.map_or(now, |t| t.max(now));
        let served = start + Duration::from_secs_f64(len as f64 / self.bytes_per_s as f64);
        *free_at = Some(served);
        served
    }
}

/// Sleeps until `t` (a [`Pace::reserve`] answer), if it is still ahead.
pub fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_queue_behind_each_other_and_idle_time_earns_nothing() {
        let pace = Pace::new(1_000_000);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // Two lanes issue 1 MB each at once: served one after the other.
        assert_eq!(pace.reserve(t0, 1_000_000), t0 + ms(1000));
        assert_eq!(pace.reserve(t0, 1_000_000), t0 + ms(2000));
        // Issued while the device is busy: after what is queued.
        assert_eq!(pace.reserve(t0 + ms(1500), 500_000), t0 + ms(2500));
        // After ten idle seconds a request still takes its own time, no burst for the idle.
        assert_eq!(pace.reserve(t0 + ms(12_500), 2_000_000), t0 + ms(14_500));
        // A zero rate would never serve: it counts as one byte a second.
        assert_eq!(Pace::new(0).reserve(t0, 1), t0 + ms(1000));
    }
}
