//! `sluice replay`: a route trace replayed under each cache policy, the best fixed set of
//! experts in hindsight and Belady's MIN at one or more cache sizes. The trace is sluice's own
//! (`sluice bench --trace`, `sluice perplexity --trace`) or one recorded by another engine
//! (the formats of [`sluice::replay::formats`]).

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::replay::formats::{self, Format, ReadOptions};
use sluice::replay::CacheSize;
use sluice::stream::CachePolicy;
use sluice::units::mib;

/// `sluice replay` arguments.
#[derive(Args)]
pub struct ReplayArgs {
    /// The route trace: sluice's own (`sluice bench --budget-mb N --trace` writes one beside
    /// bench.csv), a BigMoeOnEdge `*.route.csv`, speculative-moe routing JSON lines, or a folder
    /// of moe-beyond `prompt_<n>_data.csv`.
    #[arg(long)]
    trace: PathBuf,
    /// The trace's format (default: told from its contents).
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Cache sizes to replay at, MiB (a format without expert sizes counts each expert 1 MiB).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(0..=(1 << 24)))]
    cache_mb: Vec<u64>,
    /// Cache sizes to replay at, as percentages of all the experts' bytes (e.g. 10,20,30).
    #[arg(long, value_delimiter = ',', value_parser = share)]
    cache_share: Vec<f64>,
    /// Replay the prompt first, where the format records it, as one batch step per layer (the
    /// decode figures never count it).
    #[arg(long)]
    prompt: bool,
    /// Add a column per layer: each layer's decode byte hit rate.
    #[arg(long)]
    per_layer: bool,
    /// Also write `policy,cache,hit_pct,of_min_pct` here, a row per policy and size (and the
    /// default policy's again as `default`).
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// A percentage of the experts: above 0, at most 100.
fn share(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 100.0 => Ok(p),
        _ => Err(format!("`{s}` is not a share of the experts; give a percentage above 0 and at most 100")),
    }
}

/// Runs `sluice replay`.
pub fn run_replay(a: &ReplayArgs) -> Result<()> {
    let trace = formats::read(&a.trace, a.format, ReadOptions { prompt: a.prompt })?;
    let mut sizes: Vec<CacheSize> = a.cache_mb.iter().map(|&m| CacheSize::mib(m)).collect();
    sizes.extend(a.cache_share.iter().map(|&p| CacheSize::share(&trace, p)));
    if sizes.is_empty() {
        anyhow::ensure!(
            trace.budget > 0,
            "{} records no cache size; give --cache-mb or --cache-share",
            a.trace.display()
        );
        sizes.push(CacheSize::bytes(trace.budget));
    }
    let decodes =
        trace.steps.iter().filter(|s| s.tokens == 1).map(|s| s.decode).collect::<std::collections::BTreeSet<_>>();
    noteln!(
        "replay: {} ({}): {} layer steps ({} single-token decodes) of {} layers x {} experts, {:.1} MiB of experts",
        a.trace.display(),
        trace.model,
        trace.steps.len(),
        decodes.len(),
        trace.n_layer,
        trace.n_expert,
        mib(trace.expert_bytes.iter().sum())
    );
    let outcomes = sluice::replay::compare(&trace, &CachePolicy::ALL, &sizes);
    out!("{}", sluice::replay::table(&outcomes, a.per_layer));
    if let Some(path) = &a.csv {
        std::fs::write(path, sluice::replay::summary_csv(&outcomes, CachePolicy::DEFAULT))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
