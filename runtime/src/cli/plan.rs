//! `sluice plan`: the memory ledger of a run, before anything is loaded.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use sluice::board::BoardChoice;
use sluice::budget::{self, PlanRequest};
use sluice::generate;
use sluice::stream::{DensePolicy, ExpertIndex};

use super::args::{self, TuningArgs};

/// `sluice plan` arguments.
#[derive(Args)]
pub struct PlanArgs {
    /// The model: a .gguf file (for a split model, its first file).
    #[arg(short, long)]
    model: PathBuf,
    /// Context positions to size the KV cache for.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    ctx: u32,
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
}

/// Runs `sluice plan`: prints the ledger (exit 0 when it fits, 1 with the fixes when it does
/// not).
pub fn run_plan(a: &PlanArgs, choice: &BoardChoice) -> Result<()> {
    generate::check_model_file(&a.model)?;
    let board = args::board(choice, Some(&a.model), &a.tuning)?;
    let index = ExpertIndex::open(&a.model)?;
    let req = PlanRequest {
        model: &a.model,
        index: &index,
        positions: a.ctx,
        dense: a.dense,
        cache_bytes: a.cache_mb.map(|m| m.saturating_mul(1 << 20)),
        budget: board.budget.clone(),
        gpu: board.compute.offloads(),
    };
    match budget::plan_within_budget(&req) {
        Ok(ledger) if a.json => outln!("{}", serde_json::to_string_pretty(&ledger)?),
        Ok(ledger) => out!("{}", ledger.describe()),
        Err(e) => {
            if let (true, Some(ledger)) = (a.json, e.ledger()) {
                outln!("{}", serde_json::to_string_pretty(ledger)?);
            }
            return Err(e.into());
        }
    }
    Ok(())
}
