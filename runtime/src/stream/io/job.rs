//! What a read is: the job a lane takes, its checksum, and how it ends (its byte counts or its
//! failure); and the faults tests inject.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use ggml_sys::Reservation;

/// One read: the file window `[start, start + len)` of `shard` into `target`.
#[derive(Clone)]
pub struct ReadJob {
    /// The tensor memory the window lands in.
    pub target: Arc<Reservation>,
    /// Shard file index.
    pub shard: usize,
    /// Page-aligned file offset.
    pub start: u64,
    /// Bytes (a page multiple).
    pub len: usize,
    /// The (layer, expert) the read is for, for error reports.
    pub tag: (u32, u32),
    /// The expert tensor's index in the [`crate::stream::ExpertIndex`] (`usize::MAX` for dense reads):
    /// what [`super::IoLanes::wait_any`] matches on.
    pub tensor: usize,
    /// The expert slice `[from, to)` (tensor bytes) the window carries: pages of the target's
    /// pool are mapped under its own pages before the read ([`Reservation::place`]). `None` for
    /// dense reads.
    pub slice: Option<(u64, u64)>,
    /// A read passing through (waves): its `slice` is given back once the expert is computed.
    /// It holds a share of the batch's window until then.
    pub pass: bool,
    /// A lookahead read (an expert the next layer's router is expected to choose): it may be
    /// dropped ([`super::IoLanes::drop_speculative`]) and never fails its batch; an expert whose
    /// speculative read did not land whole is handed back by [`super::IoLanes::take_lost`].
    pub speculative: bool,
    /// What the landed bytes must hash to (`--verify`): checked by the lane before the read
    /// counts as landed.
    pub check: Option<SliceCheck>,
}

/// The checksum a read's bytes must have ([`crate::stream::checksums`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceCheck {
    /// The tensor bytes `[from, to)` (relative to the tensor) the checksum covers.
    pub from: u64,
    /// End of that range.
    pub to: u64,
    /// Their xxh3-64, as `sluice verify` recorded it.
    pub sum: u64,
}

/// A read that failed. Its cause is part of its message, not a separate source, so that a
/// chain of errors prints it once.
#[derive(Debug, thiserror::Error)]
#[error("reading {what} from {path} at offset {offset}: {cause}")]
pub struct ReadFailure {
    /// What was read: `expert E of layer L`, or `tensor NAME`.
    pub what: String,
    /// File.
    pub path: PathBuf,
    /// Offset of the failed window.
    pub offset: u64,
    /// The error.
    pub cause: io::Error,
}

/// Byte counts of one `read_all`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes read.
    pub bytes: u64,
    /// Of which through `O_DIRECT`.
    pub direct_bytes: u64,
}

/// An injected fault, for tests: what the `at`-th read (counting from 1 across lanes) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadFault {
    /// Which read.
    pub at: u64,
    /// What it does.
    pub kind: FaultKind,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Fails with `EIO`.
    Eio,
    /// Panics in the reader thread.
    Panic,
    /// Never returns (until the lanes shut down): a stuck device.
    Hang,
    /// Lands only after its batch was given up (a bound passed or a cancel) and the engine has
    /// released its tensor's memory (polled with `mincore`, at most 10 s), half a second later:
    /// a read that was already with the device then, writing into memory the engine has
    /// released after the failed decode has returned.
    Late,
}
