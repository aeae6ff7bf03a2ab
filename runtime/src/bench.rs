//! `sluice bench`: the same model and prompt run resident (llama.cpp's own mmap load) and
//! streamed at several expert-cache sizes, back to back in one process, each starting with the
//! model dropped from the page cache. Only ratios within one run are meaningful: storage speed
//! drifts between runs.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::generate::{self, GenerateError, GenerateParams, Session};
use crate::stream::{ExpertIndex, StreamConfig, StreamedSession};
use crate::telemetry::{PhaseMeter, Summary, Usage};

/// One configuration's results.
#[derive(Debug, Clone, PartialEq)]
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
    /// Peak RSS after a decode, bytes.
    pub peak_rss: u64,
    /// Time to open the model (load, and for streaming the capture and dense read), seconds.
    pub open_s: f64,
    /// Bytes read from storage while opening (the kernel's `read_bytes` for this process).
    pub open_read: u64,
    /// Time to first token: open plus prompt, seconds.
    pub ttft_s: f64,
    /// The generated tokens (to check every configuration agrees).
    pub tokens: Vec<ggml_sys::Token>,
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
    /// Compute threads.
    pub threads: ggml_sys::Threads,
    /// Expert cache sizes as percentages of all expert bytes.
    pub cache_percents: Vec<u32>,
    /// The streaming configuration (its cache size is replaced per row).
    pub stream: StreamConfig,
}

fn drop_cached(files: &[PathBuf]) {
    for f in files {
        if let Err(e) = sluice_hal::storage::drop_cached(f) {
            log::warn!("cannot drop {} from the page cache ({e}); the next run may start warm", f.display());
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Runs the resident reference.
fn run_resident(
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
    let mut peak_rss = 0u64;
    let mut faults = 0u64;
    let mut read = 0u64;
    let mut before = Usage::sample();
    let mut read_before = sluice_hal::storage::process_read_bytes().unwrap_or(0);
    let mut observer = |e: generate::DecodeEvent| -> Result<(), GenerateError> {
        let now = Usage::sample();
        let read_now = sluice_hal::storage::process_read_bytes().unwrap_or(0);
        if !e.prefill {
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
        label: "resident-mmap".into(),
        cache_bytes: None,
        tokens_per_s: g.decode_tokens_per_s(),
        mib_per_token: if g.decoded == 0 { 0.0 } else { mib(read) / f64::from(g.decoded) },
        hit_rate: None,
        major_faults: faults,
        peak_rss,
        open_s,
        open_read,
        ttft_s: open_s + g.prefill.as_secs_f64(),
        tokens: g.tokens,
    })
}

/// Runs one streamed configuration.
fn run_streamed(
    path: &Path,
    index: &Arc<ExpertIndex>,
    config: &StreamConfig,
    label: String,
    prompt: &str,
    params: &GenerateParams,
) -> Result<BenchRow, GenerateError> {
    drop_cached(&index.shards);
    let meter = PhaseMeter::start();
    let model = crate::stream::load_streamed_model(path, index, config.dense, config.gpu_layers)?;
    let tokens = Session::prepare(&model, prompt, params.n_predict)?;
    let n_ctx = (tokens.len() + params.n_predict as usize) as u32;
    let mut session = StreamedSession::open(&model, Arc::clone(index), config, n_ctx, &params.threads)?;
    let (open_wall, open_read) = meter.finish();
    let (open_s, open_read) = (open_wall.as_secs_f64(), open_read.unwrap_or(0));
    let (g, rows) = session.generate(&tokens, params.n_predict, |_, _| {}, |_| {})?;
    let s = Summary::of(&rows);
    Ok(BenchRow {
        label,
        cache_bytes: Some(config.cache_bytes),
        tokens_per_s: s.tokens_per_s(),
        mib_per_token: s.mib_per_token(),
        hit_rate: Some(s.hit_rate),
        major_faults: s.major_faults,
        peak_rss: s.peak_rss,
        open_s,
        open_read,
        ttft_s: open_s + g.prefill.as_secs_f64(),
        tokens: g.tokens,
    })
}

/// Runs every configuration of `plan`, the resident reference first.
pub fn run(plan: &BenchPlan) -> Result<Vec<BenchRow>, GenerateError> {
    let index = Arc::new(ExpertIndex::open(&plan.model).map_err(crate::stream::StreamError::from)?);
    let params = GenerateParams { n_predict: plan.n_predict, threads: plan.threads.clone() };
    let mut rows = vec![run_resident(&plan.model, &index.shards, &plan.prompt, &params)?];
    let all = index.all_expert_window_bytes();
    for &pct in &plan.cache_percents {
        let cache_bytes = all * u64::from(pct) / 100;
        let config = StreamConfig { cache_bytes, force_cache: true, ..plan.stream.clone() };
        rows.push(run_streamed(&plan.model, &index, &config, format!("streamed cache {pct}%"), &plan.prompt, &params)?);
    }
    Ok(rows)
}

/// The results as a table, with each row's speed relative to the first (resident) row and
/// whether its tokens equal the resident ones.
pub fn table(rows: &[BenchRow]) -> String {
    let base = rows.first().map_or(0.0, |r| r.tokens_per_s);
    let mut out = format!(
        "{:<20} {:>10} {:>9} {:>9} {:>10} {:>8} {:>12} {:>13} {:>8} {:>13} {:>7} {:>10}\n",
        "config",
        "cache MiB",
        "tok/s",
        "x resid.",
        "MiB/token",
        "hit %",
        "major faults",
        "peak RSS MiB",
        "open s",
        "open read MiB",
        "TTFT s",
        "same text"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<20} {:>10} {:>9.2} {:>9.2} {:>10.2} {:>8} {:>12} {:>13.1} {:>8.2} {:>13.1} {:>7.2} {:>10}",
            r.label,
            r.cache_bytes.map_or("-".to_string(), |b| format!("{:.1}", mib(b))),
            r.tokens_per_s,
            if base > 0.0 { r.tokens_per_s / base } else { 0.0 },
            r.mib_per_token,
            r.hit_rate.map_or("-".to_string(), |h| format!("{:.1}", 100.0 * h)),
            r.major_faults,
            mib(r.peak_rss),
            r.open_s,
            mib(r.open_read),
            r.ttft_s,
            if rows[0].tokens == r.tokens { "yes" } else { "NO" }
        );
    }
    out
}
