//! The benchmark under a small board's memory: each configuration runs in its own child process
//! inside a fresh memory cgroup of the budget's size (page cache is charged to it), so llama.cpp's
//! mmap load competes for the same RAM the streamer plans within. The children also measure the
//! storage ceiling on the same file. The parent collects one JSON result line from each, with the
//! cgroup's peak usage and how often it hit its limit.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use sluice_hal::cgroup::{MemoryCgroup, ReadThrottle};

use super::boards::LoopbackWorker;
pub use super::kinds::{kinds, ChildKind};
use super::storage::{ceiling, read_sweep, Ceiling, SweepPoint};
use super::{conversation, run_resident, run_streamed, BenchError, BenchRow};
use crate::board::resolve::Sourced;
use crate::board::{ComputeService, Draft, Overlap, ResolvedBoard};
use crate::budget::Batch;
use crate::generate::{GenerateParams, Reuse, NGRAM_DRAFT_MAX};
use crate::launch::{Cache, Launch, LaunchError, Loaded, Positions};
use crate::lossy::Lossy;
use crate::stream::routes::ForcedRoutes;
use crate::stream::{DensePolicy, ExpertIndex};
use sluice_hal::usage::Usage;

/// What a child reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ChildOutput {
    /// A decode configuration's row.
    Row(Box<BenchRow>),
    /// The storage ceiling.
    Ceiling(Ceiling),
    /// The read sweep.
    Sweep(Vec<SweepPoint>),
    /// Conversation rows (the chat's turns, or clients at once).
    Conversation(Vec<BenchRow>),
}

/// Child side: runs `kind` on `model` (the process has joined its cgroup, and `board` was
/// resolved after that, so its budget is the cgroup's limit); a lossy kind takes its mode's
/// setting from `lossy` and also measures its quality against exact decoding; the several-board
/// kind splits the model over the workers `rpc` lists; the clients kind runs `count` clients; a
/// streamed kind given `trace` writes its route trace there.
#[allow(clippy::too_many_arguments)]
pub fn run_child(
    kind: ChildKind,
    count: u32,
    model: &Path,
    prompt: &str,
    n_predict: u32,
    board: &ResolvedBoard,
    lossy: &Lossy,
    rpc: &[String],
    trace: Option<&Path>,
    routes: Option<&ForcedRoutes>,
    ctx: Option<u32>,
) -> Result<ChildOutput, BenchError> {
    let index = ExpertIndex::open(model).map_err(LaunchError::from)?;
    let positions = Positions::Prompt { text: prompt.to_string(), n_predict, reserve: ctx.unwrap_or(0) };
    let forcer = || routes.map(|r| r.forcer(&index, index.n_expert_used)).transpose();
    let batch = crate::generate::DEFAULT_BATCH;
    let params = GenerateParams { n_predict, threads: board.threads(), draft: None, batch, kv: board.kv };
    let mut row = match kind {
        ChildKind::Ceiling => return Ok(ChildOutput::Ceiling(ceiling(model, &index, board)?)),
        ChildKind::ReadSweep => return Ok(ChildOutput::Sweep(read_sweep(model, &index)?)),
        ChildKind::ChatFresh | ChildKind::ChatKept | ChildKind::ChatAny | ChildKind::Clients => {
            let launch = StreamedRow::of(ChildKind::StreamedAuto, lossy).launch(model, &positions, board, rpc);
            let rows = match kind {
                ChildKind::Clients => vec![conversation::clients(&launch, n_predict, count)?],
                ChildKind::ChatKept => conversation::chat(&launch, n_predict, Some(Reuse::Exact))?,
                ChildKind::ChatAny => conversation::chat(&launch, n_predict, Some(Reuse::Any))?,
                _ => conversation::chat(&launch, n_predict, None)?,
            };
            return Ok(ChildOutput::Conversation(rows));
        }
        ChildKind::Resident => run_resident(model, &index.shards, prompt, &params, false, forcer()?)?,
        ChildKind::Compute if fits_in_memory(&index.shards) => {
            run_resident(model, &index.shards, prompt, &params, true, forcer()?)?
        }
        // A model the page cache cannot hold (gpt-oss-120b in a small machine): an mmap load would
        // measure the disk. The same tokens' work on the fewest experts, streamed with the cache
        // holding them all after the prompt, measures the computation with no read.
        ChildKind::Compute => {
            let folded = match routes {
                Some(r) => r.folded(),
                None => ForcedRoutes::fixed(&index, index.n_expert_used, model),
            };
            let launch = StreamedRow::of(ChildKind::StreamedAuto, lossy).launch(model, &positions, board, rpc);
            run_streamed(&launch, &index.shards, n_predict, |_| "compute".into(), None, Some(&folded))?
        }
        ChildKind::ResidentDraft => {
            let params = GenerateParams { draft: Some(NGRAM_DRAFT_MAX), ..params };
            run_resident(model, &index.shards, prompt, &params, false, None)?
        }
        _ => {
            let row = StreamedRow::of(kind, lossy);
            if kind == ChildKind::StreamedAutoBoards && rpc.is_empty() {
                return Err(BenchError::Child {
                    kind: format!("{kind:?}"),
                    status: "no workers".into(),
                    stderr: "give --rpc".into(),
                });
            }
            let launch = row.launch(model, &positions, board, rpc);
            let mut out = run_streamed(&launch, &index.shards, n_predict, |loaded| row.label(loaded), trace, routes)?;
            if !row.lossy.is_exact() && routes.is_none() {
                out.lossy_quality = Some(super::lossy_quality(&launch, n_predict)?);
            }
            out
        }
    };
    row.peak_rss = Usage::sample().rss_peak;
    Ok(ChildOutput::Row(Box::new(row)))
}

/// Whether the model's `files` fit in the memory available now, with a tenth to spare: whether
/// the compute row can hold them in the page cache.
fn fits_in_memory(files: &[PathBuf]) -> bool {
    let bytes: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    let probe = sluice_hal::memory::MemoryProbe::probe(&sluice_hal::root::SysRoot::default());
    probe.available.is_none_or(|a| bytes.saturating_add(bytes / 10) <= a)
}

/// How a streamed kind runs.
#[derive(Debug, Clone, Copy)]
struct StreamedRow {
    kind: ChildKind,
    /// The automatic cache (else none).
    auto: bool,
    overlap: Overlap,
    draft: bool,
    verify: bool,
    lossy: Lossy,
}

impl StreamedRow {
    /// The settings of streamed `kind`; a lossy kind takes its mode's setting from `lossy`.
    fn of(kind: ChildKind, lossy: &Lossy) -> StreamedRow {
        use ChildKind::*;
        let verify = matches!(kind, StreamedNoCacheVerified | StreamedNoCacheOverlapVerified);
        StreamedRow {
            kind,
            auto: !verify && !matches!(kind, StreamedNoCache | StreamedNoCacheOverlap),
            overlap: match kind {
                StreamedAutoOverlapPrompt => Overlap::Prompt,
                StreamedAutoOverlapAuto => Overlap::Auto,
                StreamedNoCacheOverlap | StreamedNoCacheOverlapVerified | StreamedAutoOverlap => Overlap::On,
                _ => Overlap::Off,
            },
            draft: kind == StreamedAutoDraft,
            verify,
            lossy: match kind {
                StreamedAutoFewerExperts => Lossy { experts_used: lossy.experts_used, substitute: None },
                StreamedAutoSubstitute => Lossy { experts_used: None, substitute: lossy.substitute },
                _ => Lossy::default(),
            },
        }
    }

    /// The run: `board` with this row's overlap, drafting and verification, on the CPU service
    /// with dense weights in anonymous memory; split over `rpc` for the several-board kind.
    fn launch(&self, model: &Path, positions: &Positions, board: &ResolvedBoard, rpc: &[String]) -> Launch {
        let source = format!("bench row {:?}", self.kind);
        let mut board = board.clone();
        board.overlap = Sourced { value: self.overlap, source: source.clone() };
        board.draft = Sourced { value: if self.draft { Draft::Ngram } else { Draft::Off }, source };
        board.verify = self.verify;
        board.compute = ComputeService::Cpu;
        Launch {
            model: model.to_path_buf(),
            board,
            positions: positions.clone(),
            slots: 1,
            batch: Batch::Fixed(crate::generate::DEFAULT_BATCH),
            cache: if self.auto { Cache::Auto } else { Cache::Fixed(0) },
            force_cache: false,
            dense: DensePolicy::Anon,
            lossy: self.lossy,
            rpc: if self.kind == ChildKind::StreamedAutoBoards { rpc.to_vec() } else { Vec::new() },
            kept_bytes: 0,
        }
    }

    /// The row's label (the boards counted from the split `loaded` made).
    fn label(&self, loaded: &Loaded) -> String {
        format!(
            "streamed, {}, {}{}{}{}{}",
            if self.auto { "auto cache" } else { "no cache" },
            match self.overlap {
                Overlap::Prompt => "overlapped prompt",
                Overlap::Auto => "auto overlap",
                Overlap::On => "overlap",
                Overlap::Off => "serial",
            },
            if self.draft { ", ngram draft" } else { "" },
            if self.verify { ", verified" } else { "" },
            self.lossy.row_label(loaded.index.n_expert_used),
            match &loaded.split {
                Some(split) => format!(", {} boards", split.shares.len() + 1),
                None => String::new(),
            }
        )
    }
}

/// How the parent starts children.
#[derive(Debug, Clone)]
pub struct IsolatedPlan {
    /// The `sluice` binary.
    pub exe: PathBuf,
    /// Arguments before the subcommand (`--board ...`).
    pub global_args: Vec<OsString>,
    /// Arguments after `bench-child` that every child gets (model, prompt, tokens, tuning).
    pub child_args: Vec<OsString>,
    /// The cgroup's memory limit, bytes.
    pub budget: u64,
    /// A read-rate limit on the model's disk for every child.
    pub throttle: Option<DiskThrottle>,
    /// Whether to add the n-gram drafting rows.
    pub draft: bool,
    /// Whether to add the rows that check every read against the checksum sidecar.
    pub verify: bool,
    /// The lossy modes to add a row for (each measured alone).
    pub lossy: Lossy,
    /// Whether to measure the read sweep.
    pub sweep: bool,
    /// Board counts of the several-board rows (loopback RPC workers, each in a cgroup of the
    /// budget); empty: none.
    pub boards: Vec<u32>,
    /// Whether to add the conversation rows (chat turns, clients at once).
    pub conversations: bool,
    /// Where the serial automatic-cache row writes its route trace (`None`: no trace).
    pub trace: Option<PathBuf>,
    /// Threads kept busy beside every configuration (other services on the board).
    pub competing: u32,
    /// Run only the default row (the automatic cache, overlap auto) beside the compute row and
    /// the ceiling.
    pub default_only: bool,
}

/// A read-rate limit on one disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskThrottle {
    /// The whole disk, `major:minor`.
    pub disk: (u64, u64),
    /// Bytes per second.
    pub bytes_per_s: u64,
}

/// Everything an isolated benchmark measured.
#[derive(Debug, Clone)]
pub struct IsolatedReport {
    /// The decode configurations, mmap-resident first.
    pub rows: Vec<BenchRow>,
    /// The storage ceiling.
    pub ceiling: Ceiling,
    /// The read sweep (empty unless asked for).
    pub sweep: Vec<SweepPoint>,
    /// The conversation rows (empty unless asked for).
    pub conversations: Vec<BenchRow>,
    /// The compute bound: tokens per second decoded with every weight in RAM.
    pub compute_tok_s: f64,
}

/// The command that runs `kind` (with its `count`) in a child that joins the cgroups `joins`,
/// split over the workers `rpc` lists.
fn child_command(plan: &IsolatedPlan, kind: ChildKind, count: u32, joins: &[PathBuf], rpc: &[String]) -> Command {
    let mut c = Command::new(&plan.exe);
    c.args(&plan.global_args)
        .arg("bench-child")
        .args(joins.iter().flat_map(|d| [OsString::from("--join-cgroup"), d.clone().into_os_string()]))
        .arg("--kind")
        .arg(
            clap::ValueEnum::to_possible_value(&kind).map_or_else(|| format!("{kind:?}"), |v| v.get_name().to_string()),
        )
        .args(&plan.child_args)
        .args(["--count", &count.to_string()])
        .args(if rpc.is_empty() { Vec::new() } else { vec!["--rpc".to_string(), rpc.join(",")] })
        .args(
            plan.trace
                .iter()
                .filter(|_| kind == ChildKind::StreamedAuto)
                .flat_map(|t| [OsString::from("--trace"), t.into()]),
        );
    c
}

/// Parent side: runs every kind of [`kinds`] in its own child and cgroup.
pub fn run_isolated(plan: &IsolatedPlan) -> Result<IsolatedReport, BenchError> {
    let (mut rows, mut ceiling, mut sweep, mut conversations) = (Vec::new(), None, Vec::new(), Vec::new());
    let mut compute_tok_s = 0.0;
    let mut kinds = kinds(plan.draft, plan.verify, &plan.lossy, plan.sweep, &plan.boards, plan.conversations);
    if plan.default_only {
        let measured = [ChildKind::Compute, ChildKind::StreamedAutoOverlapAuto, ChildKind::Ceiling];
        kinds.retain(|(k, _)| measured.contains(k));
    }
    let _load = super::competing::CompetingLoad::start(plan.competing)?;
    for (i, &(kind, count)) in kinds.iter().enumerate() {
        let boards = if kind == ChildKind::StreamedAutoBoards { count } else { 1 };
        let workers = (1..boards)
            .map(|w| LoopbackWorker::start(&plan.exe, &plan.global_args, plan.budget, &format!("{i}-worker{w}")))
            .collect::<Result<Vec<_>, _>>()?;
        let rpc: Vec<String> = workers.iter().map(|w| w.endpoint.clone()).collect();
        // The compute row has the machine's memory and storage: its cgroup only measures it.
        let (limit, throttle) = match kind {
            ChildKind::Compute => (u64::MAX >> 2, None),
            _ => (plan.budget, plan.throttle),
        };
        let cg = MemoryCgroup::create(&format!("sluice-bench-{}-{i}", std::process::id()), limit)?;
        let throttle = throttle.map(|t| ReadThrottle::create(&cg, t.disk, t.bytes_per_s)).transpose()?;
        let kind_name = format!("{kind:?}");
        log::info!("bench: {kind_name} in {} ({} MiB)", cg.dir().display(), plan.budget >> 20);
        let mut joins = vec![cg.dir().to_path_buf()];
        joins.extend(throttle.as_ref().map(|t| t.dir().to_path_buf()).filter(|d| d != cg.dir()));
        let out = child_command(plan, kind, count, &joins, &rpc)
            .output()
            .map_err(|e| BenchError::Io(format!("starting {}", plan.exe.display()), e))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(BenchError::Child {
                kind: kind_name,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().into(),
            });
        }
        let line = stdout.lines().last().unwrap_or("");
        let output: ChildOutput = serde_json::from_str(line).map_err(|e| BenchError::Child {
            kind: kind_name.clone(),
            status: format!("unreadable result ({e})"),
            stderr: line.into(),
        })?;
        match output {
            ChildOutput::Ceiling(c) => ceiling = Some(c),
            ChildOutput::Sweep(points) => sweep = points,
            ChildOutput::Conversation(mut turns) => {
                for row in &mut turns {
                    row.cgroup_peak = cg.peak();
                    row.limit_hits = cg.limit_hits();
                }
                conversations.extend(turns);
            }
            ChildOutput::Row(row) if kind == ChildKind::Compute => compute_tok_s = row.tokens_per_s,
            ChildOutput::Row(mut row) => {
                row.cgroup_peak = cg.peak();
                // Every board's limit hits: the head's and the workers'.
                row.limit_hits =
                    std::iter::once(&cg).chain(workers.iter().map(|w| &w.cgroup)).map(MemoryCgroup::limit_hits).sum();
                if !workers.is_empty() {
                    let peaks: Vec<String> = workers
                        .iter()
                        .map(|w| format!("{:.0}", crate::units::mib(w.cgroup.peak().unwrap_or(0))))
                        .collect();
                    row.label.push_str(&format!(" (workers' peak {} MiB)", peaks.join(", ")));
                }
                rows.push(*row);
            }
        }
    }
    let ceiling = ceiling.ok_or_else(|| BenchError::Child {
        kind: "Ceiling".into(),
        status: "no result".into(),
        stderr: String::new(),
    })?;
    Ok(IsolatedReport { rows, ceiling, sweep, conversations, compute_tok_s })
}
