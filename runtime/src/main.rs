//! The `sluice` command line.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};

use sluice::generate::{self, GenerateParams, Generation};
use sluice::synth::{self, OutputType, SynthSpec};
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
}

#[derive(Args)]
struct RunArgs {
    /// The model: a .gguf file (for a split model, its first file).
    #[arg(short, long)]
    model: PathBuf,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    n_predict: u32,
    #[command(flatten)]
    threads: ThreadsArg,
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
        self.threads.unwrap_or_else(|| sluice_hal::cpu::default_threads())
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
    let model = generate::load_model(&a.model)?;
    let params = GenerateParams { n_predict: a.n_predict, n_threads: a.threads.get() };
    generate_and_print(&model, &a.prompt, &params)?;
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
    eprintln!("The weights are random: the text below is noise, not language. It shows the model loading and generating.");
    let model = generate::load_model(&path)?;
    eprintln!("prompt: {:?}", demo::DEMO_PROMPT);
    let params = GenerateParams { n_predict: a.n_predict, n_threads: a.threads.get() };
    generate_and_print(&model, demo::DEMO_PROMPT, &params)?;
    Ok(())
}

fn run_synth(a: &SynthArgs) -> Result<()> {
    let spec = a.spec()?;
    let out = synth::synthesize(&spec, &a.out, a.threads.get()).with_context(|| format!("writing {}", a.out.display()))?;
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
