//! The memory budget: the workspace ledger of a run (`sluice plan`), its automatic expert cache,
//! and the refusal of plans that do not fit.

mod batch;
mod context;
mod ledger;
mod plan;

pub use batch::{cache_kept_pct, plan_batch_from_budget, Batch, CHOICES as BATCH_CHOICES};
pub use context::{planned_positions, KV_SHARE, PLANNED_CONTEXTS};

pub use ledger::{ExpertLayout, Item, Ledger, LedgerLine};
pub use plan::{ledger, measure_context, plan_within_budget, ContextSizes, PlanRequest, OVERHEAD_BYTES};

/// Why a plan cannot run.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    /// llama.cpp could not size the context.
    #[error(transparent)]
    Llama(#[from] ggml_sys::Error),
    /// The streamed-experts kernel could not be registered to size its workspace.
    #[error("{0}")]
    Kernel(String),
    /// More positions than the model was trained for.
    #[error("a context of {positions} positions is more than the model's context length {n_ctx_train}; ask for at most {n_ctx_train} (--ctx)")]
    ContextTooLong {
        /// Positions asked for.
        positions: u32,
        /// The model's context length.
        n_ctx_train: u32,
    },
    /// The held total is over the budget.
    #[error("the plan needs {total_mib:.1} MiB, more than the budget of {budget_mib:.1} MiB\n{}fits with: {fixes}", .ledger.describe())]
    OverBudget {
        /// The ledger.
        ledger: Box<Ledger>,
        /// Held total.
        total_mib: f64,
        /// Budget.
        budget_mib: f64,
        /// What would fit.
        fixes: String,
    },
    /// The budget leaves less for the automatic cache than one token needs.
    #[error("the budget leaves {cache_mib:.1} MiB for the expert cache, below one token's routed demand of {min_mib:.1} MiB (every token would miss)\n{}fits with: {fixes}", .ledger.describe())]
    CacheBelowMinimum {
        /// The ledger.
        ledger: Box<Ledger>,
        /// The cache the budget leaves.
        cache_mib: f64,
        /// One token's demand.
        min_mib: f64,
        /// What would fit.
        fixes: String,
    },
}

impl BudgetError {
    /// The refused plan's ledger, when the error is a refusal.
    pub fn ledger(&self) -> Option<&Ledger> {
        match self {
            BudgetError::OverBudget { ledger, .. } | BudgetError::CacheBelowMinimum { ledger, .. } => Some(ledger),
            BudgetError::Llama(_) | BudgetError::Kernel(_) | BudgetError::ContextTooLong { .. } => None,
        }
    }

    /// The RPC worker that could not be reached while sizing the context, if that is the error.
    pub fn lost_worker(&self) -> Option<&str> {
        match self {
            BudgetError::Llama(e) => e.lost_worker(),
            _ => None,
        }
    }
}
