//! ggml's CPU thread pool with a CPU mask, priority and polling level, attached to a context in
//! place of the pool llama.cpp would create on its own.

use llama_cpp_sys_2 as sys;

use crate::{Error, Result};

/// Scheduling priority of the compute threads (ggml's `ggml_sched_priority`). Above `Normal`
/// needs `CAP_SYS_NICE`; ggml warns and carries on without it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SchedPriority {
    /// Below normal (nice 5).
    Low,
    /// The default.
    #[default]
    Normal,
    /// Nice -5.
    Medium,
    /// Nice -10.
    High,
    /// `SCHED_FIFO`.
    Realtime,
}

impl SchedPriority {
    /// The names [`SchedPriority::from_name`] takes, lowest first.
    pub const NAMES: [&'static str; 5] = ["low", "normal", "medium", "high", "realtime"];

    /// The priority named `name` (one of [`SchedPriority::NAMES`]).
    pub fn from_name(name: &str) -> Option<SchedPriority> {
        Some(match name {
            "low" => SchedPriority::Low,
            "normal" => SchedPriority::Normal,
            "medium" => SchedPriority::Medium,
            "high" => SchedPriority::High,
            "realtime" => SchedPriority::Realtime,
            _ => return None,
        })
    }

    fn raw(self) -> sys::ggml_sched_priority {
        match self {
            SchedPriority::Low => sys::GGML_SCHED_PRIO_LOW,
            SchedPriority::Normal => sys::GGML_SCHED_PRIO_NORMAL,
            SchedPriority::Medium => sys::GGML_SCHED_PRIO_MEDIUM,
            SchedPriority::High => sys::GGML_SCHED_PRIO_HIGH,
            SchedPriority::Realtime => sys::GGML_SCHED_PRIO_REALTIME,
        }
    }
}

/// How a context's compute threads run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Threads {
    /// Number of compute threads (the calling thread is one of them).
    pub count: u32,
    /// CPUs the threads may run on. Empty: no thread pool of ours, llama.cpp's default (no
    /// pinning).
    pub cpus: Vec<usize>,
    /// Pin each thread to one CPU of `cpus` in turn, instead of letting each use all of them.
    pub strict_cpu: bool,
    /// Scheduling priority.
    pub priority: SchedPriority,
    /// Busy-poll level while waiting for work, 0 (sleep at once) to 100: at most 131,072 rounds
    /// and 70 µs a level (vendor patch 0015).
    pub poll: u32,
}

impl Threads {
    /// `count` unpinned threads at normal priority.
    pub fn unpinned(count: u32) -> Threads {
        Threads { count, cpus: Vec::new(), strict_cpu: false, priority: SchedPriority::Normal, poll: 50 }
    }
}

/// A ggml CPU thread pool; freed on drop (after the context that uses it).
pub(crate) struct ThreadPool {
    raw: *mut sys::ggml_threadpool,
}

impl ThreadPool {
    /// Creates the pool. Creating it applies the first thread's mask and priority to the calling
    /// thread, which computes as thread 0.
    pub(crate) fn new(threads: &Threads) -> Result<ThreadPool> {
        let count = threads.count.max(1);
        // SAFETY: returns a plain struct of defaults.
        let mut p = unsafe { sys::ggml_threadpool_params_default(count as i32) };
        let max = p.cpumask.len();
        for &cpu in &threads.cpus {
            *p.cpumask.get_mut(cpu).ok_or(Error::CpuOutOfRange { cpu, max })? = true;
        }
        p.strict_cpu = threads.strict_cpu;
        p.prio = threads.priority.raw();
        p.poll = threads.poll.min(100);
        // SAFETY: p is a fully initialized parameter struct; ggml copies what it needs.
        let raw = unsafe { sys::ggml_threadpool_new(&mut p) };
        if raw.is_null() {
            return Err(Error::ThreadPool { count });
        }
        Ok(ThreadPool { raw })
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_threadpool {
        self.raw
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        // SAFETY: raw came from ggml_threadpool_new and is freed once; the owning Context frees
        // its llama_context (the only user) before dropping this.
        unsafe { sys::ggml_threadpool_free(self.raw) };
    }
}

// SAFETY: the pool is driven only through the llama_context that owns it, from one thread at a
// time; its worker threads are ggml's own.
unsafe impl Send for ThreadPool {}

// SAFETY: the one call made through a shared pool, ggml_threadpool_pause, takes the pool's own
// mutex; compute still runs only through the owning context.
unsafe impl Sync for ThreadPool {}

/// A handle on a context's compute threads, for the code that blocks their work: while the
/// thread that drives the graph waits for something slow (storage), the others should sleep
/// instead of polling for the next graph and taking the cores the wait needs.
#[derive(Clone)]
pub struct ComputeThreads(std::sync::Arc<ThreadPool>);

impl ComputeThreads {
    pub(crate) fn new(pool: std::sync::Arc<ThreadPool>) -> ComputeThreads {
        ComputeThreads(pool)
    }

    /// Lets the idle compute threads sleep now rather than poll (ggml's pool wakes them when it
    /// hands out the next graph).
    pub fn rest(&self) {
        // SAFETY: the pool is live while this handle holds it; pausing takes its mutex, and a
        // paused pool resumes itself at the next graph's kickoff.
        unsafe { sys::ggml_threadpool_pause(self.0.raw()) };
    }
}
