//! What the isolated benchmark's children run: the kinds of row, and which of them a run takes.

use serde::{Deserialize, Serialize};

use crate::lossy::Lossy;

/// What one child runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum ChildKind {
    /// llama.cpp's own mmap load, no streaming.
    Resident,
    /// The compute bound: llama.cpp's mmap load with the whole model in RAM (read into the page
    /// cache first; outside the budget's cgroup and unthrottled); for a model the available
    /// memory cannot hold, the same tokens' work on the fewest experts, streamed with all of them
    /// cached (`ForcedRoutes::folded`).
    Compute,
    /// Serial streaming with no expert cache.
    StreamedNoCache,
    /// Overlapped streaming with no expert cache.
    StreamedNoCacheOverlap,
    /// Serial streaming with no expert cache, every read checked against the checksum sidecar.
    StreamedNoCacheVerified,
    /// Overlapped streaming with no expert cache, every read checked.
    StreamedNoCacheOverlapVerified,
    /// Serial streaming with the expert cache the budget leaves.
    StreamedAuto,
    /// Overlapped streaming with the expert cache the budget leaves.
    StreamedAutoOverlap,
    /// The automatic cache, prompt batches overlapped and single-token decodes serial.
    StreamedAutoOverlapPrompt,
    /// The automatic cache, prompt batches overlapped and single-token decodes too while no
    /// other process keeps the cores busy (the default).
    StreamedAutoOverlapAuto,
    /// llama.cpp's own mmap load, drafting n-grams.
    ResidentDraft,
    /// Serial streaming with the automatic cache, drafting n-grams.
    StreamedAutoDraft,
    /// Serial streaming with the automatic cache and fewer experts per token (lossy).
    StreamedAutoFewerExperts,
    /// Serial streaming with the automatic cache and cache-aware substitution (lossy).
    StreamedAutoSubstitute,
    /// Serial streaming with the automatic cache, the model's last layers resident on RPC
    /// workers (`--rpc`).
    StreamedAutoBoards,
    /// A five-turn chat, every turn from an empty slot (the automatic cache, serial).
    ChatFresh,
    /// The same chat in a slot that keeps whole prompt batches, then its sixth turn warm and
    /// after a restart that reads the saved slot back.
    ChatKept,
    /// The kept chat (`chat-kept`) keeping any shared prefix (`--reuse any`, lossy).
    ChatAny,
    /// Clients generating at once (how many: the kind's count).
    Clients,
    /// O_DIRECT reads of the model file at several lane counts and request sizes.
    ReadSweep,
    /// The storage ceiling: O_DIRECT reads of the model file.
    Ceiling,
}

/// The kinds the parent runs, in order, each with its count (the boards it runs on, or the
/// clients): the drafting rows only when the board drafts, the verified rows with `verify`, a
/// lossy row for each lossy mode `lossy` sets, a several-board row for each count in `boards`,
/// with `conversations` the chat rows and 1, 2 and 4 clients. The ceiling comes last: storage
/// behind a cache of its own (a VM's host, a drive's DRAM) is then as warm for it as for the
/// decodes before it, so the streamer's share of it is not flattered.
pub fn kinds(
    draft: bool,
    verify: bool,
    lossy: &Lossy,
    sweep: bool,
    boards: &[u32],
    conversations: bool,
) -> Vec<(ChildKind, u32)> {
    let mut kinds = vec![
        ChildKind::Resident,
        ChildKind::Compute,
        ChildKind::StreamedNoCache,
        ChildKind::StreamedNoCacheOverlap,
        ChildKind::StreamedAuto,
        ChildKind::StreamedAutoOverlap,
        ChildKind::StreamedAutoOverlapPrompt,
        ChildKind::StreamedAutoOverlapAuto,
    ];
    if draft {
        kinds.extend([ChildKind::ResidentDraft, ChildKind::StreamedAutoDraft]);
    }
    if verify {
        kinds.extend([ChildKind::StreamedNoCacheVerified, ChildKind::StreamedNoCacheOverlapVerified]);
    }
    if lossy.experts_used.is_some() {
        kinds.push(ChildKind::StreamedAutoFewerExperts);
    }
    if lossy.substitute.is_some() {
        kinds.push(ChildKind::StreamedAutoSubstitute);
    }
    let mut kinds: Vec<(ChildKind, u32)> = kinds.into_iter().map(|k| (k, 1)).collect();
    kinds.extend(boards.iter().filter(|&&n| n > 1).map(|&n| (ChildKind::StreamedAutoBoards, n)));
    if conversations {
        kinds.extend([(ChildKind::ChatFresh, 1), (ChildKind::ChatKept, 1), (ChildKind::ChatAny, 1)]);
        kinds.extend([1, 2, 4].map(|n| (ChildKind::Clients, n)));
    }
    if sweep {
        kinds.push((ChildKind::ReadSweep, 1));
    }
    kinds.push((ChildKind::Ceiling, 1));
    kinds
}
