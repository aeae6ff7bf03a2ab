//! `sluice plan`: the memory ledger of a run, before anything is loaded.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use sluice::board::BoardChoice;
use sluice::budget::Batch;
use sluice::launch::{Cache, Launch, Planned, Positions};
use sluice::lossy::Lossy;
use sluice::stream::DensePolicy;

use super::args::{self, RpcArgs, TuningArgs};

/// `sluice plan` arguments.
#[derive(Args)]
pub struct PlanArgs {
    /// The model: a .gguf file (for a split model, its first file), or a stored model's name.
    #[arg(short, long, value_parser = super::args::model)]
    model: PathBuf,
    /// Context positions to size the KV cache for.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    ctx: u32,
    /// Slots to plan for (`sluice serve --slots`): each holds `--ctx` positions of KV cache.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=sluice::serve::config::MAX_SLOTS as i64))]
    slots: u32,
    /// The most prompt tokens one decode takes (`sluice serve --batch`), or `auto`: the largest
    /// the budget and the storage allow, as `sluice run` chooses it.
    #[arg(long, default_value = "512", value_parser = Batch::parse)]
    batch: Batch,
    /// A fixed expert cache in MiB (default: what the budget leaves).
    #[arg(long)]
    cache_mb: Option<u64>,
    /// Where the dense weights would live.
    #[arg(long, value_enum, default_value_t = DensePolicy::Anon)]
    dense: DensePolicy,
    /// Print the ledger as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(flatten)]
    rpc: RpcArgs,
}

/// Runs `sluice plan`: prints the ledger (exit 0 when it fits, 1 with the fixes when it does
/// not). With `--rpc`, the split between this board and the workers first, then this board's
/// ledger (as JSON: `{"split": ..., "ledger": ...}`).
pub fn run_plan(a: &PlanArgs, choice: &BoardChoice) -> Result<()> {
    sluice::metadata::check_model_file(&a.model)?;
    let board = args::board(choice, Some(&a.model), &a.tuning)?;
    a.rpc.configure_link()?;
    let launch = Launch {
        model: a.model.clone(),
        board,
        positions: Positions::Fixed(a.ctx),
        slots: a.slots,
        batch: a.batch,
        cache: Cache::from_mib(a.cache_mb),
        force_cache: false,
        dense: a.dense,
        lossy: Lossy::default(),
        rpc: a.rpc.rpc.clone(),
        kept_bytes: 0,
    };
    let Planned { split, ledger: result, .. } = launch.plan()?;
    let ledger = match &result {
        Ok(l) => Some(l),
        Err(e) => e.ledger(),
    };
    match (a.json, &split) {
        (true, Some(split)) => {
            outln!("{}", serde_json::to_string_pretty(&serde_json::json!({ "split": split, "ledger": ledger }))?)
        }
        (true, None) => {
            if let Some(l) = ledger {
                outln!("{}", serde_json::to_string_pretty(l)?);
            }
        }
        (false, Some(split)) => {
            out!("{}", split.describe());
            if let Ok(l) = &result {
                out!("{}", l.describe());
            }
        }
        (false, None) => {
            if let Ok(l) = &result {
                out!("{}", l.describe());
            }
        }
    }
    result?;
    Ok(())
}
