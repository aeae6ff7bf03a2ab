//! The `sluice` command line.

#[macro_use]
mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

use sluice::board::BoardChoice;

/// Runs Mixture-of-Experts language models bigger than a board's RAM.
#[derive(Parser)]
#[command(name = "sluice", version, about)]
struct Cli {
    /// More log output (-v: info, -vv: debug including llama.cpp, -vvv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// The board profile: auto (match the device tree and RAM, else generic), a built-in id
    /// (see `sluice boards`), or a profile file. Default: auto (for `serve`, the settings
    /// file's `board` first).
    #[arg(long, global = true)]
    board: Option<BoardChoice>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a GGUF model.
    Run(cli::run::RunArgs),
    /// Synthesize a small random-weight MoE model (once, into the cache) and run it.
    Demo(cli::run::DemoArgs),
    /// Write a deterministic synthetic MoE model in GGUF.
    Synth(cli::synth::SynthArgs),
    /// Convert a model to another weight type (q8_0, q4_k_m, ...) with llama.cpp's quantizer.
    Quantize(cli::quantize::QuantizeArgs),
    /// Measure a model's perplexity on a text file (llama.cpp's definition), streamed or
    /// resident; with a lossy knob, its cost against the lossless run.
    Perplexity(cli::perplexity::PerplexityArgs),
    /// Print the versions and the CPU features llama.cpp was compiled with.
    BuildInfo,
    /// Run a model resident and streamed at several cache sizes, back to back, and compare.
    Bench(cli::bench::BenchArgs),
    /// Print what the hardware probe finds and the values the board profile resolves to.
    Probe(cli::probe::ProbeArgs),
    /// List the built-in board profiles.
    Boards,
    /// Print the memory ledger of a run (what it would hold, against the budget) without
    /// loading the weights.
    Plan(cli::plan::PlanArgs),
    /// Write a model's checksum sidecar (MODEL.sluice-sums) for --verify, or with --check compare
    /// the model with it: for storage that rots, such as SD cards.
    Verify(cli::verify::VerifyArgs),
    /// Fetches a model by name into the store: owner/repo[:QUANT] (a Hugging Face GGUF
    /// repository) or model[:tag] (an Ollama model); resumable, every file's sha256 checked.
    Pull(cli::pull::PullArgs),
    /// Lists the stored models (hub cache, Ollama folders), or removes one (--rm NAME).
    Models(cli::pull::ModelsArgs),
    /// Replay a route trace (`bench --trace`) under each expert cache policy, the best fixed set
    /// of experts in hindsight and Belady's MIN, the offline optimum, at one or more cache sizes.
    Replay(cli::replay::ReplayArgs),
    /// Serve the model over HTTP (OpenAI-, Anthropic- and Ollama-compatible), as a systemd notify
    /// service.
    Serve(Box<cli::serve::ServeArgs>),
    /// Chat in the terminal with a model (served for the chat) or a running server (--url).
    Chat(Box<cli::chat::ChatArgs>),
    /// Print the systemd drop-in (CPUAffinity, MemoryMax, ExecStart) for a board and model, or
    /// for an RPC worker board (--worker).
    Unit(cli::serve::UnitArgs),
    /// Lend this board's memory and cores to a head (`--rpc` on run, serve, plan) over ggml's
    /// RPC backend, as a systemd notify service.
    Worker(cli::worker::WorkerArgs),
    /// One configuration of `sluice bench --budget-mb`, inside its memory cgroup (internal).
    #[command(hide = true)]
    BenchChild(cli::bench_child::BenchChildArgs),
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
    // ggml answers an uncaught C++ exception with a backtrace that attaches a debugger; a bad
    // model file must end in an error message, quickly.
    if std::env::var_os("GGML_NO_BACKTRACE").is_none() {
        std::env::set_var("GGML_NO_BACKTRACE", "1");
    }
    let cli = Cli::parse();
    init_logging(cli.verbose);
    if let Err(e) = dispatch(cli.command, cli.board.as_ref()) {
        noteln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// `e` with its causes, each once: a cause whose text an outer message already quotes (errors
/// that name their source in their own message) is not repeated.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}

fn dispatch(command: Command, given: Option<&BoardChoice>) -> Result<()> {
    let board = &given.cloned().unwrap_or(BoardChoice::Auto);
    match command {
        Command::Run(a) => cli::run::run(&a, board),
        Command::Demo(a) => cli::run::run_demo(&a, board),
        Command::Synth(a) => cli::synth::run_synth(&a),
        Command::Quantize(a) => cli::quantize::run_quantize(&a),
        Command::Perplexity(a) => cli::perplexity::run_perplexity(&a, board),
        Command::Bench(a) => cli::bench::run_bench(&a, board),
        Command::Probe(a) => cli::probe::run_probe(&a, board),
        Command::Plan(a) => cli::plan::run_plan(&a, board),
        Command::Verify(a) => cli::verify::run_verify(&a),
        Command::Pull(a) => cli::pull::run_pull(&a, board),
        Command::Models(a) => cli::pull::run_models(&a, board),
        Command::Replay(a) => cli::replay::run_replay(&a),
        Command::Serve(a) => cli::serve::run_serve(&a, given),
        Command::Chat(a) => cli::chat::run_chat(&a),
        Command::Unit(a) => cli::serve::run_unit(&a, board),
        Command::Worker(a) => cli::worker::run_worker(&a, board),
        Command::BenchChild(a) => cli::bench_child::run_bench_child(&a, board),
        Command::Boards => {
            cli::probe::run_boards();
            Ok(())
        }
        Command::BuildInfo => {
            outln!("sluice {}", env!("CARGO_PKG_VERSION"));
            outln!("target: {}-{}", std::env::consts::ARCH, std::env::consts::OS);
            outln!("llama.cpp system info: {}", ggml_sys::system_info());
            for s in ggml_sys::extension_services() {
                outln!("{}: {}", s.name, if s.backend.is_some() { "present" } else { "absent" });
            }
            let rpc = ggml_sys::backends().iter().any(|b| b == "RPC");
            outln!(
                "rpc: {}",
                if rpc { "present (sluice worker, --rpc: several boards serve one model)" } else { "absent" }
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_shown_once() {
        let gone = || std::io::Error::other("disk gone");
        assert_eq!(error_chain(&anyhow::Error::from(gone()).context("reading m.gguf")), "reading m.gguf: disk gone");
        let quoting = anyhow::Error::from(gone()).context("reading m.gguf: disk gone");
        assert_eq!(error_chain(&quoting), "reading m.gguf: disk gone");
    }
}
