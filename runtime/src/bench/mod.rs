//! `sluice bench`: the same model and prompt run resident (llama.cpp's own mmap load) and
//! streamed, back to back, each starting with the model dropped from the page cache. Only ratios
//! within one run are meaningful: storage speed drifts between runs.
//!
//! Two modes: in one process at several expert-cache sizes ([`run`]), or each configuration in
//! its own child process inside a memory cgroup of a small board's size ([`isolated`]).

pub mod boards;
mod chart;
pub mod competing;
pub mod conversation;
pub mod isolated;
mod kinds;
pub(crate) mod report;
pub mod storage;
pub mod throttle;

pub use chart::svg_bar_chart;
pub use report::{conversation_csv, conversation_table, csv, table};

use std::path::{Path, PathBuf};

use sluice_hal::usage::{PhaseMeter, Usage};

use crate::board::ResolvedBoard;
use crate::budget::Batch;
use crate::generate::{self, GenerateError, GenerateParams, Session};
use crate::launch::{Cache, Launch, LaunchError, Loaded, Positions};
use crate::stream::{DensePolicy, ExpertIndex, TokenRow};
use crate::telemetry::Summary;
use crate::units::mib;

/// What can stop a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A streamed row could not start or run (index, split, load, plan, session).
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The resident row could not load or generate.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// No memory cgroup could be made.
    #[error("{0}; `sluice bench --budget-mb` runs each configuration in a memory cgroup and needs root")]
    Cgroup(#[from] sluice_hal::cgroup::CgroupError),
    /// A file operation failed.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// The route trace could not be written or read.
    #[error(transparent)]
    Trace(#[from] crate::stream::TraceError),
    /// The recorded routes do not fit the model, or are too short.
    #[error(transparent)]
    Routes(#[from] crate::stream::RoutesError),
    /// A child configuration failed.
    #[error("the {kind} run failed ({status}): {stderr}")]
    Child {
        /// Which configuration.
        kind: String,
        /// Its exit status.
        status: String,
        /// What it said.
        stderr: String,
    },
}

/// One configuration's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BenchRow {
    /// What ran (`resident-mmap`, `streamed cache 25%`, ...).
    pub label: String,
    /// Expert cache budget in bytes (streamed rows).
    pub cache_bytes: Option<u64>,
    /// Decode tokens per second.
    pub tokens_per_s: f64,
    /// Bytes read from storage per generated token (the engine's count when streaming, the
    /// kernel's `read_bytes` when resident).
    pub mib_per_token: f64,
    /// Cache hit rate (streamed rows).
    pub hit_rate: Option<f64>,
    /// Major page faults during decoding.
    pub major_faults: u64,
    /// Peak RSS, bytes: the highest seen after a decode in one-process runs, the process's
    /// `VmHWM` in isolated runs.
    pub peak_rss: u64,
    /// Expert read throughput while the decode waited for it (streamed rows), MiB/s.
    pub read_mib_s: Option<f64>,
    /// The decode's wait for storage per token, ms (streamed rows): serial layers' I/O wait plus
    /// overlapped layers' stall (compute threads blocked on experts not yet read).
    pub stall_ms: Option<f64>,
    /// The memory cgroup's peak usage, page cache included (isolated runs), bytes.
    pub cgroup_peak: Option<u64>,
    /// Times the cgroup's usage hit its limit (isolated runs).
    pub limit_hits: Option<u64>,
    /// Time to open the model (load, and for streaming the capture and dense read), seconds.
    pub open_s: f64,
    /// Bytes read from storage while opening (the kernel's `read_bytes` for this process).
    pub open_read: u64,
    /// Time to first token: open plus prompt, seconds.
    pub ttft_s: f64,
    /// Bytes read from storage while the prompt was processed (the engine's expert reads when
    /// streaming, the kernel's `read_bytes` when resident).
    pub prefill_read: u64,
    /// Drafting: the share of drafted tokens the model agreed with.
    pub draft_accept: Option<f64>,
    /// A lossy row's quality against exact decoding of the same prompt (`None`: exact row).
    pub lossy_quality: Option<crate::lossy::Agreement>,
    /// The generated tokens (to check every configuration agrees).
    pub tokens: Vec<ggml_sys::Token>,
}

impl BenchRow {
    /// Whether the row ran a lossy mode (its label says LOSSY, [`crate::lossy::Lossy::row_label`]):
    /// its text may differ from the resident run's.
    pub fn is_lossy(&self) -> bool {
        self.label.contains("LOSSY")
    }

    /// The row of a streamed generation `g` and the decodes it made, its time to first token the
    /// prompt's; what the caller knows beyond them (cache, stall, open, drafting) left empty.
    pub(crate) fn of_generation(label: String, g: &generate::Generation, rows: &[TokenRow]) -> BenchRow {
        let s = Summary::of_generation(rows, g);
        BenchRow {
            label,
            cache_bytes: None,
            tokens_per_s: s.tokens_per_s(),
            mib_per_token: s.mib_per_token(),
            hit_rate: Some(s.hit_rate),
            major_faults: s.major_faults,
            peak_rss: s.peak_rss,
            read_mib_s: s.read_mib_per_s(),
            stall_ms: None,
            cgroup_peak: None,
            limit_hits: None,
            open_s: 0.0,
            open_read: 0,
            ttft_s: g.prefill.as_secs_f64(),
            prefill_read: rows.iter().filter(|r| r.prefill).map(|r| r.bytes_read).sum(),
            draft_accept: None,
            lossy_quality: None,
            tokens: g.tokens.clone(),
        }
    }
}

/// The share of `g`'s drafted tokens that were accepted, when it drafted (`draft`).
fn draft_accept(draft: Option<usize>, g: &generate::Generation) -> Option<f64> {
    draft.map(|_| if g.drafted == 0 { 0.0 } else { f64::from(g.accepted) / f64::from(g.drafted) })
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    /// The model's first file.
    pub model: PathBuf,
    /// Prompt.
    pub prompt: String,
    /// Tokens to generate per configuration.
    pub n_predict: u32,
    /// The board every row runs on (threads, lanes, overlap, verify, drafting).
    pub board: ResolvedBoard,
    /// Expert cache sizes as percentages of all expert bytes.
    pub cache_percents: Vec<u32>,
}

impl BenchPlan {
    /// Whether a row with a cache of `cache_bytes` fits the board's budget, for a context of
    /// `positions` (the prompt's tokens, counted by the caller, and `n_predict`); a plan's total
    /// only grows with its cache, so the largest row decides.
    pub fn fits(&self, cache_bytes: u64, positions: u32) -> Result<(), LaunchError> {
        Launch { positions: Positions::Fixed(positions), ..self.launch(cache_bytes) }.plan()?.ledger?;
        Ok(())
    }

    /// The streamed run of this plan's prompt with a fixed cache of `cache_bytes`.
    fn launch(&self, cache_bytes: u64) -> Launch {
        Launch {
            model: self.model.clone(),
            board: self.board.clone(),
            positions: Positions::Prompt { text: self.prompt.clone(), n_predict: self.n_predict, reserve: 0 },
            slots: 1,
            batch: Batch::Fixed(generate::DEFAULT_BATCH),
            cache: Cache::Fixed(cache_bytes),
            force_cache: true,
            dense: DensePolicy::Anon,
            lossy: crate::lossy::Lossy::default(),
            rpc: Vec::new(),
            kept_bytes: 0,
        }
    }
}

/// `base` repeated (space-separated) and cut to `n` tokens of `model`'s tokenizer (its BOS
/// included), or the longest text below that when the tokenizer merges across the cut: a long
/// prompt of a given length, for time to first token where a batch routes most experts.
pub fn prompt_of_tokens(model: &Path, base: &str, n: usize) -> Result<String, GenerateError> {
    if base.trim().is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    crate::metadata::check_model_file(model)?;
    let m = ggml_sys::Model::load(model, &ggml_sys::ModelParams { metadata_only: true, ..Default::default() })?;
    let count = |text: &str| m.tokenize(text, true).map(|t| t.len());
    let mut text = base.to_string();
    while count(&text)? < n {
        text.push(' ');
        text.push_str(base);
    }
    while count(&text)? > n {
        text.pop();
    }
    Ok(text)
}

pub(crate) fn drop_cached(files: &[PathBuf]) {
    for f in files {
        if let Err(e) = sluice_hal::storage::drop_cached(f) {
            log::warn!("cannot drop {} from the page cache ({e}); the next run may start warm", f.display());
        }
    }
}

/// Runs the resident reference: from a cold page cache, or with `warm` from one that holds the
/// whole model (the compute bound).
pub(crate) fn run_resident(
    path: &Path,
    files: &[PathBuf],
    prompt: &str,
    params: &GenerateParams,
    warm: bool,
    forcer: Option<crate::stream::RouteForcer>,
) -> Result<BenchRow, GenerateError> {
    if warm {
        for f in files {
            if let Err(e) = std::fs::File::open(f).and_then(|mut r| std::io::copy(&mut r, &mut std::io::sink())) {
                log::warn!("cannot read {} into the page cache ({e}); the compute row may fault", f.display());
            }
        }
    } else {
        drop_cached(files);
    }
    let meter = PhaseMeter::start();
    let model = generate::load_model(path)?;
    let (open_wall, open_read) = meter.finish();
    let (open_s, open_read) = (open_wall.as_secs_f64(), open_read.unwrap_or(0));
    let tokens = Session::prepare(&model, prompt, params.n_predict)?;
    let mut session = Session::new(
        &model,
        generate::ContextShape::one((tokens.len() + params.n_predict as usize) as u32),
        &params.threads,
        forcer.clone().map(crate::stream::RouteForcer::resident_callback),
    )?;
    session.set_ignore_eog(forcer.is_some());
    session.set_draft(params.draft)?;
    let mut peak_rss = 0u64;
    let mut faults = 0u64;
    let mut read = 0u64;
    let mut prefill_read = 0u64;
    let mut before = Usage::sample();
    let mut read_before = sluice_hal::storage::process_read_bytes().unwrap_or(0);
    let mut observer = |e: generate::DecodeEvent| -> Result<(), GenerateError> {
        let now = Usage::sample();
        let read_now = sluice_hal::storage::process_read_bytes().unwrap_or(0);
        if e.prefill {
            prefill_read += read_now.saturating_sub(read_before);
        } else {
            faults += now.major_faults.saturating_sub(before.major_faults);
            read += read_now.saturating_sub(read_before);
        }
        peak_rss = peak_rss.max(now.rss());
        before = now;
        read_before = read_now;
        Ok(())
    };
    let g = session.generate(&tokens, params.n_predict, |_, _| {}, &mut observer)?;
    Ok(BenchRow {
        label: match (warm, params.draft.is_some()) {
            (true, _) => "resident, all in RAM (compute)".into(),
            (false, true) => "resident-mmap, ngram draft".into(),
            (false, false) => "resident-mmap".into(),
        },
        cache_bytes: None,
        tokens_per_s: g.decode_tokens_per_s(),
        mib_per_token: if g.decoded == 0 { 0.0 } else { mib(read) / f64::from(g.decoded) },
        hit_rate: None,
        major_faults: faults,
        peak_rss,
        read_mib_s: None,
        stall_ms: None,
        cgroup_peak: None,
        limit_hits: None,
        open_s,
        open_read,
        ttft_s: open_s + g.prefill.as_secs_f64(),
        prefill_read,
        draft_accept: draft_accept(params.draft, &g),
        lossy_quality: None,
        tokens: g.tokens,
    })
}

/// Runs one streamed configuration: `launch` from a cold page cache (its `files` dropped), its
/// prompt's `n_predict` tokens, labelled by `label` once loaded; with `trace`, every layer's
/// routes are recorded and written there.
pub(crate) fn run_streamed(
    launch: &Launch,
    files: &[PathBuf],
    n_predict: u32,
    label: impl FnOnce(&Loaded) -> String,
    trace: Option<&Path>,
    routes: Option<&crate::stream::routes::ForcedRoutes>,
) -> Result<BenchRow, BenchError> {
    drop_cached(files);
    let mut loaded = launch.load(&mut |_| {})?;
    if let Some(routes) = routes {
        routes.apply(&mut loaded.config, &loaded.index, loaded.prompt.len(), n_predict)?;
    }
    let (mut session, open) = loaded.open()?;
    let open_s = open.wall.as_secs_f64();
    if trace.is_some() {
        session.streamer().start_trace();
    }
    let (g, rows) = session.generate(&loaded.prompt, n_predict, |_, _| {}, |_| {}).map_err(LaunchError::from)?;
    if let Some(path) = trace {
        let name = launch.model.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        session.streamer().route_trace(name).save(path)?;
    }
    let stall_ms = Some(Summary::of_generation(&rows, &g).waited_ms_per_token());
    let row = BenchRow::of_generation(label(&loaded), &g, &rows);
    Ok(BenchRow {
        cache_bytes: Some(loaded.config.cache_bytes),
        stall_ms,
        open_s,
        open_read: open.read.unwrap_or(0),
        ttft_s: open_s + row.ttft_s,
        draft_accept: draft_accept(launch.board.draft_max(), &g),
        ..row
    })
}

/// What `launch`'s lossy modes cost in quality on its prompt: an exact streamed run generates
/// `n_predict` tokens greedily (keeping each step's logits), then a run with the lossy modes is
/// fed the same tokens, and its next-token distributions are compared step by step.
pub(crate) fn lossy_quality(launch: &Launch, n_predict: u32) -> Result<crate::lossy::Agreement, LaunchError> {
    let exact = Launch { lossy: crate::lossy::Lossy::default(), ..launch.clone() };
    let (prompt, tokens, logits) = {
        let loaded = exact.load(&mut |_| {})?;
        let (mut session, _) = loaded.open()?;
        let mut sampler = generate::Sampler::greedy(&loaded.model)?;
        let mut logits = Vec::new();
        let keep = |c: &generate::Chosen<'_>| {
            logits.push(c.logits.to_vec());
            std::ops::ControlFlow::Continue(())
        };
        let (g, _) =
            session.generate_with(generate::SlotUse::FRESH, &loaded.prompt, n_predict, &mut sampler, keep, |_| {})?;
        (loaded.prompt.clone(), g.tokens, logits)
    };
    let loaded = launch.load(&mut |_| {})?;
    let (mut session, _) = loaded.open()?;
    let mut meter = crate::lossy::AgreementMeter::default();
    session.score_continuation(&prompt, &tokens, |i, l| {
        if let Some(exact) = logits.get(i) {
            meter.add(exact, l);
        }
    })?;
    Ok(meter.finish())
}

/// Runs every configuration of `plan`, the resident reference first.
pub fn run(plan: &BenchPlan) -> Result<Vec<BenchRow>, BenchError> {
    let index = ExpertIndex::open(&plan.model).map_err(LaunchError::from)?;
    let params = GenerateParams {
        n_predict: plan.n_predict,
        threads: plan.board.threads(),
        draft: plan.board.draft_max(),
        batch: generate::DEFAULT_BATCH,
        kv: plan.board.kv,
    };
    let mut rows = vec![run_resident(&plan.model, &index.shards, &plan.prompt, &params, false, None)?];
    let all = index.all_expert_window_bytes();
    for &pct in &plan.cache_percents {
        let label = format!(
            "streamed cache {pct}%{}{}",
            if params.draft.is_some() { ", ngram draft" } else { "" },
            if plan.board.verify { ", verified" } else { "" }
        );
        let launch = plan.launch(all * u64::from(pct) / 100);
        rows.push(run_streamed(&launch, &index.shards, plan.n_predict, |_| label, None, None)?);
    }
    Ok(rows)
}
