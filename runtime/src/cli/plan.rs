//! `sluice plan`: the memory ledger of a run, before anything is loaded.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;

use sluice::board::BoardChoice;
use sluice::budget::Batch;
use sluice::budget::Ledger;
use sluice::launch::{Cache, Launch, Planned, Positions};
use sluice::lossy::Lossy;
use sluice::store::StoreError;
use sluice::stream::DensePolicy;
use sluice_hal::storage::Medium;

use super::args::{self, RpcArgs, TuningArgs};

/// `sluice plan` arguments.
#[derive(Args)]
pub struct PlanArgs {
    /// The model: a .gguf file (for a split model, its first file), a stored model's name, or
    /// the name of a model not yet stored (`sluice pull`'s names): planned from its GGUF
    /// headers, read over HTTP, before any of its weights are fetched.
    #[arg(short, long)]
    model: PathBuf,
    /// The storage's read speed, MB/s, for the estimate of the tokens per second it allows
    /// (default: a typical figure for the board's medium, said with the estimate; `sluice probe
    /// --model FILE` measures it).
    #[arg(long, value_name = "MB/S", value_parser = clap::value_parser!(u32).range(1..))]
    storage_mb_s: Option<u32>,
    #[command(flatten)]
    store: args::StoreArgs,
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
/// ledger (as JSON: `{"split": ..., "ledger": ...}`). A name not yet stored is planned from its
/// headers alone.
pub fn run_plan(a: &PlanArgs, choice: &BoardChoice) -> Result<()> {
    let store = a.store.store();
    match store.resolve(&a.model) {
        Ok(path) => plan_and_print(a, choice, &path, None),
        Err(StoreError::NotStored { name, .. }) => {
            let (copy, planned) = remote_headers(&store, &name)?;
            noteln!(
                "{} is not stored: planned from its GGUF headers alone ({} read over HTTP of its {}); `sluice pull {}` fetches it",
                planned.name,
                bytesize::ByteSize(copy.fetched),
                bytesize::ByteSize(planned.bytes()),
                planned.name
            );
            let shown = planned.name.to_string();
            plan_and_print(a, choice, &copy.first, Some((&shown, &store.hub.root)))
        }
        Err(e) => Err(e.into()),
    }
}

/// The headers of the model `name` names, fetched from its host into copies.
pub fn remote_headers(
    store: &sluice::store::Store,
    name: &str,
) -> Result<(sluice::pull::header::HeaderCopy, sluice::pull::Planned)> {
    let parsed = sluice::store::ModelName::parse(name)?;
    let settings = sluice::pull::PullSettings::default();
    let planned = sluice::pull::plan(store, &parsed, &settings)?;
    let copy = sluice::pull::header::fetch_headers(&planned, &settings)?;
    Ok((copy, planned))
}

/// The nearest folder of `path` that exists (the store's, for a model not yet in it).
fn existing(path: &Path) -> PathBuf {
    path.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/")).to_path_buf()
}

/// Plans `path` and prints the ledger; `shown` names a header copy's model and the folder it
/// would be stored in (whose storage the board is probed for).
fn plan_and_print(a: &PlanArgs, choice: &BoardChoice, path: &Path, shown: Option<(&str, &Path)>) -> Result<()> {
    sluice::metadata::check_model_file(path)?;
    let storage_at = shown.map_or_else(|| path.to_path_buf(), |(_, dir)| existing(dir));
    let board = args::board(choice, Some(&storage_at), &a.tuning)?;
    a.rpc.configure_link()?;
    let medium = board.medium;
    let launch = Launch {
        model: path.to_path_buf(),
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
    let named = |text: String| match shown {
        Some((name, _)) => text.replace(&path.display().to_string(), name),
        None => text,
    };
    match (a.json, &split) {
        (true, Some(split)) => {
            outln!("{}", named(serde_json::to_string_pretty(&serde_json::json!({ "split": split, "ledger": ledger }))?))
        }
        (true, None) => {
            if let Some(l) = ledger {
                outln!("{}", named(serde_json::to_string_pretty(l)?));
            }
        }
        (false, split) => {
            if let Some(split) = split {
                out!("{}", split.describe());
            }
            if let Ok(l) = &result {
                out!("{}", named(l.describe()));
                outln!("  {}", storage_estimate(l, a.storage_mb_s, medium));
            }
        }
    }
    result?;
    Ok(())
}

/// Whether the model `planned` (its headers copied in `copy`) fits this board with `sluice
/// serve`'s defaults (4096 positions, one slot, batches of 512), in a line: the ledger's total
/// against the budget, the expert cache, the storage bound; or why it does not fit.
pub fn verdict(choice: &BoardChoice, copy: &Path, store_dir: &Path) -> Result<String> {
    let (launch, medium) = served_by_default(choice, copy, store_dir)?;
    let name = launch.board.selected.profile.name.clone();
    Ok(match launch.plan()?.ledger {
        Ok(l) => format!(
            "fits {name} ({} positions, one slot): {} held of a {} budget, an expert cache of {}; {}",
            l.n_ctx,
            bytesize::ByteSize(l.total),
            bytesize::ByteSize(l.budget),
            bytesize::ByteSize(l.cache_bytes()),
            storage_estimate(&l, None, medium)
        ),
        Err(e) => format!("does not fit {name} as served by default: {e}"),
    })
}

/// Whether the model at `path` fits this board as `sluice serve` runs it by default (`None`
/// when it cannot be planned: not a model sluice streams).
pub fn fits(choice: &BoardChoice, path: &Path) -> Option<bool> {
    let (launch, _) = served_by_default(choice, path, path).ok()?;
    launch.plan().ok().map(|p| p.ledger.is_ok())
}

/// The launch `sluice serve` makes of `model` by default on this board, whose storage is the one
/// `storage_at` is on, and that storage's medium.
fn served_by_default(choice: &BoardChoice, model: &Path, storage_at: &Path) -> Result<(Launch, Medium)> {
    let board = args::board(choice, Some(&existing(storage_at)), &TuningArgs::default())?;
    let medium = board.medium;
    let launch = Launch {
        model: model.to_path_buf(),
        board,
        positions: Positions::ModelCapped(4096),
        slots: 1,
        batch: Batch::Fixed(sluice::generate::DEFAULT_BATCH),
        cache: Cache::from_mib(None),
        force_cache: false,
        dense: DensePolicy::Anon,
        lossy: Lossy::default(),
        rpc: Vec::new(),
        kept_bytes: 0,
    };
    Ok((launch, medium))
}

/// A medium's typical sequential read speed, MB/s, with where the figure comes from.
fn typical_mb_s(medium: Medium) -> Option<(u32, &'static str)> {
    match medium {
        Medium::Sd => Some((85, "a fast SD card in a Pi 5's reader")),
        Medium::Emmc => Some((250, "eMMC 5.1")),
        Medium::Nvme => Some((780, "NVMe on a Pi 5's PCIe lane, as the board bench measured")),
        Medium::Virtio | Medium::Other => None,
    }
}

/// The decoding speed the storage allows at the ledger's expert cache: a token reads the
/// routed experts the cache misses. Estimated for a router that spreads its choices evenly (a
/// cache holding a share s of the experts hits a share s of them); trained routers reuse
/// experts, so real hit rates are higher and this is a floor. Compute is not counted.
pub fn storage_estimate(l: &Ledger, mb_s: Option<u32>, medium: Medium) -> String {
    let share = if l.all_experts == 0 { 1.0 } else { (l.cache_bytes() as f64 / l.all_experts as f64).min(1.0) };
    let per_token = l.one_token_min as f64 * (1.0 - share);
    let (speed, basis) = match (mb_s, typical_mb_s(medium)) {
        (Some(m), _) => (m, "--storage-mb-s".to_string()),
        (None, Some((m, what))) => (m, format!("typical of {what}; --storage-mb-s gives the board's own")),
        (None, None) => {
            return "storage bound: give --storage-mb-s (`sluice probe --model FILE` measures it) for the tokens per second the storage allows".into()
        }
    };
    if per_token < 1.0 {
        return format!("storage bound: none (the expert cache holds every expert; {speed} MB/s, {basis})");
    }
    format!(
        "storage bound: about {:.1} tok/s at {speed} MB/s ({basis}): {:.1} MiB a token read, the {:.0}% of its routed experts a cache of {:.0}% of the experts misses under an evenly spread router (trained routers hit more: a floor)",
        speed as f64 * 1e6 / per_token,
        per_token / (1u64 << 20) as f64,
        100.0 * (1.0 - share),
        100.0 * share
    )
}
