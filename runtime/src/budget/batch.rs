//! The prompt batch chosen from the budget and the storage (`--batch auto`). A prompt longer
//! than one batch routes nearly every expert of every layer in each batch, so each batch passes
//! the routed experts through once: fewer, larger batches read the expert bank fewer times. A
//! larger batch grows llama.cpp's compute buffers, which leaves less for the expert cache, and
//! a smaller cache costs every decode after the prompt. Where storage is slow (SD, eMMC) the
//! prompt waits on its reads and fewer passes pay for a cache half the size; elsewhere the
//! compute hides the reads, and a larger batch is taken only where it keeps the whole cache
//! (measured: docs/benchmarks.md).

use ggml_sys::Threads;
use sluice_hal::storage::Medium;

use crate::generate::{context_params, ContextShape, DEFAULT_BATCH};
use crate::units::mib;

use super::plan::{plan_from, resident_now, PlanRequest};
use super::{BudgetError, Ledger};

/// How many prompt tokens one decode takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batch {
    /// This many (`--batch N`; at most a slot's positions).
    Fixed(u32),
    /// The largest the budget and the storage allow ([`plan_batch_from_budget`],
    /// `--batch auto`).
    FromBudget,
}

impl Batch {
    /// `--batch`'s value: `auto`, or a count of tokens of at least 1.
    pub fn parse(s: &str) -> Result<Batch, String> {
        if s == "auto" {
            return Ok(Batch::FromBudget);
        }
        match s.parse::<u32>() {
            Ok(n) if n >= 1 => Ok(Batch::Fixed(n)),
            _ => Err(format!("{s:?} is not a batch: give `auto` or a count of tokens of at least 1")),
        }
    }

    /// The batch a plan starts from: the fixed one, or [`DEFAULT_BATCH`].
    pub fn first(self) -> u32 {
        match self {
            Batch::Fixed(n) => n,
            Batch::FromBudget => DEFAULT_BATCH,
        }
    }
}

/// The prompt batches `--batch auto` chooses from, smallest first.
pub const CHOICES: [u32; 3] = [DEFAULT_BATCH, 1024, 2048];

/// The share, in percent, of batch [`DEFAULT_BATCH`]'s expert cache a larger batch must keep on
/// `medium`.
pub fn cache_kept_pct(medium: Medium) -> u64 {
    match medium {
        Medium::Sd | Medium::Emmc => 50,
        Medium::Nvme | Medium::Virtio | Medium::Other => 100,
    }
}

/// Plans `req` (its batch ignored) with the largest of [`CHOICES`] that a slot's positions
/// take, that fits the budget, and whose automatic expert cache keeps [`cache_kept_pct`] of
/// the smallest batch's. The ledger says which it took and why no larger one. A plan that does
/// not fit at the smallest batch is refused as [`super::plan_within_budget`] refuses it. Every
/// batch is planned for the process as it is now, so they differ only by their batch.
pub fn plan_batch_from_budget(req: &PlanRequest, medium: Medium) -> Result<Ledger, BudgetError> {
    let with_batch = |batch| PlanRequest { shape: ContextShape { batch, ..req.shape }, ..req.clone() };
    let baseline = resident_now();
    let mut best = plan_from(&with_batch(CHOICES[0]), baseline)?;
    let pct = cache_kept_pct(medium);
    let base = best.cache_bytes();
    let floor = base * pct / 100;
    let mut why = format!("the largest of {CHOICES:?}");
    for batch in CHOICES[1..].iter().copied() {
        let n_batch = context_params(with_batch(batch).shape, &Threads::unpinned(1)).n_batch;
        if n_batch <= best.n_batch {
            why = format!("a slot's {} positions take no larger batch", best.n_ctx / req.shape.slots.max(1));
            break;
        }
        match plan_from(&with_batch(batch), baseline) {
            Err(BudgetError::OverBudget { .. } | BudgetError::CacheBelowMinimum { .. }) => {
                why = format!("batch {batch} does not fit the budget");
                break;
            }
            Err(e) => return Err(e),
            Ok(l) if l.cache_auto && l.cache_bytes() < floor => {
                why = format!(
                    "batch {batch} would leave the expert cache {:.1} MiB, below {pct}% of batch {}'s {:.1} MiB (on {} storage)",
                    mib(l.cache_bytes()),
                    CHOICES[0],
                    mib(base),
                    medium.name()
                );
                break;
            }
            Ok(l) => best = l,
        }
    }
    best.batch_basis = format!("from the budget (a prompt passes the routed experts through once per batch): {why}");
    Ok(best)
}
