//! I/O lanes: reader threads that read expert windows straight into their reservations.
//!
//! Each lane is a thread with its own descriptors for every shard (one `O_DIRECT`, one
//! buffered). A layer's reads are handed to all lanes at once: [`IoLanes::read_all`] returns when
//! every one has landed; with overlap, [`IoLanes::submit`] returns at once, compute threads wait
//! for just the experts they need with [`IoLanes::wait_any`], and [`IoLanes::wait`] collects the
//! batch. Reads are split at the device's maximum request size, and a lane reads the slices of
//! one tensor that follow each other in the file (adjacent experts, queued in file order) as one
//! request up to that size: a small expert's slice costs a request's overhead otherwise (a
//! prompt batch or several clients' tokens route many neighbours).
//!
//! Waves ([`IoLanes::submit_waves`]): a batch whose experts do not all fit in memory at once
//! marks the reads it does not keep as passing through; those take a share of a byte window,
//! a lane starts one only while the window has room, and [`IoLanes::release_after_use`] (the
//! kernel, once it has computed that expert) gives its pages and its share back. Reads go out in
//! the batch's order, so the expert a product waits for is always ahead of any it has not
//! reached.
//!
//! Speculative reads ([`ReadJob::speculative`], the lookahead's) go out after the batch's own:
//! once the engine knows which of them are wanted, [`IoLanes::drop_speculative`] drops the rest,
//! which lanes then skip, or stop between chunks. Neither a dropped nor a failed speculative read
//! fails its batch; its expert is handed back by [`IoLanes::take_lost`] (a wanted one is then
//! read again, and that read reports the failure).
//!
//! Direct I/O is verified per shard when the lanes open: one aligned block is read both ways and
//! compared. `EINVAL` (tmpfs before Linux 6.6, some FUSE file systems) or a mismatch switches
//! that shard to buffered reads, logged once; so does an `EINVAL` on a later read.
//!
//! Reads are trusted only as far as the file is the one opened: every read checks that the
//! shard's device, inode, size and modification time are unchanged, and an end of file before
//! the file's size at open fails the read (a truncated file), so an expert is never marked
//! resident with bytes that are not the model's. No wait is unbounded: every batch is bounded
//! (a stuck read fails it naming the expert), a cancel flag ends a wait within
//! [`CANCEL_POLL`], and a reader that panics fails its read instead of its batch hanging.
//!
//! Here: the lanes' API ([`IoLanes`]); in `job`, what a read is and how it ends; in `lane`, the
//! lane threads and the read of one job; in `identity`, a file's identity and the direct-I/O
//! check.

mod identity;
pub(crate) use identity::FileIdentity;
mod job;
mod lane;
mod pace;
#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use identity::verify_direct;
pub use job::{FaultKind, ReadFailure, ReadFault, ReadJob, ReadStats, SliceCheck};
use lane::{lane_loop, open_lane_files, Queue, Shard, Shared};
use pace::Pace;

/// How often a wait looks at the cancel flag.
pub const CANCEL_POLL: Duration = Duration::from_millis(100);

/// The reader threads.
pub struct IoLanes {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// How the lanes read.
#[derive(Debug, Clone)]
pub struct LaneConfig {
    /// Number of reader threads (at least 1).
    pub lanes: usize,
    /// Use `O_DIRECT` where the file system supports it.
    pub direct: bool,
    /// Largest single read in bytes (the device's maximum request size).
    pub max_request: usize,
    /// CPUs to pin the lanes to (empty: no pinning).
    pub cpus: Vec<usize>,
    /// The longest a batch of reads is waited for before it fails naming a missing expert.
    pub bound: Duration,
    /// Fault injection for tests.
    pub fault: Option<ReadFault>,
    /// Pace the reads to a slower device's rate, bytes per second (`--pace-mbps`): each
    /// request is done when such a device, serving requests one after another, would have
    /// served it.
    pub pace: Option<u64>,
}

pub use sluice_hal::storage::READ_BOUND;

impl IoLanes {
    /// Opens the lanes over `shards`. A lane that cannot start stops the ones already started.
    pub fn new(shards: &[PathBuf], config: &LaneConfig) -> io::Result<IoLanes> {
        let shards = shards
            .iter()
            .map(|p| {
                let identity = FileIdentity::of_path(p)?;
                let direct = config.direct
                    && match verify_direct(p) {
                        Ok(()) => true,
                        Err(why) => {
                            log::warn!("{}: {why}; reading it buffered", p.display());
                            false
                        }
                    };
                Ok(Shard { path: p.clone(), direct: AtomicBool::new(direct), identity })
            })
            .collect::<io::Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            shards,
            max_request: config.max_request.max(ggml_sys::page_size() as usize),
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            fault: config.fault,
            reads: AtomicU64::new(0),
            bound: config.bound,
            cancel: Mutex::new(None),
            batch: AtomicU64::new(0),
            drops: AtomicU64::new(0),
            pace: config.pace.map(Pace::new),
        });
        // Dropped on an error below: joins the lanes already started.
        let mut lanes = IoLanes { shared, threads: Vec::new() };
        for lane in 0..config.lanes.max(1) {
            let files = open_lane_files(&lanes.shared.shards)?;
            let shared = Arc::clone(&lanes.shared);
            let cpus = config.cpus.clone();
            let t = std::thread::Builder::new().name(format!("sluice-io-{lane}")).spawn(move || {
                if !cpus.is_empty() {
                    if let Err(e) = sluice_hal::cpu::pin_current_thread(&cpus) {
                        log::warn!("I/O lane {lane}: cannot pin to CPUs {cpus:?}: {e}");
                    }
                }
                lane_loop(&shared, &files);
            })?;
            lanes.threads.push(t);
        }
        Ok(lanes)
    }

    /// Reads begun since the lanes opened (a read counts once its lane takes it).
    pub fn reads_begun(&self) -> u64 {
        self.shared.reads.load(Ordering::Relaxed)
    }

    /// Whether no lane is in the middle of a read.
    pub fn idle(&self) -> bool {
        self.queue().busy == 0
    }

    /// The (layer, expert) of expert reads that landed after their batch was given up (a bound
    /// or a cancel), since the last call. Their pages may be in memory again although the engine
    /// released them: it releases each that is not resident again (`Streamer::release_stale`).
    pub fn take_stale(&self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.queue().stale)
    }

    /// Makes waits end, failing their batch, once `flag` is set (`None`: no flag).
    pub fn set_cancel_flag(&self, flag: Option<Arc<AtomicBool>>) {
        *self.shared.cancel.lock().unwrap_or_else(|e| e.into_inner()) = flag;
    }

    /// Whether shard `i` is read with `O_DIRECT`.
    pub fn is_direct(&self, shard: usize) -> bool {
        self.shared.shards[shard].direct.load(Ordering::Relaxed)
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.shared.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs every job in `jobs` across the lanes and waits for all of them, at most the lanes'
    /// bound. `jobs` is emptied (its capacity kept). The first failure is returned after every
    /// job has finished.
    pub fn read_all(&self, jobs: &mut Vec<ReadJob>) -> Result<ReadStats, ReadFailure> {
        self.submit(jobs);
        self.wait(jobs, Some(self.shared.bound))
    }

    /// Hands `jobs` to the lanes and returns at once; `jobs` is left empty. Call [`IoLanes::wait`]
    /// before the next submit.
    pub fn submit(&self, jobs: &mut Vec<ReadJob>) {
        self.start(jobs, None);
    }

    /// [`IoLanes::submit`] in waves: the passing reads ([`ReadJob::pass`]) begin in order while
    /// the bytes begun and not given back stay within `window` (one at a time when a single
    /// read is larger). Whoever computes the experts must call [`IoLanes::release_after_use`]
    /// for each, or the batch stalls until its bound.
    pub fn submit_waves(&self, jobs: &mut Vec<ReadJob>, window: u64) {
        self.start(jobs, Some(window));
    }

    /// The longest a batch is waited for.
    pub fn bound(&self) -> Duration {
        self.shared.bound
    }

    fn start(&self, jobs: &mut Vec<ReadJob>, window: Option<u64>) {
        let mut q = self.queue();
        std::mem::swap(&mut q.jobs, jobs);
        let n = q.jobs.len();
        q.landed.clear();
        q.landed.resize(n, false);
        q.released.clear();
        q.released.resize(n, false);
        q.dropped.clear();
        q.dropped.resize(n, false);
        q.window = window;
        q.held = 0;
        q.batch += 1;
        self.shared.batch.store(q.batch, Ordering::Relaxed);
        q.next = 0;
        q.finished = 0;
        q.stats = ReadStats::default();
        q.failure = None;
        self.shared.work.notify_all();
    }

    /// Waits for the submitted batch and hands its job list back through `jobs` (emptied, its
    /// capacity kept). The first failure is returned once every job has finished, or at once
    /// when `bound` passes or the cancel flag is set with reads still outstanding.
    pub fn wait(&self, jobs: &mut Vec<ReadJob>, bound: Option<Duration>) -> Result<ReadStats, ReadFailure> {
        let deadline = bound.map(|b| Instant::now() + b);
        let mut q = self.queue();
        while q.finished < q.jobs.len() {
            let now = Instant::now();
            let cancelled = self.shared.cancelled();
            if cancelled || deadline.is_some_and(|d| now >= d) {
                let i = q.landed.iter().position(|&l| !l).unwrap_or(0);
                let failure = q.failure.take().unwrap_or_else(|| {
                    if cancelled {
                        self.shared.failure(&q.jobs[i], cancelled_error())
                    } else {
                        self.shared.failure(&q.jobs[i], timed_out_error(bound.unwrap_or_default()))
                    }
                });
                q.next = q.jobs.len(); // lanes take nothing more from this batch
                q.batch += 1; // and what they finish of it is not counted
                self.shared.batch.store(q.batch, Ordering::Relaxed);
                self.shared.work.notify_all(); // a late read (tests) sees it
                std::mem::swap(&mut q.jobs, jobs);
                jobs.clear();
                return Err(failure);
            }
            let slice = deadline.map_or(CANCEL_POLL, |d| (d - now).min(CANCEL_POLL));
            q = self.shared.done.wait_timeout(q, slice).unwrap_or_else(|e| e.into_inner()).0;
        }
        std::mem::swap(&mut q.jobs, jobs);
        jobs.clear();
        match q.failure.take() {
            Some(f) => Err(f),
            None => Ok(q.stats),
        }
    }

    /// Drops the submitted speculative reads of the experts `keep` refuses (by `(layer,
    /// expert)`) that have not landed: lanes skip those not begun and stop those in progress
    /// between chunks. Their experts come back from [`IoLanes::take_lost`] once the reads have
    /// ended.
    pub fn drop_speculative(&self, keep: impl Fn((u32, u32)) -> bool) {
        let mut q = self.queue();
        let q = &mut *q;
        let mut any = false;
        for (i, j) in q.jobs.iter().enumerate() {
            if j.speculative && !q.landed[i] && !keep(j.tag) {
                q.dropped[i] = true;
                any = true;
            }
        }
        if any {
            self.shared.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The (layer, expert) of speculative reads that did not land whole (dropped, failed, or
    /// their batch given up) since the last call, each expert once per read: those experts must
    /// be marked not resident and their memory given back, once no batch is out.
    pub fn take_lost(&self) -> Vec<(u32, u32)> {
        let mut lost = std::mem::take(&mut self.queue().lost);
        lost.sort_unstable();
        lost.dedup();
        lost
    }

    /// Gives back the passing reads of expert `expert` of expert tensor `tensor` that have
    /// landed: their pages (those no neighbouring slice shares) and their share of the window.
    /// Reads the cache keeps are not touched. Returns the bytes released.
    pub fn release_after_use(&self, tensor: usize, expert: u32) -> u64 {
        let mut q = self.queue();
        if q.window.is_none() {
            return 0; // nothing of this batch passes through
        }
        let mut freed = 0;
        for i in 0..q.jobs.len() {
            let j = &q.jobs[i];
            let Some((from, to)) = j.slice.filter(|_| j.pass) else { continue };
            if j.tensor != tensor || j.tag.1 != expert || !q.landed[i] || q.released[i] {
                continue;
            }
            freed += j.target.release(from, to);
            let len = j.len as u64;
            q.released[i] = true;
            q.held = q.held.saturating_sub(len);
        }
        drop(q);
        self.shared.work.notify_all();
        freed
    }

    /// Whether no submitted read of expert `expert` of expert tensor `tensor` is outstanding
    /// (its slice has landed, or was never asked for).
    pub fn is_landed(&self, tensor: usize, expert: u32) -> bool {
        let q = self.queue();
        !q.jobs.iter().zip(&q.landed).any(|(j, &l)| !l && j.tensor == tensor && j.tag.1 == expert)
    }

    /// Blocks until the reads of at least one of `experts` of expert tensor `tensor` have all
    /// landed (at once when one has none outstanding). Returns `false` when the batch has
    /// failed, or when `bound` passes or the cancel flag is set, which then fails the batch
    /// naming the first expert still waited for.
    pub fn wait_any(&self, tensor: usize, experts: &[u32], bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        let mut q = self.queue();
        loop {
            if q.failure.is_some() {
                return false;
            }
            let outstanding =
                |e: u32| q.jobs.iter().zip(&q.landed).position(|(j, &l)| !l && j.tensor == tensor && j.tag.1 == e);
            let mut first = None;
            for &e in experts {
                match outstanding(e) {
                    None => return true,
                    Some(i) => {
                        first.get_or_insert(i);
                    }
                }
            }
            let Some(i) = first else { return true };
            let now = Instant::now();
            let cancelled = self.shared.cancelled();
            if cancelled || now >= deadline {
                let source = if cancelled { cancelled_error() } else { timed_out_error(bound) };
                let failure = self.shared.failure(&q.jobs[i], source);
                q.failure = Some(failure);
                self.shared.done.notify_all();
                return false;
            }
            q = self
                .shared
                .done
                .wait_timeout(q, (deadline - now).min(CANCEL_POLL))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Why a read given up at a cancel failed.
fn cancelled_error() -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, "cancelled while waiting for the read")
}

/// Why a read stopped part-way: its batch was given up.
fn abandoned_error() -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, "its batch was given up")
}

/// Why a speculative read stopped part-way: it was dropped.
fn dropped_error() -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, "the lookahead read was dropped")
}

/// Why a read still outstanding after `bound` failed.
fn timed_out_error(bound: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("not read within {:.1} s", bound.as_secs_f64()))
}

impl Drop for IoLanes {
    /// Stops the lanes; one stuck in a read that does not return within the bound is left
    /// behind (it holds only its own files) rather than hanging the caller.
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap_or_else(|e| e.into_inner()).shutdown = true;
        self.shared.work.notify_all();
        let deadline = Instant::now() + self.shared.bound.min(Duration::from_secs(5));
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::warn!("an I/O lane is stuck in a read; leaving it behind");
            }
        }
    }
}
