//! One file of a pull: several ranges in flight, each retried with backoff where it broke off, a
//! state file beside the partial file so that a pull stopped at any point and run again fetches
//! no finished range twice, and the file's digest (and its part of the checksum sidecar) computed
//! in order as the ranges land, so the file is checked without a second read.
//!
//! The partial file gets the whole size up front (`posix_fallocate`: the space is the pull's
//! before the first byte). Each range is synced to storage before the state file says it is
//! there. The hasher reads each range back while it is still in the page cache and then drops it
//! from the cache, and ranges are fetched at most a window ahead of the hasher: a pull keeps a
//! few dozen MiB of the page cache, not the whole file, so it does not push out the pages of a
//! model being served beside it.

use std::fs::{self, File};
use std::io::Read as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::http::{check_status, is_transient, Http, Token};
use super::partial::{io_err, open_partial, partial_paths, PartState, STATE_MAGIC};
use super::progress::Progress;
use super::sha256::Sha256State;
use super::{PlannedFile, PullError};
use crate::stream::checksums::streaming::{FinishedShard, ShardCheckpoint, ShardHasher, SumsBuilder};

/// The bytes of a file hashed between two saves of the hasher's state (after a restart, at
/// most this much is read again, never fetched again).
const CHECKPOINT_BYTES: u64 = 256 << 20;
/// The bytes at the start of a GGUF file read for its header before the sidecar can be summed.
const HEAD_BYTES: u64 = 64 << 20;
/// Bytes copied per read.
const BUF: usize = 1 << 20;

/// How a file is fetched.
#[derive(Debug, Clone)]
pub struct FetchSettings {
    /// Ranges in flight.
    pub connections: usize,
    /// Bytes a range.
    pub chunk: u64,
    /// Tries of a range that makes no progress before the pull gives up.
    pub retries: u32,
    /// The first wait before a retry (doubled each time, at most 30 s).
    pub backoff: Duration,
}

/// Shared between the fetchers and the hasher of one file.
struct Shared {
    state: PartState,
    /// Ranges taken by a fetcher and not yet done.
    taken: Vec<bool>,
    /// Ranges the hasher has finished with.
    hashed: usize,
    error: Option<PullError>,
}

struct Job<'a> {
    http: &'a Http,
    token: Option<&'a Token>,
    file: &'a PlannedFile,
    settings: &'a FetchSettings,
    progress: &'a dyn Progress,
    partial: File,
    partial_path: PathBuf,
    state_path: PathBuf,
    shared: Mutex<Shared>,
    wake: Condvar,
    window: usize,
}

/// Bytes `[from, to)` of range `c` of a file of `size` bytes cut in ranges of `chunk`.
fn range_of(c: usize, chunk: u64, size: u64) -> (u64, u64) {
    (c as u64 * chunk, ((c as u64 + 1) * chunk).min(size))
}

impl Job<'_> {
    fn range(&self, c: usize) -> (u64, u64) {
        range_of(c, self.settings.chunk, self.file.size)
    }

    fn save(&self, s: &PartState) -> Result<(), PullError> {
        crate::framed::save(&self.state_path, STATE_MAGIC, s).map_err(io_err(&self.state_path))
    }

    fn fail(&self, e: PullError) {
        let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        s.error.get_or_insert(e);
        self.wake.notify_all();
    }

    /// The next range for a fetcher, waiting while it would be more than the window ahead of
    /// the hasher; `None` when none is left or the file failed.
    fn take(&self) -> Option<usize> {
        let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if s.error.is_some() {
                return None;
            }
            let next = (0..s.taken.len()).find(|&c| !s.state.done[c] && !s.taken[c])?;
            if next < s.hashed + self.window {
                s.taken[next] = true;
                return Some(next);
            }
            s = self.wake.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Fetches ranges until none is left.
    fn fetcher(&self) {
        while let Some(c) = self.take() {
            match self.fetch_with_retries(c) {
                Ok(()) => {
                    let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
                    s.state.done[c] = true;
                    let saved = self.save(&s.state);
                    if let Err(e) = saved {
                        s.error.get_or_insert(e);
                    }
                    self.wake.notify_all();
                }
                Err(e) => return self.fail(e),
            }
        }
    }

    fn failed(&self) -> bool {
        self.shared.lock().unwrap_or_else(|p| p.into_inner()).error.is_some()
    }

    /// Fetches range `c` whole, trying again from where a try broke off.
    fn fetch_with_retries(&self, c: usize) -> Result<(), PullError> {
        let (from, to) = self.range(c);
        let (mut got, mut tries, mut wait) = (0u64, 0u32, self.settings.backoff);
        loop {
            let before = got;
            match self.fetch_range(from, to, &mut got) {
                Ok(()) => break,
                Err(e) if !e.is_transient() || self.failed() => return Err(e),
                Err(e) => {
                    if got > before {
                        (tries, wait) = (0, self.settings.backoff);
                    }
                    tries += 1;
                    if tries > self.settings.retries {
                        return Err(PullError::GaveUp { file: self.file.label.clone(), tries, last: Box::new(e) });
                    }
                    self.progress.note(&format!(
                        "{}: {e}; trying again in {:.1} s",
                        self.file.label,
                        wait.as_secs_f64()
                    ));
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
            }
        }
        self.partial.sync_data().map_err(io_err(&self.partial_path))
    }

    /// One try at bytes `[from + got, to)`, counting what lands in `got`.
    fn fetch_range(&self, from: u64, to: u64, got: &mut u64) -> Result<(), PullError> {
        let start = from + *got;
        let mut first = ureq::http::HeaderMap::new();
        let (mut resp, at) =
            self.http.get(&self.file.url, Some((start, to - 1)), None, self.token, Some(&mut first))?;
        let linked =
            first.get("x-linked-etag").and_then(|v| v.to_str().ok()).map(|v| v.trim_matches('"').to_ascii_lowercase());
        if linked.is_some_and(|l| l.len() == 64 && l != self.file.sha256) {
            return Err(PullError::Changed { file: self.file.label.clone() });
        }
        let status = resp.status().as_u16();
        if is_transient(status) {
            return Err(PullError::Http { url: at, why: format!("HTTP {status}") });
        }
        check_status(status, &at, &self.file.label, self.token)?;
        let whole = status == 200 && start == 0 && to == self.file.size;
        if status != 206 && !whole {
            return Err(PullError::Broken { url: at, why: format!("answered a range request with HTTP {status}") });
        }
        let content_range = resp.headers().get("content-range").and_then(|v| v.to_str().ok()).unwrap_or("");
        if status == 206 && !content_range.starts_with(&format!("bytes {start}-")) {
            return Err(PullError::Broken {
                url: at,
                why: format!("sent {content_range:?} for bytes {start}-{}", to - 1),
            });
        }
        let mut body = resp.body_mut().as_reader();
        let mut buf = vec![0u8; BUF];
        while from + *got < to {
            let want = ((to - from - *got) as usize).min(BUF);
            let n = body.read(&mut buf[..want]).map_err(|e| PullError::Http { url: at.clone(), why: e.to_string() })?;
            if n == 0 {
                return Err(PullError::Http {
                    url: at,
                    why: format!("the connection ended after {} of {} bytes", from + *got - start, to - start),
                });
            }
            self.partial.write_all_at(&buf[..n], from + *got).map_err(io_err(&self.partial_path))?;
            *got += n as u64;
            self.progress.advance(&self.file.label, n as u64);
        }
        Ok(())
    }

    /// Waits until range `c` is fetched (or the file failed).
    fn wait_done(&self, c: usize) -> Result<(), PullError> {
        let mut s = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(e) = s.error.take() {
                s.error = Some(PullError::Stopped);
                self.wake.notify_all();
                return Err(e);
            }
            if s.state.done[c] {
                return Ok(());
            }
            s = self.wake.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The hasher's side: the file's digest and sums, in order, from the ranges as they land.
struct Hasher {
    sha: Sha256State,
    shard: Option<ShardHasher>,
}

impl Hasher {
    /// Opens the header of the partial file (its first ranges must be there) for the sidecar's
    /// sums (making the sidecar's builder from it when this is the model's first file), and
    /// takes up the saved state, or starts again from the first byte when the saved state has no
    /// sums where they are wanted.
    fn start(&mut self, job: &Job, saved: &PartState, sums: Option<&mut Option<SumsBuilder>>) -> Result<(), PullError> {
        self.sha = saved.hash.clone();
        let Some(slot) = sums else { return Ok(()) };
        let head = job.file.size.min(HEAD_BYTES).div_ceil(job.settings.chunk).max(1) as usize;
        for c in 0..head.min(saved.done.len()) {
            job.wait_done(c)?;
        }
        if slot.is_none() {
            *slot = super::first_header(&job.partial_path, job.progress);
        }
        let Some(builder) = slot.as_ref() else { return Ok(()) };
        match ggml_sys::GgufFile::open(&job.partial_path) {
            Ok(g) => {
                let mut shard = builder.next_shard(&g, job.file.size);
                let resumed =
                    saved.sums.as_ref().is_some_and(|cp| shard.resume(cp) && shard.position() == self.sha.len());
                if !resumed {
                    shard = builder.next_shard(&g, job.file.size);
                    self.sha = Sha256State::default();
                }
                self.shard = Some(shard);
            }
            Err(e) => {
                job.progress.note(&format!("{}: no checksum sidecar: its header does not read ({e})", job.file.label))
            }
        }
        Ok(())
    }

    /// Where the next save is possible: the end of the sum being computed.
    fn next_cut(&self) -> u64 {
        self.shard.as_ref().map_or(self.sha.len(), ShardHasher::next_cut)
    }

    fn update(&mut self, data: &[u8]) {
        self.sha.update(data);
        if let Some(s) = self.shard.as_mut() {
            s.update(data);
        }
    }

    fn checkpoint(&self) -> Option<Option<ShardCheckpoint>> {
        match &self.shard {
            None => Some(None),
            Some(s) => s.checkpoint().map(Some),
        }
    }
}

/// Hashes the file in order as its ranges land, saving the hasher's state now and then.
fn hash(job: &Job, hasher: &mut Hasher) -> Result<(), PullError> {
    let size = job.file.size;
    let mut buf = vec![0u8; BUF];
    let mut since_save = 0u64;
    let mut pos = hasher.sha.len();
    while pos < size {
        let c = (pos / job.settings.chunk) as usize;
        job.wait_done(c)?;
        let (from, to) = job.range(c);
        while pos < to {
            let mut end = (pos + BUF as u64).min(to);
            let due = since_save >= CHECKPOINT_BYTES;
            let cut = hasher.next_cut();
            if due && cut > pos && cut < end {
                end = cut;
            }
            let piece = &mut buf[..(end - pos) as usize];
            job.partial.read_exact_at(piece, pos).map_err(io_err(&job.partial_path))?;
            hasher.update(piece);
            since_save += end - pos;
            pos = end;
            if let Some(sums) = hasher.checkpoint().filter(|_| due) {
                let mut s = job.shared.lock().unwrap_or_else(|p| p.into_inner());
                (s.state.hash, s.state.sums) = (hasher.sha.clone(), sums);
                job.save(&s.state)?;
                since_save = 0;
            }
        }
        let _ = sluice_hal::storage::drop_cached_range(&job.partial, from, to - from);
        let mut s = job.shared.lock().unwrap_or_else(|p| p.into_inner());
        s.hashed = c + 1;
        job.wake.notify_all();
    }
    Ok(())
}

/// Fetches `file` into its partial file and checks it; moves it to its place when its digest
/// is right and returns its sidecar sums when `sums` is given (the builder, or `None` to make
/// one from this file, the model's first) and its header reads. A wrong digest deletes the
/// partial file.
pub fn fetch(
    http: &Http,
    token: Option<&Token>,
    file: &PlannedFile,
    settings: &FetchSettings,
    progress: &dyn Progress,
    sums: Option<&mut Option<SumsBuilder>>,
) -> Result<Option<FinishedShard>, PullError> {
    if file.size == 0 {
        return fetch_empty(file).map(|()| None);
    }
    let (partial, state) = open_partial(file, settings.chunk)?;
    let (partial_path, state_path) = partial_paths(&file.dest);
    let have: u64 = (0..state.done.len())
        .filter(|&c| state.done[c])
        .map(|c| range_of(c, settings.chunk, file.size))
        .map(|(from, to)| to - from)
        .sum();
    progress.file_start(&file.label, file.size, have);
    let window = (2 * settings.connections).max(HEAD_BYTES.div_ceil(settings.chunk) as usize + settings.connections);
    let taken = vec![false; state.done.len()];
    let saved = state.clone();
    let job = Job {
        http,
        token,
        file,
        settings,
        progress,
        partial,
        partial_path: partial_path.clone(),
        state_path: state_path.clone(),
        shared: Mutex::new(Shared { state, taken, hashed: 0, error: None }),
        wake: Condvar::new(),
        window,
    };
    let mut hasher = Hasher { sha: Sha256State::default(), shard: None };
    let hashed = std::thread::scope(|scope| {
        for _ in 0..settings.connections.max(1) {
            scope.spawn(|| job.fetcher());
        }
        let r = hasher.start(&job, &saved, sums).and_then(|()| hash(&job, &mut hasher));
        if r.is_err() {
            job.fail(PullError::Stopped);
        }
        r
    });
    hashed?;
    let got = hasher.sha.finish_hex();
    if got != file.sha256 {
        let _ = fs::remove_file(&partial_path);
        let _ = fs::remove_file(&state_path);
        return Err(PullError::Digest { file: file.label.clone(), expected: file.sha256.clone(), got });
    }
    job.partial.sync_all().map_err(io_err(&partial_path))?;
    fs::rename(&partial_path, &file.dest).map_err(io_err(&file.dest))?;
    let _ = fs::remove_file(&state_path);
    if let Some(dir) = file.dest.parent() {
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    progress.file_done(&file.label);
    Ok(hasher.shard.and_then(ShardHasher::finish))
}

/// A file of no bytes: nothing to fetch, its digest checked all the same.
fn fetch_empty(file: &PlannedFile) -> Result<(), PullError> {
    let got = Sha256State::default().finish_hex();
    if got != file.sha256 {
        return Err(PullError::Digest { file: file.label.clone(), expected: file.sha256.clone(), got });
    }
    if let Some(dir) = file.dest.parent() {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    File::create(&file.dest).map(drop).map_err(io_err(&file.dest))
}

/// Sums of a file already in place (another tool pulled it, or a pull stopped after it): read
/// once from storage.
pub fn sums_of_stored(path: &Path, builder: &SumsBuilder) -> Result<Option<FinishedShard>, PullError> {
    let f = File::open(path).map_err(io_err(path))?;
    let size = f.metadata().map_err(io_err(path))?.len();
    let Ok(g) = ggml_sys::GgufFile::open(path) else { return Ok(None) };
    let mut shard = builder.next_shard(&g, size);
    let mut buf = vec![0u8; BUF];
    let mut pos = 0;
    while pos < size {
        let n = ((size - pos) as usize).min(BUF);
        f.read_exact_at(&mut buf[..n], pos).map_err(io_err(path))?;
        shard.update(&buf[..n]);
        pos += n as u64;
    }
    let _ = sluice_hal::storage::drop_cached_range(&f, 0, size);
    Ok(shard.finish())
}
