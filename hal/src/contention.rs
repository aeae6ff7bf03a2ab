//! How busy other processes keep a set of CPUs: the CPUs' busy time in `/proc/stat` less this
//! process's own CPU time, over a window of wall time. The streamer overlaps single-token decodes
//! only while its cores are otherwise idle (`storage.overlap = "auto"`): a waiting compute thread
//! or I/O lane that loses its core to another process stalls an overlapped layer.
//!
//! What decides from the load reads it through [`OthersLoad`]: [`CpuContention`] on a board,
//! [`SetLoad`] in a test that must not depend on how busy the machine running it is.

use std::sync::{Arc, Mutex, PoisonError};
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

    /// The wall time of one window.
    pub fn window(&self) -> Duration {
        self.window
    }

    fn read(&self) -> Option<Reading> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let busy_ticks = busy_ticks(&stat, &self.cpus)?;
        let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).ok()?;
        let time = |t: TimeVal| Duration::from_micros(t.num_microseconds().max(0) as u64);
        Some(Reading { at: Instant::now(), busy_ticks, own: time(usage.user_time()) + time(usage.system_time()) })
    }
}

/// How many CPUs other processes keep busy, as a decision that depends on it asks.
pub trait OthersLoad: Send + std::fmt::Debug {
    /// Other processes' busy CPUs (0: none, 1: one CPU kept busy); `None` while unknown.
    fn others(&mut self) -> Option<f64>;
}

impl OthersLoad for CpuContention {
    fn others(&mut self) -> Option<f64> {
        CpuContention::others(self)
    }
}

/// A load its holder sets: every clone reports the last value set ([`SetLoad::set`]), at once,
/// whatever the machine is doing. Tests of decisions made from the load use it.
#[derive(Debug, Clone, Default)]
pub struct SetLoad(Arc<Mutex<Option<f64>>>);

impl SetLoad {
    /// A load that reads as `others` busy CPUs (`None`: unknown).
    pub fn new(others: Option<f64>) -> SetLoad {
        SetLoad(Arc::new(Mutex::new(others)))
    }

    /// From now on every clone reads `others`.
    pub fn set(&self, others: Option<f64>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = others;
    }

    /// Whether `other` is a clone of this load (reports what this one is set to).
    pub fn same(&self, other: &SetLoad) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl OthersLoad for SetLoad {
    fn others(&mut self) -> Option<f64> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
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

    #[test]
    fn a_set_load_reads_as_set_in_every_clone() {
        let mut load = SetLoad::default();
        assert_eq!(OthersLoad::others(&mut load), None);
        let mut clone = load.clone();
        load.set(Some(1.5));
        assert_eq!(clone.others(), Some(1.5));
        assert!(load.same(&clone) && !load.same(&SetLoad::new(Some(1.5))));
    }

    /// How many trials the machine's own load may spoil before the real-machine test gives up.
    const TRIALS: usize = 8;
    /// How far the load may move between the windows before and after an action for the trial to
    /// tell the action's difference (CPUs).
    const STEADY: f64 = 0.25;
    /// The room an action needs: a CPU at most this busy (others' CPUs below the CPU count).
    const ROOM: f64 = 0.75;

    /// Others' CPUs over the next whole window.
    fn next_window(contention: &mut CpuContention) -> f64 {
        std::thread::sleep(contention.window() + Duration::from_millis(30));
        contention.others().expect("/proc/stat is readable")
    }

    /// What others' CPUs become while `action` runs, against the mean of the windows before and
    /// after it; `None` when the machine's own load moved by more than [`STEADY`] across them or
    /// left no [`ROOM`] for the action to show.
    fn difference_made(
        contention: &mut CpuContention,
        cpus: usize,
        action: &dyn Fn() -> Box<dyn FnOnce()>,
    ) -> Option<f64> {
        let before = next_window(contention);
        let stop = action();
        let during = next_window(contention);
        stop();
        let after = next_window(contention);
        let steady = (before - after).abs() <= STEADY && before.max(after) <= cpus as f64 - ROOM;
        steady.then(|| during - (before + after) / 2.0)
    }

    /// Runs `trial` until a trial's load held still (`Some`) and `holds` is true of it, at most
    /// [`TRIALS`] times: `Err` with the differences seen when every steady trial failed, `Ok(None)`
    /// when none was steady (the machine cannot show it), `Ok(Some(d))` with the passing one.
    fn first_steady(
        mut trial: impl FnMut() -> Option<f64>,
        holds: impl Fn(f64) -> bool,
    ) -> Result<Option<f64>, Vec<f64>> {
        let mut seen = Vec::new();
        for _ in 0..TRIALS {
            match trial() {
                Some(d) if holds(d) => return Ok(Some(d)),
                Some(d) => seen.push(d),
                None => {}
            }
        }
        if seen.is_empty() {
            Ok(None)
        } else {
            Err(seen)
        }
    }

    /// On the real machine, against the load it already has: a process spinning beside this one
    /// adds about a CPU to the others', and this process's own spinning thread adds none. Each
    /// difference is measured between windows before and after the action; a trial in which the
    /// machine's own load moved (or left no idle CPU) tells nothing and is tried again, and when
    /// no trial could tell the test says it was skipped and why.
    #[test]
    fn a_busy_process_counts_and_a_busy_thread_of_ours_does_not() {
        let cpus = crate::cpu::allowed_cpus().unwrap();
        let mut contention = CpuContention::new(&cpus, Duration::from_millis(300));
        assert_eq!(contention.others(), None, "no window has passed");

        let own_thread = || -> Box<dyn FnOnce()> {
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flag = Arc::clone(&stop);
            let spinner = std::thread::spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            Box::new(move || {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                spinner.join().unwrap();
            })
        };
        let other_process = || -> Box<dyn FnOnce()> {
            let mut busy = std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap();
            Box::new(move || {
                busy.kill().unwrap();
                busy.wait().unwrap();
            })
        };
        let n = cpus.len();
        match first_steady(|| difference_made(&mut contention, n, &own_thread), |d| d < 0.5) {
            Ok(Some(_)) => {}
            Ok(None) => eprintln!("skipped (own thread): the machine's load never held still with a CPU to spare"),
            Err(seen) => panic!("our own spinning thread read as {seen:.2?} more CPUs of others"),
        }
        match first_steady(|| difference_made(&mut contention, n, &other_process), |d| d > 0.5) {
            Ok(Some(_)) => {}
            Ok(None) => eprintln!("skipped (other process): the machine's load never held still with a CPU to spare"),
            Err(seen) => panic!("a spinning process read as {seen:.2?} more CPUs of others"),
        }
    }
}
