//! `sluice bench`: resident and streamed runs of one model, back to back.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use sluice::board::BoardChoice;
use sluice::generate;
use sluice::stream::{DensePolicy, ExpertIndex};

use super::args::{self, TuningArgs};

/// `sluice bench` arguments.
#[derive(Args)]
pub struct BenchArgs {
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
    tuning: TuningArgs,
}

/// Runs `sluice bench`.
pub fn run_bench(a: &BenchArgs, choice: &BoardChoice) -> Result<()> {
    generate::check_model_file(&a.model)?;
    let board = args::board(choice, Some(&a.model), &a.tuning)?;
    let plan = sluice::bench::BenchPlan {
        model: a.model.clone(),
        prompt: a.prompt.clone(),
        n_predict: a.n_predict,
        threads: board.threads(),
        cache_percents: a.cache_percents.clone(),
        stream: args::stream_config(&board, 0, true, DensePolicy::Anon),
    };
    let size: u64 =
        ExpertIndex::open(&a.model)?.shards.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
    eprintln!(
        "bench: {} ({:.1} MiB), {} tokens per configuration, {} threads on CPUs {}, {} lanes, reads of {} KiB (board {})",
        a.model.display(),
        size as f64 / (1 << 20) as f64,
        a.n_predict,
        plan.threads.count,
        sluice_hal::cpulist::format(&board.compute_cores),
        board.lanes.value,
        board.read_bytes.value >> 10,
        board.selected.id
    );
    let rows = sluice::bench::run(&plan)?;
    print!("{}", sluice::bench::table(&rows));
    if rows.iter().any(|r| r.tokens != rows[0].tokens) {
        anyhow::bail!("a streamed configuration generated different tokens from the resident run");
    }
    Ok(())
}
