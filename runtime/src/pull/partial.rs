//! A file being fetched: its partial file (allocated whole before the first byte) and the
//! state saved beside it, which says which ranges are on storage and how far the digest went,
//! so that a pull stopped at any point takes up where it was.

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::sha256::Sha256State;
use super::{PlannedFile, PullError};
use crate::stream::checksums::streaming::ShardCheckpoint;

pub(super) const STATE_MAGIC: &[u8; 8] = b"SLUICEPL";
const STATE_VERSION: u32 = 1;
/// What is saved beside the partial file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct PartState {
    pub(super) version: u32,
    /// The file's name in the pull (a repository's file name, a blob's digest).
    pub(super) label: String,
    pub(super) sha256: String,
    pub(super) size: u64,
    pub(super) chunk: u64,
    /// Ranges synced to storage.
    pub(super) done: Vec<bool>,
    /// The digest of the first `hash.len()` bytes.
    pub(super) hash: Sha256State,
    /// The sidecar's sums at the same point (GGUF files whose sums are computed).
    pub(super) sums: Option<ShardCheckpoint>,
}

/// The partial file and its state file of `dest`.
pub fn partial_paths(dest: &Path) -> (PathBuf, PathBuf) {
    let with = |s: &str| {
        let mut p = dest.as_os_str().to_owned();
        p.push(s);
        PathBuf::from(p)
    };
    (with(".sluice-partial"), with(".sluice-state"))
}

/// The file name a state file was saved for (`None` when it is not a pull's state file).
pub fn state_label(state: &Path) -> Option<String> {
    crate::framed::load::<PartState>(state, STATE_MAGIC, 64 << 20).ok().map(|s| s.label)
}

/// Bytes of `dest`'s partial file already on storage (allocated), for the free-space check.
pub fn allocated(dest: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata(partial_paths(dest).0).map(|m| m.blocks() * 512).unwrap_or(0)
}

pub(super) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> PullError + '_ {
    move |source| PullError::Io { path: path.to_path_buf(), source }
}

/// The state saved for `dest`'s partial file when it is for the same bytes, else a new one (and
/// a new, fully allocated partial file).
pub(super) fn open_partial(file: &PlannedFile, chunk: u64) -> Result<(File, PartState), PullError> {
    let (partial, state_path) = partial_paths(&file.dest);
    let chunks = file.size.div_ceil(chunk).max(1) as usize;
    let saved: Option<PartState> = crate::framed::load(&state_path, STATE_MAGIC, 64 << 20).ok();
    let len = fs::metadata(&partial).map(|m| m.len()).ok();
    if let Some(s) = saved.filter(|s| {
        s.version == STATE_VERSION
            && s.sha256 == file.sha256
            && s.size == file.size
            && s.chunk == chunk
            && s.done.len() == chunks
            && s.hash.is_consistent()
            && len == Some(file.size)
    }) {
        let f = OpenOptions::new().read(true).write(true).open(&partial).map_err(io_err(&partial))?;
        return Ok((f, s));
    }
    let _ = fs::remove_file(&state_path);
    if let Some(dir) = partial.parent() {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&partial)
        .map_err(io_err(&partial))?;
    if file.size > 0 {
        nix::fcntl::posix_fallocate(&f, 0, file.size as i64).map_err(|e| PullError::Io {
            path: partial.clone(),
            source: std::io::Error::from_raw_os_error(e as i32),
        })?;
    }
    let state = PartState {
        version: STATE_VERSION,
        label: file.label.clone(),
        sha256: file.sha256.clone(),
        size: file.size,
        chunk,
        done: vec![false; chunks],
        hash: Sha256State::default(),
        sums: None,
    };
    Ok((f, state))
}
