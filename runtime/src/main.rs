//! The `sluice` command line.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};

use sluice::generate::{self, GenerateParams, Generation, Session};
use sluice::stream::{self, DensePolicy, ExpertIndex, LaneConfig, StreamConfig, StreamedSession};
use sluice::synth::{self, OutputType, SynthSpec};
use sluice::telemetry::{self, Summary};
use sluice::{demo, text::DisplayText};

/// Runs Mixture-of-Experts language models bigger than a board's RAM.
#[derive(Parser)]
#[command(name = "sluice", version, about)]
struct Cli {
    /// More log output (-v: info, -vv: debug including llama.cpp, -vvv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a GGUF model.
    Run(RunArgs),
    /// Synthesize a small random-weight MoE model (once, into the cache) and run it.
    Demo(DemoArgs),
    /// Write a deterministic synthetic MoE model in GGUF.
    Synth(SynthArgs),
    /// Print the versions and the CPU features llama.cpp was compiled with.
    BuildInfo,
    /// Run a model resident and streamed at several cache sizes, back to back, and compare.
    Bench(BenchArgs),
}

#[derive(Args)]
struct BenchArgs {
    /// The model: a .gguf file (for a split model, its first file).
    #[arg(short, long)]
    model: PathBuf,
    /// The prompt.
    #[arg(short, long, default_value = sluice::demo::DEMO_PROMPT)]
    prompt: String,
    /// Tokens to generate per configuration.
    #[arg(short = 'n', long = "n-predict", default_value_t = 32, value_parser = clap::value_parser!(u32).range(2..))]
    n_predict: u32,
    /// Expert cache sizes to stream with, as percentages of all expert bytes.
    #[arg(long, value_delimiter = ',', default_value = "0,25,100")]
    cache_percents: Vec<u32>,
    #[command(flatten)]
    threads: ThreadsArg,
    /// Parallel expert readers.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    io_lanes: u32,
    /// Read experts through the page cache instead of O_DIRECT.
    #[arg(long)]
    no_direct_io: bool,
}

#[derive(Args)]
struct RunArgs {
    /// The model: a .gguf file (for a split model, its first file).
    #[arg(short, long, required_unless_present = "list_archs")]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(short, long, required_unless_present = "list_archs")]
    prompt: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    n_predict: u32,
    #[command(flatten)]
    threads: ThreadsArg,
    #[command(flatten)]
    stream: StreamArgs,
    /// Print the architectures that can be streamed, and exit.
    #[arg(long)]
    list_archs: bool,
}

#[derive(Args)]
struct StreamArgs {
    /// Load everything with llama.cpp's own mmap and do not stream (the reference for
    /// comparison).
    #[arg(long)]
    resident: bool,
    /// Expert cache budget in MiB; 0 reads every routed expert every time. Default: half of
    /// MemAvailable, at most all the experts.
    #[arg(long)]
    cache_mb: Option<u64>,
    /// Accept a cache budget below one token's routed demand.
    #[arg(long)]
    force_cache: bool,
    /// Parallel expert readers.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    io_lanes: u32,
    /// Read experts through the page cache instead of O_DIRECT.
    #[arg(long)]
    no_direct_io: bool,
    /// Where the dense (always-needed) weights live.
    #[arg(long, value_enum, default_value_t = DensePolicy::Anon)]
    dense: DensePolicy,
    /// Largest single read in KiB (split point of an expert read). Default: the storage
    /// device's maximum request size (queue/max_sectors_kb), else 512.
    #[arg(long, value_parser = clap::value_parser!(u64).range(4..))]
    read_kib: Option<u64>,
    /// Write per-token telemetry to this CSV file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Show a live status line while generating.
    #[arg(long)]
    progress: bool,
}

/// The split point of expert reads: `--read-kib`, else the device's maximum request size, else
/// 512 KiB.
fn read_size(read_kib: Option<u64>, model: &std::path::Path) -> usize {
    let bytes = match read_kib {
        Some(kib) => kib << 10,
        None => sluice_hal::storage::max_request_bytes(std::path::Path::new("/sys"), model).unwrap_or(512 << 10),
    };
    log::info!("expert reads split at {} KiB", bytes >> 10);
    bytes as usize
}

impl StreamArgs {
    fn config(&self, index: &ExpertIndex) -> StreamConfig {
        let all = index.all_expert_window_bytes();
        let cache_bytes = match self.cache_mb {
            Some(mb) => mb.saturating_mul(1 << 20),
            None => sluice_hal::memory::mem_available()
                .map_or(all, |avail| (avail / 2).min(all))
                .max(index.one_token_demand().min(all)),
        };
        StreamConfig {
            cache_bytes,
            force_cache: self.force_cache,
            lanes: LaneConfig {
                lanes: self.io_lanes as usize,
                direct: !self.no_direct_io,
                max_request: read_size(self.read_kib, &index.shards[0]),
                cpus: Vec::new(),
            },
            dense: self.dense,
            trace_routes: false,
        }
    }
}

#[derive(Args)]
struct DemoArgs {
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..))]
    n_predict: u32,
    #[command(flatten)]
    threads: ThreadsArg,
}

#[derive(Args)]
struct ThreadsArg {
    /// Compute threads (default: every CPU this process may run on).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,
}

impl ThreadsArg {
    fn get(&self) -> u32 {
        self.threads.unwrap_or_else(sluice_hal::cpu::default_threads)
    }
}

#[derive(Args)]
struct SynthArgs {
    /// Output file (.gguf). With --split-max-tensors, the files are named
    /// <prefix>-0000K-of-0000N.gguf after it.
    #[arg(short, long)]
    out: PathBuf,
    /// Transformer layers.
    #[arg(long, default_value_t = SynthSpec::default().layers)]
    layers: u32,
    /// Embedding width.
    #[arg(long, default_value_t = SynthSpec::default().embd)]
    embd: u32,
    /// Attention heads.
    #[arg(long, default_value_t = SynthSpec::default().heads)]
    heads: u32,
    /// Key/value heads.
    #[arg(long, default_value_t = SynthSpec::default().kv_heads)]
    kv_heads: u32,
    /// Routed experts per layer.
    #[arg(long, default_value_t = SynthSpec::default().experts)]
    experts: u32,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = SynthSpec::default().experts_used)]
    experts_used: u32,
    /// Hidden width of each expert (ignored with --size, which picks it).
    #[arg(long, default_value_t = SynthSpec::default().expert_ff)]
    expert_ff: u32,
    /// Training context length written to the file.
    #[arg(long, default_value_t = SynthSpec::default().ctx_len)]
    ctx: u32,
    /// Random seed: the same arguments and seed give byte-identical files.
    #[arg(long, default_value_t = SynthSpec::default().seed)]
    seed: u64,
    /// Weight type.
    #[arg(long = "type", value_enum, default_value_t = OutputType::F16)]
    out_type: OutputType,
    /// Tensor data alignment in bytes (a power of two; 4096 page-aligns every tensor).
    #[arg(long, default_value_t = SynthSpec::default().alignment)]
    alignment: u64,
    /// Target file size, e.g. 2GiB or 500MB: picks --expert-ff to come as close as possible
    /// without going over.
    #[arg(long)]
    size: Option<bytesize::ByteSize>,
    /// Split into files of at most N tensors each, after a first file holding only metadata.
    #[arg(long, value_name = "N")]
    split_max_tensors: Option<u32>,
    #[command(flatten)]
    threads: ThreadsArg,
}

impl SynthArgs {
    fn spec(&self) -> Result<SynthSpec> {
        let mut spec = SynthSpec {
            layers: self.layers,
            embd: self.embd,
            heads: self.heads,
            kv_heads: self.kv_heads,
            experts: self.experts,
            experts_used: self.experts_used,
            expert_ff: self.expert_ff,
            ctx_len: self.ctx,
            seed: self.seed,
            out_type: self.out_type,
            alignment: self.alignment,
            split_max_tensors: self.split_max_tensors,
        };
        if let Some(size) = self.size {
            spec.expert_ff = synth::fit_expert_ff(&spec, size.as_u64())?;
        }
        Ok(spec)
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info,llama=warn",
        2 => "debug",
        _ => "trace",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default))
        .format_timestamp_millis()
        .init();
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    if let Err(e) = dispatch(cli.command) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Run(a) => run(&a),
        Command::Demo(a) => run_demo(&a),
        Command::Synth(a) => run_synth(&a),
        Command::Bench(a) => run_bench(&a),
        Command::BuildInfo => {
            println!("sluice {}", env!("CARGO_PKG_VERSION"));
            println!("target: {}-{}", std::env::consts::ARCH, std::env::consts::OS);
            println!("llama.cpp system info: {}", ggml_sys::system_info());
            Ok(())
        }
    }
}

/// Generates while printing each token as it comes, then prints the timing summary.
fn generate_and_print(model: &ggml_sys::Model, prompt: &str, params: &GenerateParams) -> Result<Generation> {
    let mut display = DisplayText::default();
    let mut stdout = std::io::stdout().lock();
    let generation = generate::generate(model, prompt, params, |_, bytes| {
        let _ = write!(stdout, "{}", display.push(bytes));
        let _ = stdout.flush();
    })?;
    let _ = writeln!(stdout, "{}", display.finish());
    drop(stdout);
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.1} tok/s); generated: {} tokens, decode {:.2} tok/s{}",
        generation.prompt_tokens.len(),
        generation.prefill.as_secs_f64(),
        generation.prefill_tokens_per_s(),
        generation.tokens.len(),
        generation.decode_tokens_per_s(),
        if generation.stopped_at_eog { " (stopped at end of sequence)" } else { "" }
    );
    Ok(generation)
}

fn run(a: &RunArgs) -> Result<()> {
    if a.list_archs {
        print!("{}", stream::recipe::table());
        return Ok(());
    }
    let (Some(model_path), Some(prompt)) = (&a.model, &a.prompt) else {
        anyhow::bail!("--model and --prompt are required");
    };
    let params = GenerateParams { n_predict: a.n_predict, n_threads: a.threads.get() };
    if a.stream.resident {
        let model = generate::load_model(model_path)?;
        generate_and_print(&model, prompt, &params)?;
        return Ok(());
    }
    run_streamed(model_path, prompt, &params, &a.stream)
}

/// Streams `model_path`: prints the continuation, the telemetry summary, and the CSV if asked.
fn run_streamed(model_path: &std::path::Path, prompt: &str, params: &GenerateParams, args: &StreamArgs) -> Result<()> {
    generate::check_model_file(model_path)?;
    let index = Arc::new(ExpertIndex::open(model_path)?);
    let config = args.config(&index);
    let meter = telemetry::PhaseMeter::start();
    let model = stream::load_streamed_model(model_path, &index, config.dense)?;
    let tokens = Session::prepare(&model, prompt, params.n_predict)?;
    let n_ctx = (tokens.len() + params.n_predict as usize) as u32;
    let mut session = StreamedSession::open(&model, Arc::clone(&index), &config, n_ctx, params.n_threads)?;
    let (open_wall, open_read) = meter.finish();
    log::info!(
        "streaming {} experts/layer over {} layers; cache {} MiB",
        index.n_expert,
        index.n_layer,
        config.cache_bytes >> 20
    );
    let mut display = DisplayText::default();
    let mut stdout = std::io::stdout().lock();
    let progress = args.progress;
    let (generation, rows) = session.generate(
        &tokens,
        params.n_predict,
        |_, bytes| {
            let _ = write!(stdout, "{}", display.push(bytes));
            let _ = stdout.flush();
        },
        |row| {
            if progress {
                eprint!("\r{}", row.progress_line());
            }
        },
    )?;
    let _ = writeln!(stdout, "{}", display.finish());
    drop(stdout);
    if progress {
        eprintln!();
    }
    let summary = Summary::of(&rows);
    let streamer = session.streamer();
    let direct = (0..index.shards.len()).all(|s| streamer.lanes().is_direct(s));
    let (cache_used, counters) = (streamer.cache_used(), streamer.cache_counters());
    drop(streamer);
    eprintln!(
        "open: {:.3} s, {} read from storage ({:.1} MiB of dense weights by sluice's reader); first token after {:.3} s",
        open_wall.as_secs_f64(),
        open_read.map_or("? MiB".to_string(), |b| format!("{:.1} MiB", b as f64 / (1 << 20) as f64)),
        session.dense_bytes_read as f64 / (1 << 20) as f64,
        (open_wall + generation.prefill).as_secs_f64()
    );
    eprintln!(
        "prompt: {} tokens in {:.3} s; generated {} tokens{}",
        generation.prompt_tokens.len(),
        generation.prefill.as_secs_f64(),
        generation.tokens.len(),
        if generation.stopped_at_eog { " (stopped at end of sequence)" } else { "" }
    );
    eprintln!("{}", summary.describe());
    eprintln!(
        "cache: {:.1} of {:.1} MiB used, {} evictions, {} re-reads; reads {}",
        cache_used as f64 / (1 << 20) as f64,
        config.cache_bytes.min(index.expert_bytes()) as f64 / (1 << 20) as f64,
        counters.evictions,
        counters.rereads,
        if direct { "O_DIRECT" } else { "buffered" }
    );
    if let Some(path) = &args.csv {
        let preamble = vec![
            ("model".to_string(), model_path.display().to_string()),
            ("cache_bytes".to_string(), config.cache_bytes.to_string()),
            ("io_lanes".to_string(), config.lanes.lanes.to_string()),
            ("direct_io".to_string(), direct.to_string()),
            ("dense".to_string(), format!("{:?}", config.dense).to_lowercase()),
            ("read_bytes_max".to_string(), config.lanes.max_request.to_string()),
            ("threads".to_string(), params.n_threads.to_string()),
            ("n_predict".to_string(), params.n_predict.to_string()),
        ];
        let mut f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        telemetry::write_csv(&mut f, &preamble, &rows).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn run_demo(a: &DemoArgs) -> Result<()> {
    let dir = demo::cache_dir();
    let (path, created) = demo::ensure_demo_model(&dir, a.threads.get())?;
    let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "sluice demo: {} synthetic MoE model at {} ({:.1} MiB{})",
        synth::ARCH,
        path.display(),
        size as f64 / (1 << 20) as f64,
        if created { ", generated just now" } else { ", from the cache" }
    );
    eprintln!(
        "The weights are random: the text below is noise, not language. It shows the model loading and generating."
    );
    eprintln!("prompt: {:?} (streaming the routed experts from the file, no cache)", demo::DEMO_PROMPT);
    let params = GenerateParams { n_predict: a.n_predict, n_threads: a.threads.get() };
    let args = StreamArgs {
        resident: false,
        cache_mb: Some(0),
        force_cache: false,
        io_lanes: 2,
        no_direct_io: false,
        dense: DensePolicy::Anon,
        read_kib: None,
        csv: None,
        progress: false,
    };
    run_streamed(&path, demo::DEMO_PROMPT, &params, &args)
}

fn run_bench(a: &BenchArgs) -> Result<()> {
    generate::check_model_file(&a.model)?;
    let plan = sluice::bench::BenchPlan {
        model: a.model.clone(),
        prompt: a.prompt.clone(),
        n_predict: a.n_predict,
        n_threads: a.threads.get(),
        cache_percents: a.cache_percents.clone(),
        stream: StreamConfig {
            cache_bytes: 0,
            force_cache: true,
            lanes: LaneConfig {
                lanes: a.io_lanes as usize,
                direct: !a.no_direct_io,
                max_request: read_size(None, &a.model),
                cpus: Vec::new(),
            },
            dense: DensePolicy::Anon,
            trace_routes: false,
        },
    };
    let size: u64 =
        ExpertIndex::open(&a.model)?.shards.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
    eprintln!(
        "bench: {} ({:.1} MiB), {} tokens per configuration, {} threads",
        a.model.display(),
        size as f64 / (1 << 20) as f64,
        a.n_predict,
        plan.n_threads
    );
    let rows = sluice::bench::run(&plan)?;
    print!("{}", sluice::bench::table(&rows));
    if rows.iter().any(|r| r.tokens != rows[0].tokens) {
        anyhow::bail!("a streamed configuration generated different tokens from the resident run");
    }
    Ok(())
}

fn run_synth(a: &SynthArgs) -> Result<()> {
    let spec = a.spec()?;
    let out =
        synth::synthesize(&spec, &a.out, a.threads.get()).with_context(|| format!("writing {}", a.out.display()))?;
    for f in &out.files {
        println!("{}", f.display());
    }
    eprintln!(
        "wrote {} file(s), {:.1} MiB ({:.1} MiB of routed experts): {} layers, {} experts (top-{}), expert FFN {}, {:?}",
        out.files.len(),
        out.total_bytes as f64 / (1 << 20) as f64,
        out.expert_bytes as f64 / (1 << 20) as f64,
        spec.layers,
        spec.experts,
        spec.experts_used,
        spec.expert_ff,
        spec.out_type
    );
    Ok(())
}
