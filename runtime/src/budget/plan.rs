//! Planning a run's memory before loading it: the ledger from the GGUF metadata and a
//! metadata-only llama.cpp context (`no_alloc`: llama.cpp sizes the KV cache and the compute
//! buffers without allocating or reading anything), the automatic expert cache, and the check
//! against the budget with the smallest changes that would fit.

use std::path::Path;

use ggml_sys::{Context, Model, ModelParams, Threads};

use crate::board::resolve::Sourced;
use crate::generate::{context_params, ContextShape, KvCacheType, KvTypes};
use crate::stream::{kernel, DensePolicy, ExpertIndex};
use crate::units::mib;
use sluice_hal::usage::Usage;

use super::ledger::{ExpertLayout, Item, Ledger, LedgerLine};
use super::BudgetError;

/// llama.cpp's own structures beyond its buffers (model and vocabulary metadata, graph
/// bookkeeping, the output logits), the engine's (index, cache slots, lane threads' stacks), and
/// allocator slack, on top of the process's resident size before loading.
pub const OVERHEAD_BYTES: u64 = 32 << 20;

/// What a run asks for.
#[derive(Debug, Clone)]
pub struct PlanRequest<'a> {
    /// The model's first file.
    pub model: &'a Path,
    /// Its expert index.
    pub index: &'a ExpertIndex,
    /// The context: positions needed per slot (prompt plus tokens to generate, or `--ctx`),
    /// slots (`serve --slots`, each with positions of its own) and the prompt batch.
    pub shape: ContextShape,
    /// Where the dense weights live.
    pub dense: DensePolicy,
    /// A fixed expert cache in bytes, or `None` for what the budget leaves.
    pub cache_bytes: Option<u64>,
    /// The budget.
    pub budget: Sourced<u64>,
    /// Layers are offloaded to a GPU (the `cuda` service): a prompt batch's products may run
    /// there, outside the streamed-experts kernel, so its layer's experts are all resident at
    /// once instead of passing through in waves.
    pub gpu: bool,
    /// The layers RPC workers hold (`sluice --rpc`): the ledger is then this board's share
    /// (`index` already keeps only its layers), the workers' shares are in the split.
    pub rpc: Option<&'a ggml_sys::RpcSplit>,
    /// What the front end keeps at most beside the generation (`serve`'s kept responses); a
    /// line of its own when not 0.
    pub kept: u64,
    /// Next-layer reads are guessed (`--lookahead`): the router copies get a line.
    pub lookahead: bool,
}

/// llama.cpp's sizes for one context shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextSizes {
    /// KV cache bytes (on this board).
    pub kv: u64,
    /// Compute buffer bytes (on this board).
    pub compute: u64,
    /// The model's training context length: the most positions a plan may ask for.
    pub n_ctx_train: u32,
    /// With an RPC split, what each worker would hold (weights, KV cache, compute buffers), in
    /// the split's order.
    pub workers: Vec<ggml_sys::MemorySizes>,
}

/// Sizes a context of `shape` over `model` without loading a weight: a metadata-only model
/// and a context over it report what they would allocate. With `streamed` (the model's index),
/// the context is the one a streamed session creates: its routed products run in the
/// streamed-experts kernel, whose workspace then counts in the compute buffers. With `rpc`, the
/// model is split as it says: the sizes are this board's, and each worker's are listed.
pub fn measure_context(
    model: &Path,
    shape: ContextShape,
    streamed: Option<&ExpertIndex>,
    rpc: Option<&ggml_sys::RpcSplit>,
) -> Result<ContextSizes, BudgetError> {
    let m = Model::load(model, &ModelParams { metadata_only: true, rpc: rpc.cloned(), ..Default::default() })?;
    if shape.positions > m.n_ctx_train() {
        return Err(BudgetError::ContextTooLong { positions: shape.positions, n_ctx_train: m.n_ctx_train() });
    }
    let create = || Context::new(&m, &context_params(shape, &Threads::unpinned(1)), None);
    let ctx = match streamed {
        Some(index) => {
            crate::stream::kernel::claiming(index, create).map_err(|e| BudgetError::Kernel(e.to_string()))?.0
        }
        None => create(),
    }?;
    let (s, workers) = match rpc {
        None => (ctx.memory_sizes(), Vec::new()),
        Some(rpc) => (ctx.local_memory_sizes(), rpc.devices.iter().map(|d| ctx.worker_memory_sizes(d)).collect()),
    };
    Ok(ContextSizes { kv: s.context, compute: s.compute, n_ctx_train: m.n_ctx_train(), workers })
}

/// The ledger for `req` given llama.cpp's context sizes and the process's resident bytes
/// before loading.
pub fn ledger(req: &PlanRequest, sizes: &ContextSizes, baseline: u64) -> Ledger {
    let index = req.index;
    let params = context_params(req.shape, &Threads::unpinned(1));
    let dense = dense_line(req);
    let dense_held = if dense.held { dense.bytes } else { 0 };
    let overhead = baseline + OVERHEAD_BYTES;
    let routers = if req.lookahead { index.router_copy_bytes() } else { 0 };
    let fixed = dense_held + sizes.kv + sizes.compute + overhead + req.kept + routers;
    let (cache, staging) = cache_and_staging(req, req.budget.value.saturating_sub(fixed), params.n_batch);
    let mut lines = vec![
        dense,
        LedgerLine {
            item: Item::KvCache,
            bytes: sizes.kv,
            basis: if params.n_seq > 1 {
                format!("llama.cpp's KV cache for {} slots of {} positions", params.n_seq, params.n_ctx / params.n_seq)
            } else {
                format!("llama.cpp's KV cache for {} positions", params.n_ctx)
            },
            held: true,
        },
        LedgerLine {
            item: Item::ComputeBuffers,
            bytes: sizes.compute,
            basis: format!("llama.cpp's graph reservation for batches of {}", params.n_batch),
            held: true,
        },
        staging,
        cache,
        LedgerLine {
            item: Item::RuntimeOverhead,
            bytes: overhead,
            basis: format!(
                "process before loading {:.1} MiB + llama.cpp and engine structures {} MiB",
                mib(baseline),
                OVERHEAD_BYTES >> 20
            ),
            held: true,
        },
    ];
    if routers > 0 {
        let basis = "f32 copies of every streamed layer's router, to guess the next layer's experts".to_string();
        lines.push(LedgerLine { item: Item::LookaheadRouters, bytes: routers, basis, held: true });
    }
    if req.kept > 0 {
        let basis = "serve's responses kept for previous_response_id, at most".to_string();
        lines.push(LedgerLine { item: Item::KeptResponses, bytes: req.kept, basis, held: true });
    }
    let total = lines.iter().filter(|l| l.held).map(|l| l.bytes).sum();
    Ledger {
        model: req.model.display().to_string(),
        n_ctx: params.n_ctx,
        n_batch: params.n_batch,
        batch_basis: String::new(),
        dense: format!("{:?}", req.dense).to_lowercase(),
        lines,
        budget: req.budget.value,
        budget_source: req.budget.source.clone(),
        cache_auto: req.cache_bytes.is_none(),
        one_token_min: index.one_token_demand(),
        all_experts: index.all_expert_window_bytes(),
        total,
        experts: expert_layout(index),
    }
}

/// Where the dense weights live and what of them is held.
fn dense_line(req: &PlanRequest) -> LedgerLine {
    let index = req.index;
    match req.dense {
        DensePolicy::Anon => LedgerLine {
            item: Item::DenseWeights,
            bytes: index.dense_window_bytes(),
            basis: format!("{} tensors read once into anonymous memory (page-aligned windows)", index.dense.len()),
            held: true,
        },
        DensePolicy::Mmap => LedgerLine {
            item: Item::DenseWeights,
            bytes: index.dense_bytes(),
            basis: format!("{} tensors in llama.cpp's file mapping (--dense mmap)", index.dense.len()),
            held: false,
        },
    }
}

/// The expert cache (fixed, or what `room` leaves) and the I/O staging beside it: a layer's
/// routed experts beyond the cache while it computes, or, where the kernel computes every
/// product of a prompt batch of `n_batch`, waves of one token's layer demand.
fn cache_and_staging(req: &PlanRequest, room: u64, n_batch: u32) -> (LedgerLine, LedgerLine) {
    let index = req.index;
    let all = index.all_expert_window_bytes();
    let max_window = index.max_expert_window_bytes();
    let in_flight = u64::from(index.n_expert.min(n_batch.saturating_mul(index.n_expert_used)));
    let working = in_flight * max_window;
    let waves = !req.gpu && index.experts.iter().all(|t| kernel::computes(t.ty, i64::from(n_batch)));
    let wave = if waves { index.layer_token_demand() } else { u64::MAX };
    let (cache, cache_basis) = match req.cache_bytes {
        Some(c) => (c.min(all), format!("--cache-mb {}", c >> 20)),
        None if room >= working || !waves => {
            (room.min(all), "automatic: what the budget leaves, at most all experts".to_string())
        }
        None => (
            room.saturating_sub(wave).min(all),
            "automatic: what the budget leaves beside the staging, at most all experts".to_string(),
        ),
    };
    let staging = working.saturating_sub(cache).min(wave);
    let staging_basis = if staging < working.saturating_sub(cache) {
        format!(
            "a batch's routed experts beyond the cache pass through in waves of one token's largest layer ({:.2} MiB; a whole layer is {in_flight} × {:.2} MiB in a batch of {n_batch})",
            mib(wave),
            mib(max_window),
        )
    } else {
        format!(
            "a layer's routed experts beyond the cache while it computes ({in_flight} × {:.2} MiB in a batch of {n_batch})",
            mib(max_window),
        )
    };
    (
        LedgerLine { item: Item::ExpertCache, bytes: cache, basis: cache_basis, held: true },
        LedgerLine { item: Item::IoStaging, bytes: staging, basis: staging_basis, held: true },
    )
}

/// `index`'s expert layout, for the plan.
fn expert_layout(index: &ExpertIndex) -> ExpertLayout {
    let resident: Vec<_> = index.resident_expert_tensors().collect();
    ExpertLayout {
        arch: index.arch.clone(),
        verified: index.verified,
        n_expert: index.n_expert,
        n_expert_used: index.n_expert_used,
        layers: index.n_layer,
        moe_layers: index.moe_layers().count(),
        streamed_kinds: index.expert_kinds().into_iter().map(String::from).collect(),
        streamed_tensors: index.experts.len(),
        resident_expert_bytes: resident.iter().map(|t| t.size).sum(),
        resident_expert_tensors: resident.into_iter().map(|t| t.name.clone()).collect(),
        not_run_layers: index.nextn_layers,
        not_run_bytes: index.not_run.iter().map(|t| t.size).sum(),
    }
}

/// The process's resident bytes now.
pub(super) fn resident_now() -> u64 {
    let u = Usage::sample();
    u.rss()
}

/// Plans `req` and refuses it when it does not fit: over budget, or an automatic cache below one
/// token's routed demand. The error shows the ledger and the smallest changes that fit.
pub fn plan_within_budget(req: &PlanRequest) -> Result<Ledger, BudgetError> {
    plan_from(req, resident_now())
}

/// [`plan_within_budget`] for a process of `baseline` resident bytes before loading.
pub(super) fn plan_from(req: &PlanRequest, baseline: u64) -> Result<Ledger, BudgetError> {
    let sizes = measure_context(req.model, req.shape, Some(req.index), req.rpc)?;
    let l = ledger(req, &sizes, baseline);
    if acceptable(&l) {
        return Ok(l);
    }
    let fixes = fixes(req, &l, &sizes, baseline)?;
    let fixes = if fixes.is_empty() {
        "none of --cache-mb, --dense mmap or a smaller context is enough: raise the budget (the profile's memory.budget_mib, or the cgroup's limit) or use a smaller model".to_string()
    } else {
        fixes.join("; or ")
    };
    // Within budget but not acceptable: the automatic cache cannot hold one token.
    Err(if l.fits() {
        BudgetError::CacheBelowMinimum {
            cache_mib: mib(l.cache_bytes()),
            min_mib: mib(l.one_token_min),
            ledger: Box::new(l),
            fixes,
        }
    } else {
        BudgetError::OverBudget { total_mib: mib(l.total), budget_mib: mib(l.budget), ledger: Box::new(l), fixes }
    })
}

/// Whether a ledger is acceptable: within budget, and an automatic cache holds one token.
fn acceptable(l: &Ledger) -> bool {
    l.fits() && !(l.cache_auto && l.cache_bytes() < l.one_token_min)
}

/// The changes, smallest first, that make `l` acceptable.
fn fixes(req: &PlanRequest, l: &Ledger, sizes: &ContextSizes, baseline: u64) -> Result<Vec<String>, BudgetError> {
    let mut out = Vec::new();
    // A smaller cache, or none.
    let without_cache = ledger(&PlanRequest { cache_bytes: Some(0), ..req.clone() }, sizes, baseline);
    if without_cache.fits() {
        // The automatic cache is the most that fits beside the fixed lines and the staging.
        let most = ledger(&PlanRequest { cache_bytes: None, ..req.clone() }, sizes, baseline).cache_bytes();
        let cache = if most >= l.one_token_min { most } else { 0 };
        if req.cache_bytes.is_some() && cache > 0 {
            out.push(format!("--cache-mb {} (the most that fits)", cache >> 20));
        } else {
            out.push("--cache-mb 0 (stream every routed expert, no cache)".into());
        }
    }
    // Dense weights in the page cache instead of anonymous memory.
    if req.dense == DensePolicy::Anon {
        let mmap = ledger(&PlanRequest { dense: DensePolicy::Mmap, ..req.clone() }, sizes, baseline);
        if acceptable(&mmap) {
            out.push(format!(
                "--dense mmap (the {:.1} MiB of dense weights stay in the page cache, which the kernel may reclaim and re-read)",
                mib(l.bytes(Item::DenseWeights))
            ));
        }
    }
    // The plan of the same run in another context shape (measured again: llama.cpp sizes it).
    let reshaped = |shape: ContextShape| -> Result<Ledger, BudgetError> {
        let s = measure_context(req.model, shape, Some(req.index), req.rpc)?;
        Ok(ledger(&PlanRequest { shape, ..req.clone() }, &s, baseline))
    };
    // A quantized KV cache at the asked context (lossy: keys and values rounded to its blocks).
    for ty in [KvCacheType::Q8_0, KvCacheType::Q4_0] {
        let kv = KvTypes { k: ty, v: ty };
        if kv == req.shape.kv {
            continue;
        }
        let quantized = reshaped(ContextShape { kv, ..req.shape })?;
        if acceptable(&quantized) {
            out.push(format!(
                "a {name} KV cache (--cache-type-k {name} --cache-type-v {name}: {:.1} MiB instead of {:.1}; lossy)",
                mib(quantized.bytes(Item::KvCache)),
                mib(l.bytes(Item::KvCache)),
                name = ty.name()
            ));
            break;
        }
    }
    // A smaller context: halve until it fits.
    let mut positions = req.shape.positions / 2;
    while positions >= 256 {
        if acceptable(&reshaped(ContextShape { positions, ..req.shape })?) {
            out.push(format!(
                "a context of {positions} positions (--ctx {positions}, or a shorter prompt and fewer tokens)"
            ));
            break;
        }
        positions /= 2;
    }
    // Fewer slots: halve until it fits.
    let mut slots = req.shape.slots / 2;
    while slots >= 1 {
        if acceptable(&reshaped(ContextShape { slots, ..req.shape })?) {
            out.push(format!("{slots} slots (--slots {slots}, or slots = {slots} in the serve settings file)"));
            break;
        }
        slots /= 2;
    }
    Ok(out)
}
