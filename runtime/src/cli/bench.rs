//! `sluice bench`: resident and streamed runs of one model, back to back, in one process or each
//! in its own memory cgroup (`--budget-mb`); and `bench-child`, one configuration of the latter.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::bench::isolated::{self, DiskThrottle, IsolatedPlan};
use sluice::bench::throttle::{StorageClass, StorageSpeed};
use sluice::board::BoardChoice;
use sluice::generate;
use sluice::stream::ExpertIndex;
use sluice::units::mib;

use super::args::{self, LossyArgs, RoutesArgs, TuningArgs};

/// `sluice bench` arguments.
#[derive(Args)]
pub struct BenchArgs {
    /// The model: a .gguf file (for a split model, its first file), or a stored model's name.
    #[arg(short, long, value_parser = super::args::model)]
    model: PathBuf,
    /// The prompt.
    #[arg(short, long, default_value = sluice::demo::DEMO_PROMPT)]
    prompt: String,
    /// Repeat the prompt to this many tokens: time to first token on a long prompt, whose
    /// batch routes most experts of every layer (the TTFT and prefill MiB columns).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    prompt_tokens: Option<u32>,
    /// Tokens to generate per configuration.
    #[arg(short = 'n', long = "n-predict", default_value_t = 32, value_parser = clap::value_parser!(u32).range(2..))]
    n_predict: u32,
    /// Expert cache sizes to stream with, as percentages of all expert bytes (one-process mode).
    #[arg(long, value_delimiter = ',', default_value = "0,25,100", conflicts_with = "budget_mb")]
    cache_percents: Vec<u32>,
    /// Run each configuration (mmap-resident, streamed without cache and with the automatic cache,
    /// serial and overlapped; with n-gram drafting on, two drafting rows) and the storage ceiling
    /// in its own child process inside a memory cgroup of this many MiB: a small board's RAM.
    /// Needs root.
    #[arg(long, value_parser = clap::value_parser!(u64).range(64..))]
    budget_mb: Option<u64>,
    /// With --budget-mb: throttle reads from the model's disk for every configuration (the
    /// storage ceiling included), to a board's storage speed: MB/s, a class (sd 85, emmc 250,
    /// nvme-gen2 400, nvme-gen3 800), or board (the profile's storage.medium). Needs an I/O
    /// cgroup controller (v1 blkio, v2 io).
    #[arg(long, requires = "budget_mb")]
    storage_mbps: Option<StorageSpeed>,
    /// With --budget-mb: also read the model file with 1, 2 and 4 lanes at requests of 128 KiB
    /// to 4 MiB (under the same throttle), printed as a table and written to read-sweep.csv.
    #[arg(long, requires = "budget_mb")]
    read_sweep: bool,
    /// With --budget-mb: add rows with the model split over two and over three boards, the
    /// head streaming its layers as the one-board rows do: loopback `sluice worker`s, each in a
    /// memory cgroup of the same budget, hold the last layers resident.
    #[arg(long, requires = "budget_mb")]
    rpc: bool,
    /// With --budget-mb: add the conversation rows: a five-turn chat (~300 new tokens a turn)
    /// from an empty slot each turn and in a slot that keeps what it can, its sixth turn warm
    /// and after a restart that reads the saved slot back, and 1, 2 and 4 clients at once
    /// (written to conversations.csv).
    #[arg(long, requires = "budget_mb")]
    conversations: bool,
    /// With --budget-mb: record the serial automatic-cache row's routed experts per token and
    /// layer into OUT/trace.sluice-trace, and replay them under each cache policy, the best fixed
    /// set of experts in hindsight and Belady's MIN (the offline optimum) at that row's budget
    /// (printed, and written to replay.csv; `sluice replay` replays it at other budgets).
    #[arg(long, requires = "budget_mb")]
    trace: bool,
    /// With --budget-mb: keep this many threads busy beside every configuration, as other
    /// services on a board would (the compute threads and lanes then lose their cores at times).
    #[arg(long, default_value_t = 0, requires = "budget_mb", value_parser = clap::value_parser!(u32).range(0..=64))]
    competing: u32,
    /// With --budget-mb: also measure the perplexity of this text (`sluice perplexity`'s
    /// definition), streamed with the automatic cache row's cache, exact and in each lossy mode
    /// given, each with its ratio to the exact figure and its top-1 agreement (printed, and written
    /// to perplexity.csv): what a lossy knob costs in language, on a trained model.
    #[arg(long, value_name = "FILE", requires = "budget_mb")]
    perplexity_file: Option<PathBuf>,
    /// Tokens per perplexity window.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(4..))]
    perplexity_ctx: u32,
    /// Perplexity windows scored at most (default: all of the file's).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    perplexity_chunks: Option<u32>,
    /// With --budget-mb: plan the streamed rows' context for this many positions (the KV cache a
    /// long conversation holds, which the expert cache then does without) instead of the
    /// prompt's and -n's: with --cache-type-k/-v, what a smaller KV cache buys.
    #[arg(long, requires = "budget_mb", value_parser = clap::value_parser!(u32).range(1..))]
    ctx: Option<u32>,
    /// With --budget-mb: run only the default row (the automatic cache, overlap auto), with the
    /// compute row and the storage ceiling: one setting against another (a KV cache type).
    #[arg(long, requires = "budget_mb")]
    default_only: bool,
    /// With --budget-mb: where to write bench.csv, bench.svg and the trace.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    #[command(flatten)]
    tuning: TuningArgs,
    /// With --budget-mb, each lossy mode given adds a row (streamed, automatic cache) with its
    /// speed and its quality against exact decoding of the same prompt.
    #[command(flatten)]
    lossy: LossyArgs,
    /// With --budget-mb: every row (the mmap and compute rows too) routed by these recorded
    /// routes; a lossy row then has no quality figure (the text is not the model's own).
    #[command(flatten)]
    routes: RoutesArgs,
}

fn model_mib(model: &std::path::Path) -> Result<f64> {
    let size: u64 = ExpertIndex::open(model)?.shards.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
    Ok(mib(size))
}

/// Runs `sluice bench`.
pub fn run_bench(a: &BenchArgs, choice: &BoardChoice) -> Result<()> {
    sluice::metadata::check_model_file(&a.model)?;
    let board = args::board(choice, Some(&a.model), &a.tuning)?;
    if board.verify {
        // The sidecar is there and matches before any row runs (the in-process rows all
        // verify; a --budget-mb run adds verified rows).
        sluice::stream::checksums::ReadSums::load(&ExpertIndex::open(&a.model)?)?;
    }
    let prompt = match a.prompt_tokens {
        Some(n) => sluice::bench::prompt_of_tokens(&a.model, &a.prompt, n as usize)
            .with_context(|| format!("--prompt-tokens {n}"))?,
        None => a.prompt.clone(),
    };
    let prompt_tokens = generate::prompt_positions(&a.model, &prompt, 0)?;
    let n_predict = match a.routes.load()? {
        Some(routes) => routed_tokens(a, &routes, prompt_tokens, board.draft_max().is_some())?,
        None => a.n_predict,
    };
    if let Some(budget_mb) = a.budget_mb {
        return run_isolated(a, &prompt, prompt_tokens, n_predict, choice, budget_mb);
    }
    if !a.lossy.lossy().is_exact() {
        anyhow::bail!("--experts-used and --substitute add rows to a --budget-mb run; give --budget-mb too");
    }
    // Every streamed configuration must fit the board's budget, like a run. A plan's total
    // only grows with its cache, so the largest cache decides.
    let plan = sluice::bench::BenchPlan {
        model: a.model.clone(),
        prompt,
        n_predict: a.n_predict,
        board: board.clone(),
        cache_percents: a.cache_percents.clone(),
    };
    if let Some(&pct) = a.cache_percents.iter().max() {
        let all = ExpertIndex::open(&a.model)?.all_expert_window_bytes();
        plan.fits(all * u64::from(pct) / 100, prompt_tokens + a.n_predict)
            .with_context(|| format!("the streamed configuration with a {pct}% cache does not fit"))?;
    }
    noteln!(
        "bench: {} ({:.1} MiB), a {prompt_tokens}-token prompt and {} tokens per configuration, {} threads on CPUs {}, {} lanes, reads of {} KiB (board {})",
        a.model.display(),
        model_mib(&a.model)?,
        a.n_predict,
        board.threads.value,
        sluice_hal::cpulist::format(&board.compute_cores),
        board.lanes.value,
        board.read_bytes.value >> 10,
        board.selected.id
    );
    let rows = sluice::bench::run(&plan)?;
    out!("{}", sluice::bench::table(&rows, None, None));
    if rows.iter().any(|r| r.tokens != rows[0].tokens) {
        anyhow::bail!("a streamed configuration generated different tokens from the resident run");
    }
    Ok(())
}

/// Checks that `routes` can route every row of `a` (a prompt of `prompt_tokens`; `draft`: the
/// board drafts), and returns the tokens each row generates: `-n`, or what the routes have left
/// after the prompt.
fn routed_tokens(
    a: &BenchArgs,
    routes: &sluice::stream::routes::ForcedRoutes,
    prompt_tokens: u32,
    draft: bool,
) -> Result<u32> {
    if a.budget_mb.is_none() {
        anyhow::bail!("--routes routes the rows of a --budget-mb run; give --budget-mb too");
    }
    if a.rpc || a.conversations || a.perplexity_file.is_some() || draft {
        anyhow::bail!("--routes routes one board's rows of one prompt: leave out --rpc, --conversations and --perplexity-file, and give --draft off");
    }
    let index = ExpertIndex::open(&a.model)?;
    let (_, n) = routes.fit(&index, index.n_expert_used, prompt_tokens as usize, a.n_predict)?;
    if n < 2 {
        anyhow::bail!(
            "--routes {} leaves {n} tokens after the {prompt_tokens}-token prompt, and a row generates at least 2; give --routes-end wrap or a shorter prompt",
            routes.path.display()
        );
    }
    Ok(n)
}

fn run_isolated(
    a: &BenchArgs,
    prompt: &str,
    prompt_tokens: u32,
    n_predict: u32,
    choice: &BoardChoice,
    budget_mb: u64,
) -> Result<()> {
    let model = std::fs::canonicalize(&a.model).with_context(|| format!("{}", a.model.display()))?;
    let board = args::board(choice, Some(&model), &a.tuning)?;
    let throttle = a.storage_mbps.map(|speed| storage_throttle(speed, &model, &board)).transpose()?;
    note_isolated(a, &model, &board, throttle.as_ref().map(|(speed, _)| speed), prompt_tokens, n_predict, budget_mb)?;
    let plan = IsolatedPlan {
        exe: std::env::current_exe().context("locating the sluice binary")?,
        global_args: vec!["--board".into(), choice.to_string().into()],
        child_args: child_args(a, &model, prompt, n_predict),
        budget: budget_mb << 20,
        throttle: throttle.map(|(_, t)| t),
        draft: board.draft_max().is_some(),
        verify: board.verify,
        lossy: a.lossy.lossy(),
        sweep: a.read_sweep,
        boards: if a.rpc { vec![2, 3] } else { Vec::new() },
        conversations: a.conversations,
        trace: a.trace.then(|| a.out.join("trace.sluice-trace")),
        competing: a.competing,
        default_only: a.default_only,
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let report = isolated::run_isolated(&plan)?;
    let c = report.ceiling;
    let compute = Some(report.compute_tok_s);
    let table = sluice::bench::table(&report.rows, Some(c.single_mib_s), compute);
    out!("{table}");
    outln!(
        "compute bound (every weight in RAM, outside the cgroup): {:.2} tok/s; storage ceiling ({}): 1 reader × {} KiB requests {:.1} MiB/s; {} lanes × {} KiB {:.1} MiB/s",
        report.compute_tok_s,
        if c.direct { "O_DIRECT" } else { "buffered: O_DIRECT refused" },
        c.single_request >> 10,
        c.single_mib_s,
        c.lanes,
        c.lanes_request >> 10,
        c.lanes_mib_s
    );
    if let Some(path) = &plan.trace {
        write_replay(path, &a.out)?;
    }
    if let Some(file) = &a.perplexity_file {
        let cache = report.rows.iter().filter(|r| r.lossy_quality.is_some()).find_map(|r| r.cache_bytes);
        let cache = cache.or_else(|| report.rows.iter().filter_map(|r| r.cache_bytes).max()).unwrap_or(0);
        write_perplexity(a, &model, file, &board, cache)?;
    }
    write_sweep_and_conversations(&report, &a.out)?;
    let csv = a.out.join("bench.csv");
    std::fs::write(&csv, sluice::bench::csv(&report.rows, Some(c.single_mib_s), compute))
        .with_context(|| format!("writing {}", csv.display()))?;
    let svg = a.out.join("bench.svg");
    let title = format!("{} in {budget_mb} MiB", args::file_name(&model));
    std::fs::write(&svg, sluice::bench::svg_bar_chart(&report.rows, &title))
        .with_context(|| format!("writing {}", svg.display()))?;
    noteln!("wrote {} and {}", csv.display(), svg.display());
    if report.rows.iter().any(|r| !r.is_lossy() && r.tokens != report.rows[0].tokens) {
        anyhow::bail!("an exact streamed configuration generated different tokens from the resident run");
    }
    Ok(())
}

/// Prints and writes (into `out`) the read sweep and the conversation rows, where the run has
/// them.
fn write_sweep_and_conversations(report: &isolated::IsolatedReport, out: &std::path::Path) -> Result<()> {
    if !report.sweep.is_empty() {
        outln!(
            "read sweep (O_DIRECT from a cold cache), MiB/s:\n{}",
            sluice::bench::storage::sweep_table(&report.sweep)
        );
        let path = out.join("read-sweep.csv");
        std::fs::write(&path, sluice::bench::storage::sweep_csv(&report.sweep))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.conversations.is_empty() {
        outln!(
            "conversations (time to first token from the request):\n{}",
            sluice::bench::conversation_table(&report.conversations)
        );
        let path = out.join("conversations.csv");
        std::fs::write(&path, sluice::bench::conversation_csv(&report.conversations))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Says what an isolated bench runs: the model, the cgroups, the throttle, the competing load.
fn note_isolated(
    a: &BenchArgs,
    model: &std::path::Path,
    board: &sluice::board::ResolvedBoard,
    throttle: Option<&StorageSpeed>,
    prompt_tokens: u32,
    n_predict: u32,
    budget_mb: u64,
) -> Result<()> {
    noteln!(
        "bench: {} ({:.1} MiB) in memory cgroups of {budget_mb} MiB{}{}{}, a {prompt_tokens}-token prompt and {} tokens per configuration, {} threads, {} lanes, reads of {} KiB (board {})",
        model.display(),
        model_mib(model)?,
        throttle.map_or(String::new(), |speed| format!(", reads throttled to {speed}")),
        if a.competing > 0 { format!(", {} busy threads beside", a.competing) } else { String::new() },
        a.routes.routes.as_ref().map_or(String::new(), |p| format!(", routed by {} (MEASURING)", p.display())),
        n_predict,
        board.threads.value,
        board.lanes.value,
        board.read_bytes.value >> 10,
        board.selected.id
    );
    Ok(())
}

/// Replays the bench's route trace at `path` under each policy and MIN at its run's budget, and
/// at half and twice that; prints the table and writes `out`/replay.csv.
fn write_replay(path: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let trace = sluice::stream::RouteTrace::load(path)?;
    let sizes = [trace.budget / 2, trace.budget, trace.budget * 2].map(sluice::replay::CacheSize::bytes);
    let outcomes = sluice::replay::compare(&trace, &sluice::stream::CachePolicy::ALL, &sizes);
    outln!(
        "replay of the serial automatic-cache row's routes ({} cache; {}):\n{}",
        trace.policy,
        path.display(),
        sluice::replay::table(&outcomes, false)
    );
    let csv = out.join("replay.csv");
    std::fs::write(&csv, sluice::replay::csv(&outcomes)).with_context(|| format!("writing {}", csv.display()))
}

/// Measures the perplexity of `file`, exact and in each lossy mode `a` gives, with an expert
/// cache of `cache` bytes; prints the table and writes `a.out`/perplexity.csv.
fn write_perplexity(
    a: &BenchArgs,
    model: &std::path::Path,
    file: &std::path::Path,
    board: &sluice::board::ResolvedBoard,
    cache: u64,
) -> Result<()> {
    let lossy = a.lossy.lossy();
    let modes: Vec<sluice::lossy::Lossy> = [
        lossy.experts_used.map(|k| sluice::lossy::Lossy { experts_used: Some(k), substitute: None }),
        lossy.substitute.map(|n| sluice::lossy::Lossy { experts_used: None, substitute: Some(n) }),
    ]
    .into_iter()
    .flatten()
    .collect();
    noteln!("perplexity of {} (windows of {}, cache {:.1} MiB)...", file.display(), a.perplexity_ctx, mib(cache));
    let costs =
        super::perplexity::lossy_costs(model, file, a.perplexity_ctx, a.perplexity_chunks, board, cache, &modes)?;
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(["mode", "perplexity", "ratio", "top1_agreement"])?;
    outln!("perplexity of {} (windows of {} tokens):", file.display(), a.perplexity_ctx);
    for c in &costs {
        outln!("  {:<48} {:>9.3}  {:.3}x  top-1 {:.1}%", c.mode, c.perplexity, c.ratio, c.top1 * 100.0);
        w.write_record([
            c.mode.clone(),
            format!("{:.4}", c.perplexity),
            format!("{:.4}", c.ratio),
            format!("{:.4}", c.top1),
        ])?;
    }
    let path = a.out.join("perplexity.csv");
    let bytes = w.into_inner().context("writing the perplexity CSV")?;
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// The arguments every child gets: the model, the prompt, the tokens, the tuning flags and the
/// lossy settings.
fn child_args(a: &BenchArgs, model: &std::path::Path, prompt: &str, n_predict: u32) -> Vec<OsString> {
    let mut child_args: Vec<OsString> = vec![
        "--model".into(),
        model.into(),
        "--prompt".into(),
        prompt.into(),
        "-n".into(),
        n_predict.to_string().into(),
    ];
    child_args.extend(args::flags_of(&a.tuning));
    child_args.extend(args::flags_of(&a.lossy));
    child_args.extend(args::flags_of(&a.routes));
    if let Some(ctx) = a.ctx {
        child_args.extend(["--ctx".into(), ctx.to_string().into()]);
    }
    child_args
}

/// The speed `speed` resolves to and the read limit it puts on the disk holding `model`.
fn storage_throttle(
    speed: StorageSpeed,
    model: &std::path::Path,
    board: &sluice::board::ResolvedBoard,
) -> Result<(StorageSpeed, DiskThrottle)> {
    let speed = speed.resolve(board.selected.profile.storage.medium).with_context(|| {
        format!(
            "--storage-mbps board: profile {} names no storage.medium of a board class; give a speed or a class ({})",
            board.selected.id,
            StorageClass::NAMES.join(", ")
        )
    })?;
    let disk = sluice_hal::storage::StorageProbe::disk_of_file(&sluice_hal::root::SysRoot::default(), model)
        .with_context(|| {
            format!(
                "--storage-mbps: {} is on no block device (tmpfs or overlay?), so its reads cannot be throttled",
                model.display()
            )
        })?;
    Ok((speed, DiskThrottle { disk, bytes_per_s: speed.bytes_per_s() }))
}
