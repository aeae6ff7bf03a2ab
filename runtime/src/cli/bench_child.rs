//! `sluice bench-child`: one configuration of `sluice bench --budget-mb`, in the cgroup its
//! parent made.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::bench::isolated::{self, ChildKind};
use sluice::board::BoardChoice;

use super::args::{self, LossyArgs, RoutesArgs, RpcArgs, TuningArgs};

/// `sluice bench-child` arguments (started by `sluice bench --budget-mb`).
#[derive(Args)]
pub struct BenchChildArgs {
    /// The cgroup directories to join before anything else (memory, and a v1 blkio one).
    #[arg(long, required = true)]
    join_cgroup: Vec<PathBuf>,
    /// The configuration to run.
    #[arg(long, value_enum)]
    kind: ChildKind,
    /// Clients at once (the clients kind).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    count: u32,
    /// The model.
    #[arg(short, long)]
    model: PathBuf,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict")]
    n_predict: u32,
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(flatten)]
    lossy: LossyArgs,
    #[command(flatten)]
    rpc: RpcArgs,
    /// Record the route trace and write it here.
    #[arg(long)]
    trace: Option<PathBuf>,
    #[command(flatten)]
    routes: RoutesArgs,
    /// Plan the streamed rows' context for this many positions.
    #[arg(long)]
    ctx: Option<u32>,
}

/// Runs `sluice bench-child`: joins the cgroup, runs one configuration, prints its result as one
/// JSON line.
pub fn run_bench_child(a: &BenchChildArgs, choice: &BoardChoice) -> Result<()> {
    for dir in &a.join_cgroup {
        sluice_hal::cgroup::join(dir).with_context(|| format!("joining {}", dir.display()))?;
    }
    let board = args::board(choice, Some(&a.model), &a.tuning)?;
    a.rpc.configure_link()?;
    let out = isolated::run_child(
        a.kind,
        a.count,
        &a.model,
        &a.prompt,
        a.n_predict,
        &board,
        &a.lossy.lossy(),
        &a.rpc.rpc,
        a.trace.as_deref(),
        a.routes.load()?.as_ref(),
        a.ctx,
    )?;
    outln!("{}", serde_json::to_string(&out)?);
    Ok(())
}
