//! `sluice replay`: a route trace (`sluice bench --trace`) replayed under each cache policy, the
//! best fixed set of experts in hindsight and Belady's MIN at one or more budgets.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::stream::{CachePolicy, RouteTrace};
use sluice::units::mib;

/// `sluice replay` arguments.
#[derive(Args)]
pub struct ReplayArgs {
    /// The route trace (`sluice bench --budget-mb N --trace` writes one beside bench.csv).
    #[arg(long)]
    trace: PathBuf,
    /// Cache budgets to replay at, MiB (default: the traced run's).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(0..=(1 << 24)))]
    cache_mb: Vec<u64>,
    /// Add a column per layer: each layer's decode byte hit rate.
    #[arg(long)]
    per_layer: bool,
    /// Also write the outcomes as CSV here.
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// Runs `sluice replay`.
pub fn run_replay(a: &ReplayArgs) -> Result<()> {
    let trace = RouteTrace::load(&a.trace)?;
    let budgets: Vec<u64> =
        if a.cache_mb.is_empty() { vec![trace.budget] } else { a.cache_mb.iter().map(|m| m << 20).collect() };
    noteln!(
        "replay: {} ({}): {} layer steps of {} layers x {} experts, recorded with a {:.1} MiB {} cache",
        a.trace.display(),
        trace.model,
        trace.steps.len(),
        trace.n_layer,
        trace.n_expert,
        mib(trace.budget),
        trace.policy
    );
    let outcomes = sluice::replay::compare(&trace, &CachePolicy::ALL, &budgets);
    out!("{}", sluice::replay::table(&outcomes, a.per_layer));
    if let Some(path) = &a.csv {
        std::fs::write(path, sluice::replay::csv(&outcomes)).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
