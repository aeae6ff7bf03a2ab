//! `sluice perplexity`: a model's perplexity on a text file, streamed (default) or resident.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::board::{BoardChoice, ResolvedBoard};
use sluice::budget::Batch;
use sluice::generate::{self, ContextShape, Session};
use sluice::launch::{Launch, Positions};
use sluice::perplexity::{Scores, Windows};

use super::args::{self, RpcArgs, StreamArgs, TuningArgs};

/// `sluice perplexity` arguments.
#[derive(Args)]
#[command(after_help = "\
Defined as llama.cpp's perplexity tool defines it: windows of --ctx tokens, each computed from an \
empty memory, the second half of each scored. Streamed and --resident give the same figure. \
--decode computes each window's second half a token at a time, as generation does (the figure \
agrees to rounding); --substitute acts only there, so it implies --decode.

With a LOSSY knob (--experts-used, --substitute) the lossless streamed run is computed too, and \
the knob's cost is printed as the perplexity ratio (lossy / lossless) and the top-1 agreement (how \
often both runs rank the same next token first). On the trained KJV model's held-out chapters \
(docs/trained-model.md): --experts-used 3 of 4 costs 1.009x and agrees on 92.8% of tokens, 2 of 4 \
1.046x and 86.0%, 1 of 4 1.212x and 72.4%; --substitute 1 with a cache of a fifth of the experts \
1.004x and 96.2%, --substitute 4 1.192x and 84.1%.")]
pub struct PerplexityArgs {
    /// The model: a .gguf file (for a split model, its first file), or a stored model's name.
    #[arg(short, long, value_parser = super::args::model)]
    model: PathBuf,
    /// The text to score (UTF-8).
    #[arg(short, long)]
    file: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(4..))]
    ctx: u32,
    /// Score at most this many windows (default: every whole window of the text).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    chunks: Option<u32>,
    /// Also record the routes of single-token decodes over the text's first --trace-tokens
    /// tokens (the text fed as if generated, one token at a time) as a route trace for `sluice
    /// replay`. Streamed runs only.
    #[arg(long, value_name = "FILE", conflicts_with = "resident")]
    trace: Option<PathBuf>,
    /// Compute each window's first half as a prompt and the scored half a token at a time, as
    /// generation does (implied by --substitute, which acts only on single-token decodes).
    #[arg(long)]
    decode: bool,
    /// Tokens the --trace run decodes (at most --ctx; the trace has one step per layer each).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(2..))]
    trace_tokens: u32,
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    rpc: RpcArgs,
}

/// Reads the text file, with an error that names it and says what is wrong.
fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("--file {}: cannot read it", path.display()))?;
    if bytes.is_empty() {
        anyhow::bail!("--file {}: the file is empty; give a text to score", path.display());
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "--file {}: not UTF-8 text (invalid bytes at offset {}); convert it, e.g. with iconv",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Runs `sluice perplexity`.
pub fn run_perplexity(a: &PerplexityArgs, choice: &BoardChoice) -> Result<()> {
    let text = read_text(&a.file)?;
    sluice::metadata::check_model_file(&a.model)?;
    let board = args::board(choice, Some(&a.model), &a.tuning)?;
    let n_ctx = a.ctx as usize;
    // The same batches streamed and resident, so that both compute alike.
    let batch = a.stream.batch.first().min(a.ctx);
    let chunks = a.chunks.map(|c| c as usize);
    let progress = |n: usize| move |i: usize, ppl: f64| noteln!("[{i}/{n}] perplexity {ppl:.4}");
    if a.stream.resident {
        let model = generate::load_model(&a.model)?;
        let windows = Windows::of_text(&model, &text, n_ctx, chunks)?;
        let shape = ContextShape { positions: a.ctx, slots: 1, batch, kv: board.kv };
        let mut session = Session::new(&model, shape, &board.threads(), None)?;
        let mut no_observer = |_| Ok::<(), generate::GenerateError>(());
        let scores = if a.decode {
            windows.score_decoded(
                |prompt, rest, on| session.score_continuation(prompt, rest, on, &mut no_observer),
                progress(windows.chunks()),
            )?
        } else {
            windows.score(|w, on| session.evaluate_window(w, on, &mut no_observer), progress(windows.chunks()))?
        };
        report(&windows, &scores, "resident", None);
        return Ok(());
    }
    a.rpc.configure_link()?;
    let mut launch = a.stream.launch(&a.model, Positions::Fixed(a.ctx), &board, &a.rpc.rpc);
    launch.batch = Batch::Fixed(batch);
    let lossy = launch.lossy;
    let decode = a.decode || lossy.substitute.is_some();
    let lossless = if !lossy.is_exact() {
        noteln!("the lossless run first, to compare the lossy one with:");
        let exact = Launch { lossy: sluice::lossy::Lossy::default(), ..launch.clone() };
        Some(streamed(&exact, &text, n_ctx, chunks, decode, None, &board, &progress)?)
    } else {
        None
    };
    let trace = a.trace.as_deref().map(|p| (p, a.trace_tokens.min(a.ctx) as usize));
    let run = streamed(&launch, &text, n_ctx, chunks, decode, trace, &board, &progress)?;
    report(&run.windows, &run.scores, &run.how, lossless.as_ref().map(|l| &l.scores));
    Ok(())
}

/// Scores the text streamed through `launch` (each window's scored half a token at a time with
/// `decode`); with `trace`, first records that many teacher-forced single-token decodes' routes
/// into the file.
#[allow(clippy::too_many_arguments)]
fn streamed<P: FnMut(usize, f64)>(
    launch: &Launch,
    text: &str,
    n_ctx: usize,
    chunks: Option<usize>,
    decode: bool,
    trace: Option<(&Path, usize)>,
    board: &ResolvedBoard,
    progress: &impl Fn(usize) -> P,
) -> Result<Scored> {
    let loaded = launch.load(&mut |step| log::debug!("{step}"))?;
    let (mut session, _) = loaded.open()?;
    let windows = Windows::of_text(session.model(), text, n_ctx, chunks)?;
    if let Some((path, n)) = trace {
        let first = windows.window(0);
        session.streamer().start_trace();
        session.score_continuation(&first[..1], &first[1..n], |_, _| {})?;
        let name = args::file_name(&launch.model);
        session.streamer().route_trace(name).save(path)?;
        noteln!("routes of {} single-token decodes written to {}", n - 1, path.display());
    }
    let scores = if decode {
        windows.score_decoded(
            |prompt, rest, on| session.score_continuation(prompt, rest, on).map(drop),
            progress(windows.chunks()),
        )?
    } else {
        windows.score(|w, on| session.evaluate_window(w, on).map(drop), progress(windows.chunks()))?
    };
    if let Some(line) = session.streamer().lookahead_report() {
        noteln!("{line}");
    }
    let mode = launch.lossy.describe(loaded.index.n_expert_used);
    let how = format!(
        "streamed{}, expert cache {} MiB, board {}{}",
        if decode { ", scored a token at a time" } else { "" },
        loaded.cache_bytes() >> 20,
        board.selected.id,
        if launch.lossy.is_exact() { String::new() } else { format!(", {mode}") }
    );
    Ok(Scored { windows, scores, how, mode })
}

/// A streamed run's scores and how it ran.
struct Scored {
    windows: Windows,
    scores: Scores,
    /// The run, for the report's first line.
    how: String,
    /// The lossy setting's description (`exact (no lossy mode)` for none).
    mode: String,
}

/// One mode's perplexity on a text, and its cost against the exact run's.
pub struct ModeCost {
    /// The mode: `exact`, or the lossy setting's description.
    pub mode: String,
    /// Its perplexity.
    pub perplexity: f64,
    /// Its perplexity over the exact run's.
    pub ratio: f64,
    /// The share of scored positions (0 to 1) where its first choice is the exact run's.
    pub top1: f64,
}

/// The exact streamed perplexity of `file` (windows of `ctx`, at most `chunks`) on `board` with
/// an expert cache of `cache_bytes` (the cache a lossy substitution draws on), then each lossy
/// mode of `modes` with its cost: `sluice bench --perplexity-file`.
pub fn lossy_costs(
    model: &Path,
    file: &Path,
    ctx: u32,
    chunks: Option<u32>,
    board: &ResolvedBoard,
    cache_bytes: u64,
    modes: &[sluice::lossy::Lossy],
) -> Result<Vec<ModeCost>> {
    let text = read_text(file)?;
    let launch = Launch {
        model: model.to_path_buf(),
        board: board.clone(),
        positions: Positions::Fixed(ctx),
        slots: 1,
        batch: Batch::Fixed(Batch::FromBudget.first().min(ctx)),
        cache: sluice::launch::Cache::Fixed(cache_bytes),
        force_cache: true,
        dense: sluice::stream::DensePolicy::Anon,
        lossy: sluice::lossy::Lossy::default(),
        rpc: Vec::new(),
        kept_bytes: 0,
    };
    let quiet = |_: usize| |_: usize, _: f64| {};
    let chunks = chunks.map(|c| c as usize);
    let score =
        |launch: &Launch, decode: bool| streamed(launch, &text, ctx as usize, chunks, decode, None, board, &quiet);
    let exact = score(&launch, false)?.scores;
    // Substitution acts only on single-token decodes: it is scored, and compared, that way.
    let exact_decoded =
        if modes.iter().any(|m| m.substitute.is_some()) { Some(score(&launch, true)?.scores) } else { None };
    let mut costs = vec![ModeCost { mode: "exact".into(), perplexity: exact.perplexity(), ratio: 1.0, top1: 1.0 }];
    for &lossy in modes {
        let decode = lossy.substitute.is_some();
        let exact = if decode { exact_decoded.as_ref().unwrap_or(&exact) } else { &exact };
        let run = score(&Launch { lossy, ..launch.clone() }, decode)?;
        costs.push(ModeCost {
            mode: run.mode,
            perplexity: run.scores.perplexity(),
            ratio: run.scores.perplexity() / exact.perplexity(),
            top1: run.scores.top1_agreement(exact)?,
        });
    }
    Ok(costs)
}

/// Prints the run's figures; the last line is `perplexity: FIGURE`.
fn report(windows: &Windows, scores: &Scores, how: &str, lossless: Option<&Scores>) {
    outln!("run: {how}");
    outln!(
        "windows: {} of {} tokens ({} of the text's {} tokens), {} tokens scored",
        windows.chunks(),
        windows.n_ctx(),
        windows.chunks() * windows.n_ctx(),
        windows.text_tokens(),
        scores.count()
    );
    if let Some(exact) = lossless {
        outln!("lossless perplexity: {:.4}", exact.perplexity());
        outln!("lossy / lossless: {:.3}x", scores.perplexity() / exact.perplexity());
        if let Ok(agree) = scores.top1_agreement(exact) {
            outln!("top-1 agreement with the lossless run: {:.1}%", agree * 100.0);
        }
    }
    outln!("perplexity: {:.4}", scores.perplexity());
}
