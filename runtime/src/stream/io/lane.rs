//! The lane threads: each takes the batch's next read (a passing read only while the waves'
//! window has room) with the reads that follow it in the file ([`run_end`]), reads them in
//! chunks into their reservation, checks that the file is still the one opened and, with
//! `--verify`, the checksum of what landed, and records the outcome. A read that lands after
//! its batch was given up is recorded as stale for the engine to release.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::identity::{open_direct, FileIdentity};
use super::{abandoned_error, dropped_error, FaultKind, ReadFailure, ReadFault, ReadJob, ReadStats};

/// The largest request of a speculative read: a dropped one stops within this much.
const SPECULATIVE_REQUEST: usize = 256 << 10;

pub(super) struct Shard {
    pub(super) path: PathBuf,
    pub(super) direct: AtomicBool,
    pub(super) identity: FileIdentity,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: Vec<ReadJob>,
    /// Which of `jobs` have landed.
    pub(super) landed: Vec<bool>,
    /// Which passing reads were given back.
    pub(super) released: Vec<bool>,
    /// Which speculative reads were dropped ([`super::IoLanes::drop_speculative`]).
    pub(super) dropped: Vec<bool>,
    /// The (layer, expert) of speculative reads that did not land whole.
    pub(super) lost: Vec<(u32, u32)>,
    /// The byte window passing reads share (`None`: no waves).
    pub(super) window: Option<u64>,
    /// Bytes of passing reads begun and not yet given back.
    pub(super) held: u64,
    /// Batch number, so a read finishing after its batch was abandoned is not counted.
    pub(super) batch: u64,
    /// Reads a lane is performing now.
    pub(super) busy: usize,
    /// The (layer, expert) of expert reads that finished after their batch was abandoned: they
    /// may have written pages the engine had already released ([`IoLanes::take_stale`]).
    pub(super) stale: Vec<(u32, u32)>,
    pub(super) next: usize,
    pub(super) finished: usize,
    pub(super) stats: ReadStats,
    pub(super) failure: Option<ReadFailure>,
    pub(super) shutdown: bool,
}

pub(super) struct Shared {
    pub(super) shards: Vec<Shard>,
    pub(super) max_request: usize,
    pub(super) queue: Mutex<Queue>,
    pub(super) work: Condvar,
    pub(super) done: Condvar,
    /// Fault injection.
    pub(super) fault: Option<ReadFault>,
    pub(super) reads: AtomicU64,
    /// The longest a batch is waited for.
    pub(super) bound: Duration,
    /// Set when the decode the reads serve is cancelled.
    pub(super) cancel: Mutex<Option<Arc<AtomicBool>>>,
    /// The batch being read (`Queue::batch`), for a read between its chunks to see that its
    /// batch was abandoned without taking the queue's lock.
    pub(super) batch: AtomicU64,
    /// Bumped whenever speculative reads are dropped, for a read between its chunks to see
    /// without taking the queue's lock that it may have been.
    pub(super) drops: AtomicU64,
    /// A slower device's rate that every read waits for (`--pace-mbps`).
    pub(super) pace: Option<super::Pace>,
}

impl Shared {
    /// The failure of `job` for `cause`, naming its expert, file and offset.
    pub(super) fn failure(&self, job: &ReadJob, cause: io::Error) -> ReadFailure {
        ReadFailure {
            what: format!("expert {} of layer {}", job.tag.1, job.tag.0),
            path: self.shards[job.shard].path.clone(),
            offset: job.start,
            cause,
        }
    }

    pub(super) fn cancelled(&self) -> bool {
        self.cancel.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
    }
}

pub(super) struct LaneFiles {
    pub(super) direct: Option<File>,
    pub(super) buffered: File,
}

pub(super) fn open_lane_files(shards: &[Shard]) -> io::Result<Vec<LaneFiles>> {
    shards
        .iter()
        .map(|s| {
            let direct = if s.direct.load(Ordering::Relaxed) { open_direct(&s.path).ok() } else { None };
            Ok(LaneFiles { direct, buffered: File::open(&s.path)? })
        })
        .collect()
}

pub(super) fn lane_loop(shared: &Shared, files: &[LaneFiles]) {
    let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if q.shutdown {
            return;
        }
        if q.next < q.jobs.len() && (q.dropped[q.next] || (q.window.is_some() && q.failure.is_some())) {
            // A speculative read dropped before it began, or the rest of a failed wave batch
            // (nothing will compute, and give back, what is left): skipped.
            let i = q.next;
            q.next += 1;
            q.finished += 1;
            q.landed[i] = true;
            if q.dropped[i] {
                let tag = q.jobs[i].tag;
                q.lost.push(tag);
            }
            shared.done.notify_all();
        } else if q.next < q.jobs.len() && has_room(&q) {
            let (first, batch) = (q.next, q.batch);
            let end = run_end(&q, first, shared.max_request);
            let run: Vec<ReadJob> = q.jobs[first..end].to_vec();
            q.next = end;
            q.busy += 1;
            if run[0].pass {
                q.held += run[0].len as u64;
            }
            drop(q);
            let result = catch_unwind(AssertUnwindSafe(|| read_run(shared, files, &run, (batch, first))))
                .unwrap_or_else(|p| {
                    let what =
                        p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                    Err((0, io::Error::other(format!("the reader thread panicked: {}", what.unwrap_or_default()))))
                });
            q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.busy -= 1;
            record(shared, &mut q, &run, (batch, first), result);
        } else {
            q = shared.work.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Records how the run of jobs from `first` of batch `batch` ended: landed (its bytes counted), a
/// read ahead dropped or failed (its expert lost), or the batch's failure; a run whose batch was
/// abandoned meanwhile is stale instead (the engine gives back the pages it wrote).
fn record(
    shared: &Shared,
    q: &mut Queue,
    run: &[ReadJob],
    (batch, first): (u64, usize),
    result: Result<(u64, bool), (usize, io::Error)>,
) {
    if q.batch != batch {
        for job in run {
            if job.tensor != usize::MAX {
                q.stale.push(job.tag);
            }
            if job.speculative {
                q.lost.push(job.tag);
            }
        }
        return;
    }
    let job = &run[0];
    match result {
        Ok((bytes, direct)) => {
            q.stats.bytes += bytes;
            if direct {
                q.stats.direct_bytes += bytes;
            }
            if q.dropped[first] {
                // Read whole, then dropped: its bytes were read, its expert is not kept.
                q.lost.push(job.tag);
            }
        }
        Err((_, source)) if job.speculative => {
            if !q.dropped[first] {
                log::debug!("{} (a lookahead read, dropped)", shared.failure(job, source));
            }
            q.lost.push(job.tag);
        }
        Err((blamed, source)) => {
            if q.failure.is_none() {
                q.failure = Some(shared.failure(&run[blamed], source));
            }
        }
    }
    q.finished += run.len();
    q.landed[first..first + run.len()].fill(true);
    // Compute threads may be waiting for these very experts.
    shared.done.notify_all();
}

/// Whether the next job may begin: a passing read only while the window has room for it (or
/// nothing else of the window is held).
pub(super) fn has_room(q: &Queue) -> bool {
    match (q.window, q.jobs[q.next].pass) {
        (Some(window), true) => q.held == 0 || q.held + q.jobs[q.next].len as u64 <= window,
        _ => true,
    }
}

/// Where the run of jobs that one request reads, beginning with job `first`, ends (exclusive):
/// the slices of one tensor whose windows follow each other in the file (a layer's adjacent
/// experts, queued in file order), as long as the request stays within `max_request` bytes.
/// A passing, speculative or dense read is a run of its own (each is given back, dropped or
/// accounted alone), and so is a job dropped meanwhile.
fn run_end(q: &Queue, first: usize, max_request: usize) -> usize {
    let head = &q.jobs[first];
    let alone = |j: &ReadJob| j.pass || j.speculative || j.slice.is_none();
    if alone(head) {
        return first + 1;
    }
    let mut end = head.start + head.len as u64;
    let mut next = first + 1;
    while let Some(j) = q.jobs.get(next) {
        let follows = j.shard == head.shard
            && Arc::ptr_eq(&j.target, &head.target)
            && (head.start..=end).contains(&j.start)
            && (j.start + j.len as u64).max(end) - head.start <= max_request as u64;
        if alone(j) || q.dropped[next] || !follows {
            break;
        }
        end = end.max(j.start + j.len as u64);
        next += 1;
    }
    next
}

/// Reads a run of jobs ([`run_end`]) as one request: each slice's pool pages placed first, the
/// windows' union read once, then each slice's checksum checked (`--verify`). Returns the bytes
/// read and whether through `O_DIRECT`, or the error with the job it belongs to (the run's
/// first for the read itself).
fn read_run(
    shared: &Shared,
    files: &[LaneFiles],
    run: &[ReadJob],
    at: (u64, usize),
) -> Result<(u64, bool), (usize, io::Error)> {
    let [head, rest @ ..] = run else { return Ok((0, false)) };
    if rest.is_empty() {
        return read_job(shared, files, head, at).map_err(|e| (0, e));
    }
    // Held until the read is done: pool pages released meanwhile are not reused under it.
    let _placed: Vec<_> = run.iter().filter_map(|j| j.slice.and_then(|(from, to)| j.target.place(from, to))).collect();
    let end = run.iter().map(|j| j.start + j.len as u64).max().unwrap_or(head.start);
    let union = ReadJob { len: (end - head.start) as usize, slice: None, check: None, ..head.clone() };
    let read = read_job(shared, files, &union, at).map_err(|e| (0, e))?;
    for (i, job) in run.iter().enumerate() {
        verify_landed(shared, job).map_err(|e| (i, e))?;
    }
    Ok(read)
}

/// Reads one job (`at`: its batch and its place in it) in chunks of at most `max_request`
/// bytes. Returns the bytes read and whether they came through `O_DIRECT`. Fails when the file
/// ends before its size at open, or is no longer the file the lanes opened; stops between
/// chunks once its batch was abandoned, so that little is written into memory the engine has
/// released, and a speculative read once it was dropped.
pub(super) fn read_job(
    shared: &Shared,
    files: &[LaneFiles],
    job: &ReadJob,
    at: (u64, usize),
) -> io::Result<(u64, bool)> {
    let (batch, i) = at;
    let n = shared.reads.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(fault) = shared.fault.filter(|f| f.at == n) {
        return Err(inject(shared, files, job, batch, fault.kind, n));
    }
    let shard = &shared.shards[job.shard];
    let f = &files[job.shard];
    let mut use_direct = shard.direct.load(Ordering::Relaxed) && f.direct.is_some();
    // Held until the read is done: pool pages released meanwhile are not reused under it.
    let _placed = job.slice.and_then(|(from, to)| job.target.place(from, to));
    let mut done = 0usize;
    let mut drops = shared.drops.load(Ordering::Relaxed);
    let request = if job.speculative { shared.max_request.min(SPECULATIVE_REQUEST) } else { shared.max_request };
    while done < job.len {
        if shared.batch.load(Ordering::Relaxed) != batch {
            return Err(abandoned_error());
        }
        if job.speculative && shared.drops.load(Ordering::Relaxed) != drops {
            drops = shared.drops.load(Ordering::Relaxed);
            if shared.queue.lock().unwrap_or_else(|e| e.into_inner()).dropped.get(i) == Some(&true) {
                return Err(dropped_error());
            }
        }
        let len = (job.len - done).min(request);
        let fd = match (&f.direct, use_direct) {
            (Some(d), true) => d.as_fd(),
            _ => f.buffered.as_fd(),
        };
        // Paced: the request takes its turn on the slower device as it is issued, and is done
        // when that device would have served it.
        let served = shared.pace.as_ref().map(|p| p.reserve(std::time::Instant::now(), len));
        match job.target.read_window(fd, job.start + done as u64, len) {
            Ok(n) => {
                done += n;
                if let Some(t) = served {
                    super::pace::sleep_until(t);
                }
                if n < len {
                    // The window's last page may run past the end of the file; nothing else may.
                    let end = job.start + done as u64;
                    if end < shard.identity.size {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!(
                                "the file ends at {end} bytes, before its size at open ({} bytes): it was truncated",
                                shard.identity.size
                            ),
                        ));
                    }
                    break;
                }
            }
            Err(e) if use_direct && e.raw_os_error() == Some(libc::EINVAL) => {
                if shard.direct.swap(false, Ordering::Relaxed) {
                    log::warn!("{}: O_DIRECT read rejected ({e}); reading it buffered", shard.path.display());
                }
                use_direct = false;
            }
            Err(e) => return Err(e),
        }
    }
    check_landed(shared, job)?;
    Ok((done as u64, use_direct))
}

/// After a job's read: the file must still be the one the lanes opened (a change during the
/// read is caught too), and with `--verify` the bytes that landed must match their checksum.
fn check_landed(shared: &Shared, job: &ReadJob) -> io::Result<()> {
    let shard = &shared.shards[job.shard];
    let now = FileIdentity::of_path(&shard.path);
    match now.as_ref().map(|now| shard.identity.change(now)) {
        Ok(None) => {}
        Ok(Some(change)) => {
            return Err(io::Error::other(format!("the file changed since it was opened: {change}; restart to use it")))
        }
        Err(e) => return Err(io::Error::new(e.kind(), format!("the file changed since it was opened: {e}"))),
    }
    verify_landed(shared, job)
}

/// With `--verify`, whether the bytes of `job` that landed match their checksum.
fn verify_landed(shared: &Shared, job: &ReadJob) -> io::Result<()> {
    if let Some(check) = job.check {
        let sum = crate::stream::checksums::sum_of_landed(&job.target, check.from, check.to);
        if sum != Some(check.sum) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "its bytes do not match the checksum `sluice verify` recorded: the storage returned damaged data \
                     (`sluice verify --check --model {}` lists what else is damaged; restore the file from a good copy)",
                    shared.shards[0].path.display()
                ),
            ));
        }
    }
    Ok(())
}

/// A test's injected fault at read `n` instead of the job's read: an error, a panic, a read
/// that never returns until shutdown, or one that lands after its batch was abandoned.
fn inject(shared: &Shared, files: &[LaneFiles], job: &ReadJob, batch: u64, kind: FaultKind, n: u64) -> io::Error {
    match kind {
        FaultKind::Eio => io::Error::from_raw_os_error(libc::EIO),
        FaultKind::Panic => panic!("injected fault at read {n}"),
        FaultKind::Hang => {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            while !q.shutdown {
                q = shared.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            io::Error::from_raw_os_error(libc::EIO)
        }
        FaultKind::Late => {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            while !q.shutdown && q.batch == batch {
                q = shared.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            drop(q);
            let released = Instant::now() + Duration::from_secs(10);
            while job.target.resident_bytes() > 0 && Instant::now() < released {
                std::thread::sleep(Duration::from_millis(5));
            }
            // Late by more than the failed decode takes to unwind, even on a loaded machine: the
            // engine has given up on the batch by then, as a device that answers long after its
            // bound does.
            std::thread::sleep(Duration::from_millis(500));
            // The chunk that was with the device lands.
            let len = job.len.min(shared.max_request);
            let _ = job.target.read_window(files[job.shard].buffered.as_fd(), job.start, len);
            abandoned_error()
        }
    }
}
