//! How ggml's compute threads wait, under vendor patch 0015: a thread waiting at a barrier for a
//! thread that is not running spins only briefly, then sleeps, and an idle thread polls for new
//! work for a bounded time, leaving its core to whatever can use it (the thread it waits for, the
//! I/O lanes, a board's other services).

use std::sync::Mutex;
use std::time::Duration;

use ggml_sys::ext::Backend;
use ggml_sys::Threads;
use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::time::TimeVal;

/// CPU time (user and system) the calling thread has used.
fn thread_cpu_time() -> Duration {
    let usage = getrusage(UsageWho::RUSAGE_THREAD).unwrap();
    let micros = |t: TimeVal| Duration::from_micros(t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64);
    micros(usage.user_time()) + micros(usage.system_time())
}

#[test]
fn a_thread_waiting_at_the_barrier_sleeps_instead_of_spending_the_wait_on_its_core() {
    // Long waits, so that the rest of a computation's CPU time (a graph planned and started each
    // round: about a millisecond under qemu) stays small beside them.
    const ROUNDS: u32 = 20;
    const HELD: Duration = Duration::from_millis(20);
    let backend = Backend::cpu(&Threads { poll: 0, ..Threads::unpinned(2) }).unwrap();
    // Thread 0 is the calling thread: it finishes at once and waits at the barrier that ends the
    // graph while thread 1 is held (off the CPU, as a thread preempted by another process is).
    let before = thread_cpu_time();
    for _ in 0..ROUNDS {
        backend
            .cpu_parallel(|ith, _| {
                if ith == 1 {
                    std::thread::sleep(HELD);
                }
            })
            .unwrap();
    }
    let spent = thread_cpu_time() - before;
    let waited = HELD * ROUNDS;
    // Spinning through the waits costs about `waited` of CPU; the patch spins 100 us a wait.
    assert!(spent < waited / 4, "thread 0 used {spent:?} of CPU over {ROUNDS} waits of {HELD:?} each");
}

#[test]
fn an_idle_thread_polls_for_new_work_for_a_bounded_time_then_sleeps() {
    // Level 50 (every profile's) polls at most 3.5 ms; ggml's own bound, 6.5 million rounds, is
    // 88 ms of `pause` on an x86 server. A pool outlives a computation when it has a CPU list
    // (as sluice's always has); without one ggml makes a pool for each computation.
    let usable = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let cpus = (0..1024).filter(|&c| usable.is_set(c).unwrap_or(false)).collect();
    let backend = Backend::cpu(&Threads { cpus, poll: 50, ..Threads::unpinned(2) }).unwrap();
    let worker_cpu = Mutex::new(Vec::new());
    let record = |ith: usize, _| {
        if ith == 1 {
            worker_cpu.lock().unwrap().push(thread_cpu_time());
        }
    };
    backend.cpu_parallel(record).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    backend.cpu_parallel(record).unwrap();
    let seen = worker_cpu.into_inner().unwrap();
    let idle = seen[1] - seen[0];
    assert!(idle < Duration::from_millis(20), "the idle pool thread used {idle:?} of CPU in 300 ms without work");
}
