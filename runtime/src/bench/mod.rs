//! `sluice bench`: the same model and prompt run resident (llama.cpp's own mmap load) and
//! streamed, back to back, each starting with the model dropped from the page cache. Only ratios
//! within one run are meaningful: storage speed drifts between runs.
//!
//! Two modes: in one process at several expert-cache sizes ([`run`]), or each configuration in
//! its own child process inside a memory cgroup of a small board's size ([`isolated`]).

pub mod boards;
mod chart;
pub mod isolated;
pub mod throttle;

pub use chart::svg_bar_chart;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use sluice_hal::usage::{PhaseMeter, Usage};

use crate::board::ResolvedBoard;
use crate::generate::{self, GenerateError, GenerateParams, Session};
use crate::launch::{Cache, Launch, LaunchError, Loaded, Positions};
use crate::stream::{DensePolicy, ExpertIndex};
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
    /// Overlap: compute threads' stall waiting for experts per token, ms (streamed rows).
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
    /// Whether a row with a cache of `cache_bytes` fits the board's budget (a plan's total
    /// only grows with its cache, so the largest row decides).
    pub fn fits(&self, cache_bytes: u64) -> Result<(), LaunchError> {
        self.launch(cache_bytes).plan()?.ledger?;
        Ok(())
    }

    /// The streamed run of this plan's prompt with a fixed cache of `cache_bytes`.
    fn launch(&self, cache_bytes: u64) -> Launch {
        Launch {
            model: self.model.clone(),
            board: self.board.clone(),
            positions: Positions::Prompt { text: self.prompt.clone(), n_predict: self.n_predict },
            cache: Cache::Fixed(cache_bytes),
            force_cache: true,
            dense: DensePolicy::Anon,
            lossy: crate::lossy::Lossy::default(),
            rpc: Vec::new(),
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

/// Runs the resident reference.
pub(crate) fn run_resident(
    path: &Path,
    files: &[PathBuf],
    prompt: &str,
    params: &GenerateParams,
) -> Result<BenchRow, GenerateError> {
    drop_cached(files);
    let meter = PhaseMeter::start();
    let model = generate::load_model(path)?;
    let (open_wall, open_read) = meter.finish();
    let (open_s, open_read) = (open_wall.as_secs_f64(), open_read.unwrap_or(0));
    let tokens = Session::prepare(&model, prompt, params.n_predict)?;
    let mut session = Session::new(&model, (tokens.len() + params.n_predict as usize) as u32, &params.threads, None)?;
    session.set_draft(params.draft);
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
        peak_rss = peak_rss.max(now.rss_anon + now.rss_file);
        before = now;
        read_before = read_now;
        Ok(())
    };
    let g = session.generate(&tokens, params.n_predict, |_, _| {}, &mut observer)?;
    Ok(BenchRow {
        label: if params.draft.is_some() { "resident-mmap, ngram draft".into() } else { "resident-mmap".into() },
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
/// prompt's `n_predict` tokens, labelled by `label` once loaded.
pub(crate) fn run_streamed(
    launch: &Launch,
    files: &[PathBuf],
    n_predict: u32,
    label: impl FnOnce(&Loaded) -> String,
) -> Result<BenchRow, LaunchError> {
    drop_cached(files);
    let loaded = launch.load(&mut |_| {})?;
    let (mut session, open) = loaded.open()?;
    let open_s = open.wall.as_secs_f64();
    let (g, rows) = session.generate(&loaded.prompt, n_predict, |_, _| {}, |_| {})?;
    let s = Summary::of_generation(&rows, &g);
    Ok(BenchRow {
        label: label(&loaded),
        cache_bytes: Some(loaded.config.cache_bytes),
        tokens_per_s: s.tokens_per_s(),
        mib_per_token: s.mib_per_token(),
        hit_rate: Some(s.hit_rate),
        major_faults: s.major_faults,
        peak_rss: s.peak_rss,
        read_mib_s: s.read_mib_per_s(),
        stall_ms: loaded.config.overlap.map(|_| s.stall_ms_per_token()),
        cgroup_peak: None,
        limit_hits: None,
        open_s,
        open_read: open.read.unwrap_or(0),
        ttft_s: open_s + g.prefill.as_secs_f64(),
        prefill_read: rows.iter().filter(|r| r.prefill).map(|r| r.bytes_read).sum(),
        draft_accept: draft_accept(launch.board.draft_max(), &g),
        lossy_quality: None,
        tokens: g.tokens,
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
        let (g, _) = session.generate_with(&loaded.prompt, n_predict, &mut sampler, keep, |_| {})?;
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
    let params =
        GenerateParams { n_predict: plan.n_predict, threads: plan.board.threads(), draft: plan.board.draft_max() };
    let mut rows = vec![run_resident(&plan.model, &index.shards, &plan.prompt, &params)?];
    let all = index.all_expert_window_bytes();
    for &pct in &plan.cache_percents {
        let label = format!(
            "streamed cache {pct}%{}{}",
            if params.draft.is_some() { ", ngram draft" } else { "" },
            if plan.board.verify { ", verified" } else { "" }
        );
        let launch = plan.launch(all * u64::from(pct) / 100);
        rows.push(run_streamed(&launch, &index.shards, plan.n_predict, |_| label)?);
    }
    Ok(rows)
}

/// The I/O bound of a row that read experts: the tokens per second the storage `ceiling`
/// (MiB/s) allows at the row's MiB read per token.
fn io_bound(r: &BenchRow, ceiling: f64) -> Option<f64> {
    (r.read_mib_s.is_some() && r.mib_per_token > 0.0).then(|| ceiling / r.mib_per_token)
}

/// One column of the results table: header and the cell of each row.
struct Column {
    header: &'static str,
    cells: Vec<String>,
}

fn column(header: &'static str, rows: &[BenchRow], cell: impl Fn(&BenchRow) -> String) -> Column {
    Column { header, cells: rows.iter().map(cell).collect() }
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

/// The results as a table: each row's speed relative to the first (the mmap-resident
/// reference), whether its tokens equal the first's, and, when `ceiling` (the storage ceiling in
/// MiB/s) is given, expert reads as a share of it. Cgroup columns appear for isolated runs.
pub fn table(rows: &[BenchRow], ceiling: Option<f64>) -> String {
    let base = rows.first().map_or(0.0, |r| r.tokens_per_s);
    let first = rows.first().map(|r| r.tokens.clone()).unwrap_or_default();
    let isolated = rows.iter().any(|r| r.cgroup_peak.is_some());
    let mut cols = vec![
        column("config", rows, |r| r.label.clone()),
        column("cache MiB", rows, |r| opt(r.cache_bytes, |b| format!("{:.1}", mib(b)))),
        column("tok/s", rows, |r| format!("{:.2}", r.tokens_per_s)),
        column("x mmap", rows, |r| format!("{:.2}", if base > 0.0 { r.tokens_per_s / base } else { 0.0 })),
        column("MiB/token", rows, |r| format!("{:.2}", r.mib_per_token)),
        column("hit %", rows, |r| opt(r.hit_rate, |h| format!("{:.1}", 100.0 * h))),
        column("major faults", rows, |r| r.major_faults.to_string()),
        column("peak RSS MiB", rows, |r| format!("{:.1}", mib(r.peak_rss))),
    ];
    if isolated {
        cols.push(column("cgroup peak MiB", rows, |r| opt(r.cgroup_peak, |b| format!("{:.1}", mib(b)))));
        cols.push(column("limit hits", rows, |r| opt(r.limit_hits, |h| h.to_string())));
    }
    if rows.iter().any(|r| r.stall_ms.is_some()) {
        cols.push(column("stall ms/tok", rows, |r| opt(r.stall_ms, |v| format!("{v:.1}"))));
    }
    if rows.iter().any(|r| r.draft_accept.is_some()) {
        cols.push(column("draft acc %", rows, |r| opt(r.draft_accept, |v| format!("{:.0}", 100.0 * v))));
    }
    if rows.iter().any(|r| r.lossy_quality.is_some()) {
        cols.push(column("top-1 %", rows, |r| opt(r.lossy_quality, |q| format!("{:.1}", 100.0 * q.top1))));
        cols.push(column("mean KL", rows, |r| opt(r.lossy_quality, |q| format!("{:.4}", q.mean_kl))));
    }
    cols.push(column("read MiB/s", rows, |r| opt(r.read_mib_s, |v| format!("{v:.1}"))));
    if let Some(c) = ceiling {
        cols.push(column("% ceiling", rows, |r| opt(r.read_mib_s, |v| format!("{:.0}", 100.0 * v / c))));
        cols.push(column("I/O bound tok/s", rows, |r| opt(io_bound(r, c), |b| format!("{b:.2}"))));
        cols.push(column("% I/O bound", rows, |r| {
            opt(io_bound(r, c), |b| format!("{:.0}", 100.0 * r.tokens_per_s / b))
        }));
    }
    cols.push(column("open s", rows, |r| format!("{:.2}", r.open_s)));
    cols.push(column("TTFT s", rows, |r| format!("{:.2}", r.ttft_s)));
    cols.push(column("prefill MiB", rows, |r| format!("{:.1}", mib(r.prefill_read))));
    cols.push(column("same text", rows, |r| if r.tokens == first { "yes".into() } else { "NO".into() }));
    let widths: Vec<usize> =
        cols.iter().map(|c| c.cells.iter().map(String::len).chain([c.header.len()]).max().unwrap_or(0)).collect();
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| if i == 0 { format!("{c:<w$}") } else { format!("{c:>w$}") })
            .collect();
        let _ = writeln!(out, "{}", parts.join("  "));
    };
    line(cols.iter().map(|c| c.header).collect(), &mut out);
    for i in 0..rows.len() {
        line(cols.iter().map(|c| c.cells[i].as_str()).collect(), &mut out);
    }
    out
}

/// The results as CSV (one header line, one record per configuration, quoted where a field needs
/// it; sizes in MiB).
pub fn csv(rows: &[BenchRow], ceiling: Option<f64>) -> String {
    const HEADER: [&str; 22] = [
        "config",
        "cache_mib",
        "tok_s",
        "x_mmap",
        "mib_per_token",
        "hit_rate",
        "major_faults",
        "peak_rss_mib",
        "cgroup_peak_mib",
        "limit_hits",
        "stall_ms_per_token",
        "read_mib_s",
        "share_of_ceiling",
        "io_bound_tok_s",
        "share_of_io_bound",
        "open_s",
        "ttft_s",
        "prefill_mib",
        "draft_accept",
        "top1_agreement",
        "mean_kl",
        "same_text",
    ];
    let base = rows.first().map_or(0.0, |r| r.tokens_per_s);
    let num = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
    let mut w = csv::Writer::from_writer(Vec::new());
    let records = std::iter::once(HEADER.map(String::from).to_vec()).chain(rows.iter().map(|r| {
        vec![
            r.label.clone(),
            num(r.cache_bytes.map(mib)),
            format!("{:.4}", r.tokens_per_s),
            format!("{:.4}", if base > 0.0 { r.tokens_per_s / base } else { 0.0 }),
            format!("{:.4}", r.mib_per_token),
            num(r.hit_rate),
            r.major_faults.to_string(),
            format!("{:.1}", mib(r.peak_rss)),
            num(r.cgroup_peak.map(mib)),
            r.limit_hits.map_or(String::new(), |h| h.to_string()),
            num(r.stall_ms),
            num(r.read_mib_s),
            num(r.read_mib_s.zip(ceiling).map(|(v, c)| v / c)),
            num(ceiling.and_then(|c| io_bound(r, c))),
            num(ceiling.and_then(|c| io_bound(r, c)).map(|b| r.tokens_per_s / b)),
            format!("{:.3}", r.open_s),
            format!("{:.3}", r.ttft_s),
            format!("{:.1}", mib(r.prefill_read)),
            num(r.draft_accept),
            num(r.lossy_quality.map(|q| q.top1)),
            num(r.lossy_quality.map(|q| q.mean_kl)),
            (r.tokens == rows[0].tokens).to_string(),
        ]
    }));
    for record in records {
        // Writing into memory cannot fail.
        let _ = w.write_record(&record);
    }
    w.into_inner().map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: &str, tokens_per_s: f64) -> BenchRow {
        BenchRow {
            label: label.into(),
            cache_bytes: Some(64 << 20),
            tokens_per_s,
            mib_per_token: 2.5,
            hit_rate: Some(0.5),
            major_faults: 3,
            peak_rss: 100 << 20,
            read_mib_s: Some(800.0),
            stall_ms: None,
            cgroup_peak: None,
            limit_hits: Some(0),
            open_s: 0.5,
            open_read: 0,
            ttft_s: 0.7,
            prefill_read: 96 << 20,
            draft_accept: Some(0.25),
            lossy_quality: None,
            tokens: vec![1, 2, 3],
        }
    }

    #[test]
    fn a_standard_reader_reads_the_bench_csv_back_field_for_field() {
        let rows = [row("resident-mmap", 2.0), row("streamed, no cache, serial", 5.0)];
        let text = csv(&rows, Some(1000.0));
        let mut reader = ::csv::Reader::from_reader(text.as_bytes());
        let width = reader.headers().unwrap().len();
        assert_eq!(width, 22);
        let records: Vec<::csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        assert_eq!(records.len(), 2);
        assert!(records.iter().all(|r| r.len() == width), "{text}");
        assert_eq!(&records[1][0], "streamed, no cache, serial", "the comma-holding label is one field");
        assert_eq!(&records[1][3], "2.5000", "x_mmap against the first row");
        assert_eq!(&records[1][12], "0.8000", "share of the ceiling");
        assert_eq!(&records[1][13], "400.0000", "I/O bound: 1000 MiB/s over 2.5 MiB per token");
        assert_eq!(&records[1][14], "0.0125", "5 tok/s of the bound");
        assert_eq!(&records[1][17], "96.0", "prefill MiB");
        assert_eq!(&records[1][18], "0.2500", "draft acceptance");
    }
}
