//! The context `sluice serve` holds without `--ctx`: what the board's plan affords.

use super::{Item, Ledger};

/// The contexts chosen from, largest first: Ollama's clients assume 8,192 positions (Home
/// Assistant's conversation failed at 4,096).
pub const PLANNED_CONTEXTS: [u32; 3] = [8192, 4096, 2048];
/// The most of the budget a planned context's KV cache may take: the rest stays the expert
/// cache's, which decides the speed.
pub const KV_SHARE: f64 = 1.0 / 8.0;

/// The context for a model trained for `trained` positions, `plan` giving the ledger of a context
/// when it fits: the largest of [`PLANNED_CONTEXTS`] (at most `trained`) whose KV cache takes at
/// most [`KV_SHARE`] of the budget, else the smallest that fits, else the middle one (whose plan
/// then says why it cannot fit). The log says which and why.
pub fn planned_positions(trained: u32, plan: impl Fn(u32) -> Option<Ledger>) -> u32 {
    let candidates: Vec<u32> = PLANNED_CONTEXTS.iter().map(|&c| c.min(trained)).collect();
    let mut fits = None;
    for &positions in &candidates {
        let Some(ledger) = plan(positions) else { continue };
        let kv = ledger.bytes(Item::KvCache);
        if kv as f64 <= ledger.budget as f64 * KV_SHARE {
            log::info!(
                "context: {positions} positions (the KV cache's {} MiB is within an eighth of the {} MiB budget; --ctx sets it)",
                kv >> 20,
                ledger.budget >> 20
            );
            return positions;
        }
        fits = Some(positions);
    }
    let chosen = fits.unwrap_or(candidates[1]);
    log::info!(
        "context: {chosen} positions (a longer one's KV cache would take over an eighth of the budget; --ctx sets it)"
    );
    chosen
}
