//! `sluice run` and `sluice demo`: generate text, streamed (default) or resident.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::board::{BoardChoice, ResolvedBoard};
use sluice::budget::Batch;
use sluice::generate::{self, GenerateParams, Generation};
use sluice::launch::{Cost, Loaded, Positions};
use sluice::stream::{CacheCounters, DensePolicy, TokenRow};
use sluice::telemetry::{self, Summary};
use sluice::units::mib;
use sluice::{demo, text::DisplayText};
use sluice_hal::usage::Usage;

use super::args::{self, RoutesArgs, RpcArgs, StreamArgs, TuningArgs};
use super::TextOut;

/// `sluice run` arguments.
#[derive(Args)]
pub struct RunArgs {
    /// The model: a .gguf file (for a split model, its first file), or a stored model's name.
    #[arg(short, long, required_unless_present = "list_archs")]
    model: Option<PathBuf>,
    /// Fetch the model first when it is a name not yet stored (as `sluice pull NAME`).
    #[arg(long)]
    pull: bool,
    /// The prompt.
    #[arg(short, long, required_unless_present = "list_archs")]
    prompt: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    n_predict: u32,
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    rpc: RpcArgs,
    #[command(flatten)]
    routes: RoutesArgs,
    /// Record every computed token's routed experts (each MoE layer's, in the router's rank
    /// order) into FILE as a BigMoeOnEdge `route_trace v1` CSV: the routes `--routes` forces
    /// and `sluice replay --trace` replays.
    #[arg(long, value_name = "FILE", conflicts_with = "resident")]
    record_routes: Option<PathBuf>,
    /// Plan the context (its KV cache) for this many positions, at least the prompt's and -n's:
    /// the memory a long conversation holds, which the expert cache then does without.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "resident")]
    ctx: Option<u32>,
    /// Print the architectures that can be streamed, and exit.
    #[arg(long)]
    list_archs: bool,
}

/// `sluice demo` arguments.
#[derive(Args)]
pub struct DemoArgs {
    /// Run this model instead of the synthetic one, from an English prompt (`make demo` passes
    /// the KJV model trained by `trainer/make-model`).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..))]
    n_predict: u32,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// Generates while printing each token as it comes (under forced routes, when given), then
/// prints the timing summary.
fn generate_and_print(
    model: &ggml_sys::Model,
    prompt: &str,
    params: &GenerateParams,
    forcer: Option<sluice::stream::RouteForcer>,
) -> Result<Generation> {
    let mut display = DisplayText::default();
    let mut out = TextOut::new()?;
    let forced = forcer.is_some();
    let callback = forcer.map(sluice::stream::RouteForcer::resident_callback);
    let generation = generate::generate_observed(model, prompt, params, callback, forced, |_, bytes| {
        out.write(&display.push(bytes))
    })?;
    out.finish(&display.finish())?;
    noteln!(
        "prompt: {} tokens in {:.3} s ({:.1} tok/s, batches of {}); generated: {} tokens, decode {:.2} tok/s{}",
        generation.prompt_tokens.len(),
        generation.prefill.as_secs_f64(),
        generation.prefill_tokens_per_s(),
        params.batch,
        generation.tokens.len(),
        generation.decode_tokens_per_s(),
        if generation.stopped_at_eog { " (stopped at end of sequence)" } else { "" }
    );
    if params.draft.is_some() {
        noteln!("draft: {} of {} drafted tokens accepted", generation.accepted, generation.drafted);
    }
    Ok(generation)
}

/// Runs `sluice run`.
pub fn run(a: &RunArgs, choice: &BoardChoice) -> Result<()> {
    if a.list_archs {
        out!("{}", sluice::metadata::verified::table());
        return Ok(());
    }
    let (Some(model_path), Some(prompt)) = (&a.model, &a.prompt) else {
        anyhow::bail!("--model and --prompt are required");
    };
    let model_path = &super::pull::resolve_model(model_path, a.pull, choice)?;
    sluice::metadata::check_model_file(model_path)?;
    let board = args::board(choice, Some(model_path), &a.tuning)?;
    let routes = RouteUse { forced: a.routes.load()?, record: a.record_routes.clone() };
    if routes.forced.is_some() && board.draft_max().is_some() {
        anyhow::bail!(
            "--routes forces one route per computed token, and drafting computes tokens it may drop; give --draft off"
        );
    }
    if routes.forced.is_some() && !a.rpc.rpc.is_empty() {
        anyhow::bail!("--routes forces the routes of the layers this board streams only; run it without --rpc");
    }
    let params = GenerateParams {
        n_predict: a.n_predict,
        threads: board.threads(),
        draft: board.draft_max(),
        batch: a.stream.batch.first(),
        kv: board.kv,
    };
    if a.stream.resident {
        if board.verify {
            log::warn!("storage.verify checks streamed reads; --resident reads the weights once, unchecked (`sluice verify --check --model MODEL` checks the whole model)");
        }
        let gpu_layers = board.compute.gpu_layers().min(i32::MAX as u32) as i32;
        let model = sluice::stream::resident::load_resident(
            model_path,
            &ggml_sys::ModelParams { n_gpu_layers: gpu_layers, ..Default::default() },
        )?;
        let batch = resident_batch(a, model_path, prompt, &board);
        let mut params = GenerateParams { batch, ..params };
        let forcer = match &routes.forced {
            Some(forced) => {
                let index = sluice::stream::ExpertIndex::open(model_path)?;
                let prompt_tokens = generate::Session::prepare(&model, prompt, params.n_predict)?.len();
                let (forcer, n) = forced.fit(&index, index.n_expert_used, prompt_tokens, params.n_predict)?;
                params.n_predict = n;
                Some(forcer)
            }
            None => None,
        };
        generate_and_print(&model, prompt, &params, forcer)?;
        return Ok(());
    }
    let positions = Positions::Prompt { text: prompt.clone(), n_predict: a.n_predict, reserve: a.ctx.unwrap_or(0) };
    run_streamed(model_path, positions, &params, &a.stream, &a.rpc, &board, &routes)
}

/// What a run does with routes: forces recorded ones (`--routes`), records its own
/// (`--record-routes`).
#[derive(Default)]
struct RouteUse {
    forced: Option<sluice::stream::routes::ForcedRoutes>,
    record: Option<PathBuf>,
}

impl RouteUse {
    /// Sets up `loaded`'s session to force and record routes as asked; returns the tokens the
    /// run generates of the `n_predict` asked (the forced routes may have fewer).
    fn apply(&self, loaded: &mut Loaded, n_predict: u32) -> Result<u32> {
        loaded.config.record_routes = self.record.is_some();
        let Some(forced) = &self.forced else { return Ok(n_predict) };
        let n = forced.apply(&mut loaded.config, &loaded.index, loaded.prompt.len(), n_predict)?;
        noteln!(
            "routes forced from {} (MEASURING: the text is not the model's own); generating {n} tokens",
            forced.path.display()
        );
        Ok(n)
    }

    /// Writes the routes `streamer` recorded (`--record-routes`) for the model at `model_path`.
    fn write(&self, loaded: &Loaded, streamer: &sluice::stream::Streamer, model_path: &Path) -> Result<()> {
        let (Some(path), Some(recorded)) = (&self.record, streamer.recorded_routes(args::file_name(model_path))) else {
            return Ok(());
        };
        let header = sluice::stream::routes::record::RouteCsvHeader {
            arch: &loaded.index.arch,
            n_expert_used: loaded.index.n_expert_used,
            layer_bytes: &streamer.layer_expert_bytes(),
            prompt: loaded.prompt.len(),
        };
        sluice::stream::routes::record::write_route_csv(path, &recorded, header)?;
        noteln!("routes: {} tokens recorded in {}", recorded.tokens.len(), path.display());
        Ok(())
    }
}

/// The prompt batch of a resident run: the fixed one, or the one the streamed run of the same
/// prompt on `board` would choose (so that both compute alike and give the same text). A model
/// that cannot stream, or whose streamed run would not fit, takes batches of the default.
fn resident_batch(a: &RunArgs, model: &Path, prompt: &str, board: &ResolvedBoard) -> u32 {
    if a.stream.batch != Batch::FromBudget {
        return a.stream.batch.first();
    }
    let positions = Positions::Prompt { text: prompt.to_string(), n_predict: a.n_predict, reserve: 0 };
    let planned = a.stream.launch(model, positions, board, &[]).plan();
    match planned.map_err(anyhow::Error::from).and_then(|p| Ok(p.ledger?)) {
        Ok(ledger) => ledger.n_batch,
        Err(e) => {
            let batch = a.stream.batch.first();
            log::info!("--batch auto: no streamed plan to follow ({e}); the resident run takes batches of {batch}");
            batch
        }
    }
}

/// Streams `model_path` (checked by the caller: `run`, or the demo's own model): prints the
/// continuation, the telemetry summary, and the CSV if asked.
fn run_streamed(
    model_path: &Path,
    positions: Positions,
    params: &GenerateParams,
    args: &StreamArgs,
    rpc: &RpcArgs,
    board: &ResolvedBoard,
    routes: &RouteUse,
) -> Result<()> {
    // Created before anything is generated: a path that cannot be written fails at once.
    let csv = args
        .csv
        .as_ref()
        .map(|p| std::fs::File::create(p).with_context(|| format!("--csv {}: cannot create it", p.display())))
        .transpose()?;
    rpc.configure_link()?;
    let launch = args.launch(model_path, positions, board, &rpc.rpc);
    let mut loaded = launch.load(&mut |step| log::debug!("{step}"))?;
    if let Some(split) = &loaded.split {
        note!("{}", split.describe());
    }
    let n_predict = routes.apply(&mut loaded, params.n_predict)?;
    let (mut session, open) = loaded.open()?;
    let mut display = DisplayText::default();
    let mut out = TextOut::new()?;
    let progress = args.progress;
    let (generation, rows) = session.generate(
        &loaded.prompt,
        n_predict,
        |_, bytes| out.write(&display.push(bytes)),
        |row| {
            if progress {
                note!("\r{}", telemetry::progress_line(row));
            }
        },
    )?;
    out.finish(&display.finish())?;
    if progress {
        noteln!();
    }
    let streamer = session.streamer();
    routes.write(&loaded, &streamer, model_path)?;
    let end = RunEnd {
        direct: (0..loaded.index.shards.len()).all(|s| streamer.lanes().is_direct(s)),
        cache_used: streamer.cache_used(),
        slots: streamer.slots(),
        counters: streamer.cache_counters(),
        guesses: streamer.lookahead_report(),
        dense_bytes_read: session.dense_bytes_read,
        open,
        generation,
    };
    let usage = report(&loaded, &end, &rows, params.draft.is_some());
    if let (Some(path), Some(mut f)) = (&args.csv, csv) {
        let ledger = &loaded.ledger;
        let config = &loaded.config;
        let preamble = vec![
            ("model".to_string(), model_path.display().to_string()),
            ("cache_bytes".to_string(), config.cache_bytes.to_string()),
            ("io_lanes".to_string(), config.lanes.lanes.to_string()),
            ("direct_io".to_string(), end.direct.to_string()),
            ("dense".to_string(), format!("{:?}", config.dense).to_lowercase()),
            ("read_bytes_max".to_string(), config.lanes.max_request.to_string()),
            ("threads".to_string(), params.threads.count.to_string()),
            ("compute_cores".to_string(), sluice_hal::cpulist::format(&board.compute_cores)),
            ("io_cores".to_string(), sluice_hal::cpulist::format(&board.io_cores)),
            ("board".to_string(), board.selected.id.clone()),
            ("ledger_total_bytes".to_string(), ledger.total.to_string()),
            ("budget_bytes".to_string(), ledger.budget.to_string()),
            ("peak_rss_bytes".to_string(), usage.rss_peak.to_string()),
            ("n_predict".to_string(), params.n_predict.to_string()),
        ];
        let mut w = std::io::BufWriter::new(&mut f);
        telemetry::write_csv(&mut w, &preamble, &rows)
            .and_then(|()| std::io::Write::flush(&mut w))
            .with_context(|| format!("writing --csv {}", path.display()))?;
    }
    Ok(())
}

/// How a streamed run ended: what it generated and what the streamer saw.
struct RunEnd {
    generation: Generation,
    open: Cost,
    dense_bytes_read: u64,
    /// Every file was read with `O_DIRECT`.
    direct: bool,
    cache_used: u64,
    /// The expert pool.
    slots: sluice::stream::SlotUse,
    counters: CacheCounters,
    /// The lookahead's guesses per layer, as a line.
    guesses: Option<String>,
}

/// Prints the run's summary: open, prompt, drafting, decode telemetry, lossy modes, memory and
/// cache; returns the memory usage it printed.
fn report(loaded: &Loaded, end: &RunEnd, rows: &[TokenRow], draft: bool) -> Usage {
    let (g, open, ledger) = (&end.generation, &end.open, &loaded.ledger);
    noteln!(
        "open: {:.3} s, {} read from storage ({:.1} MiB of dense weights by sluice's reader); first token after {:.3} s",
        open.wall.as_secs_f64(),
        open.read.map_or("? MiB".to_string(), |b| format!("{:.1} MiB", mib(b))),
        mib(end.dense_bytes_read),
        (open.wall + g.prefill).as_secs_f64()
    );
    noteln!(
        "prompt: {} tokens in {:.3} s (batches of {}); generated {} tokens{}",
        g.prompt_tokens.len(),
        g.prefill.as_secs_f64(),
        loaded.shape.batch,
        g.tokens.len(),
        if g.stopped_at_eog { " (stopped at end of sequence)" } else { "" }
    );
    if draft {
        noteln!("draft: {} of {} drafted tokens accepted", g.accepted, g.drafted);
    }
    let summary = Summary::of_generation(rows, g);
    noteln!("{}", summary.describe());
    if let Some(line) = &end.guesses {
        noteln!("{line}");
    }
    if summary.lookahead_reads > 0 {
        noteln!(
            "lookahead: {} experts read ahead of their layer, {} of them then chosen ({:.0}%)",
            summary.lookahead_reads,
            summary.lookahead_used,
            100.0 * summary.lookahead_used as f64 / summary.lookahead_reads as f64
        );
    }
    let lossy = &loaded.config.lossy;
    if !lossy.is_exact() {
        noteln!(
            "{}; {} chosen experts substituted by cached ones",
            lossy.describe(loaded.index.n_expert_used),
            summary.substituted
        );
    }
    let usage = Usage::sample();
    noteln!(
        "memory: peak RSS {:.1} MiB (now anon {:.1} + file {:.1} + shared {:.1} MiB, the expert pool where mapped), ledger total {:.1} MiB, budget {:.1} MiB ({})",
        mib(usage.rss_peak),
        mib(usage.rss_anon),
        mib(usage.rss_file),
        mib(usage.rss_shmem),
        mib(ledger.total),
        mib(ledger.budget),
        ledger.budget_source
    );
    noteln!(
        "cache: budget {:.1} MiB, {:.1} MiB resident at the end (the last layer's experts included), {} evictions, {} re-reads; reads {}; {}",
        mib(loaded.cache_bytes()),
        mib(end.cache_used),
        end.counters.evictions,
        end.counters.rereads,
        if end.direct { "O_DIRECT" } else { "buffered" },
        slot_line(&end.slots)
    );
    usage
}

/// The expert pool as the run summary states it.
fn slot_line(slots: &sluice::stream::SlotUse) -> String {
    if slots.bytes == 0 {
        return "expert pool off (reads land in fresh pages)".into();
    }
    format!(
        "expert pool {:.1} MiB committed at open, {} reads found it full and landed in fresh pages",
        mib(slots.bytes),
        slots.misses
    )
}

/// Runs `sluice demo`.
pub fn run_demo(a: &DemoArgs, choice: &BoardChoice) -> Result<()> {
    let (path, prompt) = match &a.model {
        Some(path) => {
            sluice::metadata::check_model_file(path)?;
            let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            noteln!("sluice demo: the trained model at {} ({:.1} MiB)", path.display(), mib(size));
            (path.clone(), demo::TRAINED_PROMPT)
        }
        None => {
            let dir = sluice::dirs::cache_dir();
            let (path, created) = demo::ensure_demo_model(&dir, sluice_hal::cpu::default_threads())?;
            let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            noteln!(
                "sluice demo: {} synthetic MoE model at {} ({:.1} MiB{})",
                demo::demo_spec().arch.name(),
                path.display(),
                mib(size),
                if created { ", generated just now" } else { ", from the cache" }
            );
            noteln!(
                "The weights are random: the words below are drawn from its vocabulary, not language. It shows the model loading and generating."
            );
            (path, demo::DEMO_PROMPT)
        }
    };
    let board = args::board(choice, Some(&path), &a.tuning)?;
    noteln!("prompt: {prompt:?} (streaming the routed experts from the file, no cache)");
    let params = GenerateParams {
        n_predict: a.n_predict,
        threads: board.threads(),
        draft: board.draft_max(),
        batch: generate::DEFAULT_BATCH,
        kv: board.kv,
    };
    let args = StreamArgs {
        resident: false,
        cache_mb: Some(0),
        force_cache: false,
        dense: DensePolicy::Anon,
        batch: Batch::Fixed(generate::DEFAULT_BATCH),
        csv: None,
        progress: false,
        lossy: Default::default(),
    };
    let positions = Positions::Prompt { text: prompt.to_string(), n_predict: params.n_predict, reserve: 0 };
    run_streamed(&path, positions, &params, &args, &RpcArgs::default(), &board, &RouteUse::default())
}
