//! How busy other processes keep a set of CPUs: the CPUs' busy time in `/proc/stat` less this
//! process's own CPU time, over a window of wall time. The streamer overlaps single-token decodes
//! only while its cores are otherwise idle (`storage.overlap = "auto"`): a waiting compute thread
//! or I/O lane that loses its core to another process stalls an overlapped layer.

use std::time::{Duration, Instant};

use nix::sys::time::{TimeVal, TimeValLike};

/// One reading: when, the CPUs' busy ticks, and this process's CPU time.
#[derive(Debug, Clone, Copy)]
struct Reading {
    at: Instant,
    busy_ticks: u64,
    own: Duration,
}

/// Other processes' use of a set of CPUs, measured window by window.
#[derive(Debug)]
pub struct CpuContention {
    cpus: Vec<usize>,
    window: Duration,
    tick: Duration,
    last: Option<Reading>,
    others: Option<f64>,
}

impl CpuContention {
    /// Measures `cpus` (every CPU this process may run on when empty), a reading every
    /// `window`; the first is taken now.
    pub fn new(cpus: &[usize], window: Duration) -> CpuContention {
        let cpus = if cpus.is_empty() { crate::cpu::allowed_cpus().unwrap_or_default() } else { cpus.to_vec() };
        let ticks_per_second = rustix::param::clock_ticks_per_second().max(1);
        let tick = Duration::from_secs(1) / u32::try_from(ticks_per_second).unwrap_or(100);
        let mut contention = CpuContention { cpus, window, tick, last: None, others: None };
        contention.last = contention.read();
        contention
    }

    /// Other processes' busy time on the CPUs over the last whole window, in CPUs (0: none, 1:
    /// one CPU kept busy), reading again once a window has passed since the last reading.
    /// `None` before the first window has passed, or where `/proc/stat` cannot be read.
    pub fn others(&mut self) -> Option<f64> {
        let due = self.last.is_none_or(|last| last.at.elapsed() >= self.window);
        if due {
            let now = self.read();
            if let (Some(before), Some(now)) = (self.last, now) {
                self.others = Some(others_busy(before, now, self.tick));
            }
            self.last = now.or(self.last);
        }
        self.others
    }

    fn read(&self) -> Option<Reading> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let busy_ticks = busy_ticks(&stat, &self.cpus)?;
        let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).ok()?;
        let time = |t: TimeVal| Duration::from_micros(t.num_microseconds().max(0) as u64);
        Some(Reading { at: Instant::now(), busy_ticks, own: time(usage.user_time()) + time(usage.system_time()) })
    }
}

/// Others' busy CPUs between two readings: the CPUs' busy time less this process's, over the wall
/// time between them (never below 0; this process's threads that ran elsewhere count as its own).
fn others_busy(before: Reading, now: Reading, tick: Duration) -> f64 {
    let wall = now.at.duration_since(before.at).as_secs_f64();
    if wall <= 0.0 {
        return 0.0;
    }
    let busy = tick.as_secs_f64() * now.busy_ticks.saturating_sub(before.busy_ticks) as f64;
    let own = now.own.saturating_sub(before.own).as_secs_f64();
    ((busy - own) / wall).max(0.0)
}

/// The busy ticks (user, nice, system, irq, softirq and steal: what a process waiting for the
/// CPU cannot have) of `cpus` in `/proc/stat`'s text. An offline CPU (no line) counts none;
/// `None` when no CPU of `cpus` has a line.
fn busy_ticks(stat: &str, cpus: &[usize]) -> Option<u64> {
    let mut found = false;
    let mut ticks = 0u64;
    for line in stat.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(cpu) = fields.next().and_then(|name| name.strip_prefix("cpu")).and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if !cpus.contains(&cpu) {
            continue;
        }
        let values: Vec<u64> = fields.map(|v| v.parse().unwrap_or(0)).collect();
        // user nice system idle iowait irq softirq steal (guest time is within user's).
        let at = |i: usize| values.get(i).copied().unwrap_or(0);
        ticks += at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
        found = true;
    }
    found.then_some(ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  900 10 300 5000 40 5 6 7 0 0
cpu0 100 1 50 2500 20 1 2 3 0 0
cpu2 800 9 250 2500 20 4 4 4 0 0
intr 1 2 3
ctxt 100
";

    #[test]
    fn busy_ticks_sum_the_listed_cpus_without_idle_or_iowait() {
        assert_eq!(busy_ticks(STAT, &[0]), Some(100 + 1 + 50 + 1 + 2 + 3));
        assert_eq!(busy_ticks(STAT, &[0, 2]), Some(157 + 800 + 9 + 250 + 4 + 4 + 4));
        assert_eq!(busy_ticks(STAT, &[2, 1]), Some(1071), "cpu1 is offline: no line, no ticks");
        assert_eq!(busy_ticks(STAT, &[1, 3]), None);
        assert_eq!(busy_ticks("cpu0 1 2\n", &[0]), Some(3), "a short line counts what it has");
    }

    #[test]
    fn others_are_the_busy_time_less_this_process_over_the_wall_time() {
        let at = Instant::now();
        let tick = Duration::from_millis(10);
        let before = Reading { at, busy_ticks: 1000, own: Duration::from_millis(500) };
        let second = at + Duration::from_secs(1);
        // 150 ticks (1.5 s of CPU) in a second, 0.5 s of it this process's.
        let now = Reading { at: second, busy_ticks: 1150, own: Duration::from_millis(1000) };
        assert!((others_busy(before, now, tick) - 1.0).abs() < 1e-9);
        let own_only = Reading { at: second, busy_ticks: 1040, own: Duration::from_millis(1000) };
        assert_eq!(others_busy(before, own_only, tick), 0.0, "this process ran elsewhere too: never below 0");
        assert_eq!(others_busy(before, Reading { at, ..now }, tick), 0.0, "no wall time");
    }

    /// A process spinning beside this one shows as another's busy CPU; this process's own
    /// spinning thread does not.
    #[test]
    fn a_busy_process_counts_and_a_busy_thread_of_ours_does_not() {
        let cpus = crate::cpu::allowed_cpus().unwrap();
        let window = Duration::from_millis(300);
        let mut contention = CpuContention::new(&cpus, window);
        assert_eq!(contention.others(), None, "no window has passed");

        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let spinner = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        std::thread::sleep(window + Duration::from_millis(50));
        let own = contention.others().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spinner.join().unwrap();
        assert!(own < 0.5, "our own spinning thread read as {own:.2} other CPUs");

        let mut busy = std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap();
        std::thread::sleep(window + Duration::from_millis(50));
        let others = contention.others();
        busy.kill().unwrap();
        busy.wait().unwrap();
        let others = others.unwrap();
        assert!(others > 0.5, "a spinning process read as {others:.2} CPUs");
    }
}
