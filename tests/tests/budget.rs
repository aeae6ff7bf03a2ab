//! Memory budget gates: the ledger's arithmetic against numbers worked out by hand from the
//! fixture's spec and its GGUF headers (two fixtures), llama.cpp's metadata-only sizes against a
//! real context's, the refusals with the fixes they offer, what a head split over RPC workers
//! keeps, and the prompt batch chosen from the budget.

use ggml_sys::{Context, GgufFile, Threads};
use sluice::board::resolve::Sourced;
use sluice::budget::{self, BudgetError, Item, PlanRequest, BATCH_CHOICES, OVERHEAD_BYTES};
use sluice::generate::{context_params, load_model, ContextShape};
use sluice::stream::{kernel, DensePolicy, ExpertIndex};
use sluice_hal::storage::Medium;
use sluice_tests::Fixture;

const PAGE: u64 = 4096;

fn budget(mib: u64) -> Sourced<u64> {
    Sourced { value: mib << 20, source: "test".into() }
}

/// Σ page windows of the tensors `keep` selects, from the GGUF header.
fn windows(g: &GgufFile, keep: impl Fn(&str) -> bool) -> u64 {
    g.tensors()
        .iter()
        .filter(|t| keep(&t.name))
        .map(|t| (t.offset + t.size).div_ceil(PAGE) * PAGE - t.offset / PAGE * PAGE)
        .sum()
}

#[test]
fn the_ledger_adds_up_for_two_fixtures() {
    let dir = tempfile::tempdir().unwrap();
    for fixture in [Fixture::F16, Fixture::Q8_0] {
        let spec = fixture.spec();
        let files = fixture.write(dir.path());
        let g = GgufFile::open(&files[0]).unwrap();
        let index = ExpertIndex::open(&files[0]).unwrap();

        // By hand: dense windows, the F16 KV cache, one layer's experts in a batch.
        let dense = windows(&g, |n| !n.contains("_exps."));
        let positions = 300; // rounds up to a 512-position context, batches of 512
        let head_dim = u64::from(spec.embd / spec.heads);
        let kv = 512 * u64::from(spec.layers) * 2 * u64::from(spec.kv_heads) * head_dim * 2;
        let slice = |name: &str, e: u64| {
            let t = g.tensors().iter().find(|t| t.name == name).unwrap();
            let stride = t.size / u64::from(spec.experts);
            let start = t.offset + e * stride;
            (start + stride).div_ceil(PAGE) * PAGE - start / PAGE * PAGE
        };
        let expert = |l: u64, e: u64| {
            ["gate", "up", "down"].iter().map(|k| slice(&format!("blk.{l}.ffn_{k}_exps.weight"), e)).sum::<u64>()
        };
        let max_expert = (0..u64::from(spec.layers))
            .flat_map(|l| (0..u64::from(spec.experts)).map(move |e| (l, e)))
            .map(|(l, e)| expert(l, e))
            .max()
            .unwrap();
        // One token's demand: in every layer, its experts_used largest experts.
        let per_layer: Vec<u64> = (0..u64::from(spec.layers))
            .map(|l| {
                let mut w: Vec<u64> = (0..u64::from(spec.experts)).map(|e| expert(l, e)).collect();
                w.sort_unstable_by(|a, b| b.cmp(a));
                w.iter().take(spec.experts_used as usize).sum::<u64>()
            })
            .collect();
        let demand: u64 = per_layer.iter().sum();
        // A prompt batch's experts beyond the cache pass through in waves of the largest layer's
        // share of that demand.
        let wave = *per_layer.iter().max().unwrap();
        let all_experts: u64 = (0..u64::from(spec.layers))
            .flat_map(|l| (0..u64::from(spec.experts)).map(move |e| (l, e)))
            .map(|(l, e)| expert(l, e))
            .sum();
        let working = u64::from(spec.experts.min(512 * spec.experts_used)) * max_expert;

        // llama.cpp's metadata-only sizes equal those of a real, allocated context.
        let sizes =
            budget::measure_context(&files[0], sluice::generate::ContextShape::one(positions), Some(&index), None)
                .unwrap();
        assert_eq!(sizes.kv, kv, "{fixture:?}: KV cache");
        let model = load_model(&files[0]).unwrap();
        let create = || {
            Context::new(
                &model,
                &context_params(sluice::generate::ContextShape::one(positions), &Threads::unpinned(1)),
                None,
            )
            .unwrap()
        };
        let (real, claim) = kernel::claiming(&index, create).unwrap();
        let real = real.memory_sizes();
        assert_eq!((real.context, real.compute), (sizes.kv, sizes.compute), "{fixture:?}: dry run vs real context");
        // The compute line holds the streamed-experts kernel's workspace as llama.cpp reports it:
        // the same context with ggml's own kernels is smaller by exactly what the kernel asked.
        assert_eq!(claim.found.len(), index.experts.len(), "{fixture:?}: the kernel took every expert tensor");
        assert!(claim.workspace > 0, "{fixture:?}");
        let native =
            budget::measure_context(&files[0], sluice::generate::ContextShape::one(positions), None, None).unwrap();
        assert_eq!(native.compute + claim.workspace as u64, sizes.compute, "{fixture:?}: compute line");
        assert_eq!(create().memory_sizes().compute, native.compute, "{fixture:?}: a resident context");

        let baseline = 10 << 20;
        let req = PlanRequest {
            model: &files[0],
            index: &index,
            shape: sluice::generate::ContextShape::one(positions),
            dense: DensePolicy::Anon,
            cache_bytes: None,
            budget: budget(64),
            gpu: false,
            rpc: None,
            kept: 0,
            lookahead: false,
        };
        let l = budget::ledger(&req, &sizes, baseline);
        let fixed = dense + kv + sizes.compute + baseline + OVERHEAD_BYTES;
        let cache = ((64 << 20) - fixed).min(all_experts);
        assert_eq!(l.bytes(Item::DenseWeights), dense, "{fixture:?}");
        assert_eq!(l.bytes(Item::KvCache), kv);
        assert_eq!(l.bytes(Item::ComputeBuffers), sizes.compute);
        assert_eq!(l.bytes(Item::ExpertCache), cache, "{fixture:?}: the cache gets what the budget leaves");
        assert_eq!(l.bytes(Item::IoStaging), working.saturating_sub(cache));
        assert_eq!(l.bytes(Item::RuntimeOverhead), baseline + OVERHEAD_BYTES);
        assert_eq!(l.total, fixed + cache + working.saturating_sub(cache));
        assert_eq!(l.one_token_min, demand);
        assert!(demand <= u64::from(spec.layers * spec.experts_used) * max_expert && demand <= all_experts);
        assert_eq!(l.all_experts, all_experts);
        assert_eq!((l.n_ctx, l.n_batch), (512, 512));

        // A fixed cache is taken as given; --dense mmap leaves the dense weights out of the total.
        let fixed_cache = budget::ledger(&PlanRequest { cache_bytes: Some(1 << 20), ..req.clone() }, &sizes, baseline);
        assert_eq!(fixed_cache.bytes(Item::ExpertCache), 1 << 20);
        assert_eq!(fixed_cache.bytes(Item::IoStaging), working.saturating_sub(1 << 20).min(wave), "{fixture:?}: waves");
        assert!(wave < working, "{fixture:?}: a batch's layer is more than one wave");
        // The lookahead's router copies: a line of their own (f32 weights and bias of every
        // streamed layer's router), taken from what the cache would get.
        let routers = index.router_copy_bytes();
        let n_embd = u64::from(spec.embd);
        let moe_layers = index.moe_layers().count() as u64;
        assert!(routers >= moe_layers * u64::from(spec.experts) * n_embd * 4, "{fixture:?}: {routers} bytes");
        let ahead = budget::ledger(&PlanRequest { lookahead: true, ..req.clone() }, &sizes, baseline);
        assert_eq!(ahead.bytes(Item::LookaheadRouters), routers, "{fixture:?}");
        assert_eq!(ahead.bytes(Item::ExpertCache), ((64 << 20) - fixed - routers).min(all_experts), "{fixture:?}");
        assert_eq!(l.bytes(Item::LookaheadRouters), 0, "{fixture:?}: no line without the lookahead");
        let mmap = budget::ledger(&PlanRequest { dense: DensePolicy::Mmap, ..req.clone() }, &sizes, baseline);
        assert_eq!(mmap.total + dense, fixed + mmap.bytes(Item::ExpertCache).max(working));
        assert_eq!(mmap.bytes(Item::DenseWeights), index.dense_bytes());

        // A budget that leaves less than a whole layer beside the fixed lines: the automatic
        // cache leaves room for one wave, and the total is the budget. Offloaded to a GPU,
        // prompt batches do not pass through the kernel: the layer would have to be whole.
        let tight = Sourced { value: fixed + (working + wave) / 2, source: "test".into() };
        let l = budget::ledger(&PlanRequest { budget: tight.clone(), ..req.clone() }, &sizes, baseline);
        assert_eq!(l.bytes(Item::IoStaging), wave, "{fixture:?}");
        assert_eq!(l.bytes(Item::ExpertCache), (working + wave) / 2 - wave);
        assert_eq!(l.total, tight.value);
        assert!(l.lines.iter().any(|x| x.basis.contains("waves")), "{}", l.describe());
        // What serve keeps of its answers is a line of its own, taken from the cache.
        let kept = 64 << 10;
        let serving = budget::ledger(&PlanRequest { budget: tight.clone(), kept, ..req.clone() }, &sizes, baseline);
        assert_eq!(serving.bytes(Item::KeptResponses), kept);
        assert_eq!(serving.bytes(Item::ExpertCache), l.bytes(Item::ExpertCache) - kept);
        assert_eq!(serving.total, tight.value);
        let gpu = budget::ledger(&PlanRequest { budget: tight.clone(), gpu: true, ..req.clone() }, &sizes, baseline);
        assert_eq!(gpu.bytes(Item::IoStaging) + gpu.bytes(Item::ExpertCache), working);
        assert!(!gpu.fits(), "{fixture:?}");
    }
}

fn refusal(req: &PlanRequest) -> (String, BudgetError) {
    let e = budget::plan_within_budget(req).expect_err("the plan should be refused");
    (e.to_string(), e)
}

#[test]
fn plans_over_budget_are_refused_with_the_ledger_and_what_fits() {
    let dir = tempfile::tempdir().unwrap();
    // Sixteen layers: the KV cache grows by megabytes with the context, and one token needs
    // 16 × top-2 experts, far more than the 8 experts a prompt batch can hold at once.
    let deep = sluice::synth::SynthSpec { layers: 16, ..Fixture::F16.spec() };
    let path = dir.path().join("deep.gguf");
    sluice::synth::synthesize(&deep, &path, 2).unwrap();
    let index = ExpertIndex::open(&path).unwrap();
    let base = PlanRequest {
        model: &path,
        index: &index,
        shape: sluice::generate::ContextShape::one(256),
        dense: DensePolicy::Anon,
        cache_bytes: None,
        budget: budget(4096),
        gpu: false,
        rpc: None,
        kept: 0,
        lookahead: false,
    };
    let roomy = budget::plan_within_budget(&base).unwrap();
    assert!(
        roomy.fits() && roomy.cache_bytes() == index.all_expert_window_bytes(),
        "a roomy budget caches every expert"
    );
    let baseline = roomy.bytes(Item::RuntimeOverhead) - OVERHEAD_BYTES;

    // A context too big for the budget: the fix is a smaller context.
    let sizes = |p| budget::measure_context(&path, sluice::generate::ContextShape::one(p), Some(&index), None).unwrap();
    let no_cache = PlanRequest { cache_bytes: Some(0), ..base.clone() };
    let small = budget::ledger(&no_cache, &sizes(256), baseline).total;
    let big = budget::ledger(
        &PlanRequest { shape: sluice::generate::ContextShape::one(4096), ..no_cache.clone() },
        &sizes(4096),
        baseline,
    )
    .total;
    assert!(big > small + (8 << 20), "{small} {big}");
    let req = PlanRequest {
        shape: sluice::generate::ContextShape::one(4096),
        budget: Sourced { value: (small + big) / 2, source: "test".into() },
        ..no_cache
    };
    let (msg, e) = refusal(&req);
    assert!(matches!(e, BudgetError::OverBudget { .. }), "{msg}");
    for needle in ["more than the budget", "KV cache", "total held", "fits with:", "a context of", "--ctx"] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    // A budget that an 8-bit KV cache fits at the asked context and f16 does not: the refusal
    // names those types.
    let q8_0 = sluice::generate::KvCacheType::Q8_0;
    let eight_bit = sluice::generate::ContextShape {
        kv: sluice::generate::KvTypes { k: q8_0, v: q8_0 },
        ..sluice::generate::ContextShape::one(4096)
    };
    let sizes_q8 = budget::measure_context(&path, eight_bit, Some(&index), None).unwrap();
    let q8_total = budget::ledger(&PlanRequest { shape: eight_bit, ..req.clone() }, &sizes_q8, baseline).total;
    assert!(q8_total < big, "{q8_total} {big}");
    // Midway: the process's size, which the plan measures again, moves by less than that.
    let between = (q8_total + big) / 2;
    let (msg, _) = refusal(&PlanRequest { budget: Sourced { value: between, source: "test".into() }, ..req.clone() });
    assert!(msg.contains("a q8_0 KV cache (--cache-type-k q8_0 --cache-type-v q8_0: "), "{msg}");
    let too_long = budget::plan_within_budget(&PlanRequest {
        shape: sluice::generate::ContextShape::one(100_000),
        ..base.clone()
    })
    .unwrap_err();
    assert!(too_long.to_string().contains("more than the model's context length 4096"), "{too_long}");

    // A budget that leaves the automatic cache less than one token's routed demand.
    let working = u64::from(deep.experts) * index.max_expert_window_bytes();
    assert!(working < roomy.one_token_min);
    let tight = roomy.total - roomy.cache_bytes() + (working + roomy.one_token_min) / 2;
    let req = PlanRequest { budget: Sourced { value: tight, source: "test".into() }, ..base.clone() };
    let (msg, e) = refusal(&req);
    assert!(matches!(e, BudgetError::CacheBelowMinimum { .. }), "{msg}");
    for needle in ["below one token's routed demand", "expert cache", "--cache-mb 0"] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
}

#[test]
fn a_head_split_over_workers_plans_only_the_layers_it_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Fixture::Deepseek2;
    let files = fixture.write(dir.path());
    let g = GgufFile::open(&files[0]).unwrap();
    let full = ExpertIndex::open(&files[0]).unwrap();
    let (layer_bytes, output) = full.layer_weight_bytes();
    // By hand from the header: each layer's tensors, and the output layer's.
    let of_layer = |l: usize| tensor_bytes(&g, |n| n.starts_with(&format!("blk.{l}.")));
    for (l, &b) in layer_bytes.iter().enumerate() {
        assert_eq!(b, of_layer(l), "layer {l}");
    }
    assert_eq!(output, tensor_bytes(&g, |n| n.starts_with("output")));
    let first_remote = 2;
    // Layer 2's one-token demand (its k largest expert windows) leaves with it.
    let mut layer2: Vec<u64> = (0..full.n_expert).map(|e| full.expert_window_bytes(2, e)).collect();
    layer2.sort_unstable_by(|a, b| b.cmp(a));
    let kept_demand = full.one_token_demand() - layer2.iter().take(full.experts_used(2) as usize).sum::<u64>();
    let head = full.keep_layers_below(first_remote);
    assert!(head.experts.iter().all(|t| t.layer < first_remote) && !head.experts.is_empty());
    assert_eq!(head.moe_layers().collect::<Vec<_>>(), vec![1], "layer 0 is dense, 1 is kept");
    assert_eq!(head.one_token_demand(), kept_demand);
    assert!(head.dense.iter().all(|t| !t.name.starts_with("output") && !t.name.starts_with("blk.2.")));
    assert!(
        head.remote.iter().any(|t| t.name == "output.weight")
            && head.remote.iter().any(|t| t.name.starts_with("blk.2."))
    );
    assert!(
        head.expert_by_name("blk.2.ffn_up_exps.weight").is_none()
            && head.expert_by_name("blk.1.ffn_up_exps.weight").is_some()
    );
}

/// Σ exact sizes of the tensors `keep` selects, from the GGUF header.
fn tensor_bytes(g: &GgufFile, keep: impl Fn(&str) -> bool) -> u64 {
    g.tensors().iter().filter(|t| keep(&t.name)).map(|t| t.size).sum()
}

/// `--batch auto`: the largest prompt batch whose plan fits and keeps the storage's share of
/// batch 512's expert cache. Checked against that rule applied by hand to each batch's ledger,
/// over a sweep of budgets, on SD and on NVMe storage; a slot's positions cap the batch.
#[test]
fn the_prompt_batch_from_the_budget_is_the_largest_that_keeps_enough_of_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    // 96 MiB of experts: a cache that a larger batch's compute buffers can halve.
    let wide = sluice::synth::SynthSpec { layers: 16, expert_ff: 512, ..Fixture::F16.spec() };
    let path = dir.path().join("wide.gguf");
    sluice::synth::synthesize(&wide, &path, 2).unwrap();
    let files = [path];
    let index = ExpertIndex::open(&files[0]).unwrap();
    let shape = |positions, batch| ContextShape { positions, slots: 1, batch, kv: Default::default() };
    let base = PlanRequest {
        model: &files[0],
        index: &index,
        shape: shape(4096, 512),
        dense: DensePolicy::Anon,
        cache_bytes: None,
        budget: budget(8192),
        gpu: false,
        rpc: None,
        kept: 0,
        lookahead: false,
    };
    let roomy = budget::plan_within_budget(&base).unwrap();
    let baseline = roomy.bytes(Item::RuntimeOverhead) - OVERHEAD_BYTES;
    let sizes: Vec<_> = BATCH_CHOICES
        .iter()
        .map(|&b| budget::measure_context(&files[0], shape(4096, b), Some(&index), None).unwrap())
        .collect();
    // The rule by hand for a budget and a process size: 0 where even batch 512 is refused.
    let by_hand = |budget_bytes: u64, baseline: u64, medium: Medium| -> u32 {
        let at = Sourced { value: budget_bytes, source: "test".into() };
        let ledgers: Vec<_> = BATCH_CHOICES
            .iter()
            .zip(&sizes)
            .map(|(&b, s)| {
                budget::ledger(&PlanRequest { shape: shape(4096, b), budget: at.clone(), ..base.clone() }, s, baseline)
            })
            .collect();
        let runs = |l: &budget::Ledger| l.fits() && l.cache_bytes() >= l.one_token_min;
        if !runs(&ledgers[0]) {
            return 0;
        }
        let floor = ledgers[0].cache_bytes() * budget::cache_kept_pct(medium) / 100;
        let kept = ledgers.iter().skip(1).take_while(|l| runs(l) && l.cache_bytes() >= floor).count();
        BATCH_CHOICES[kept]
    };
    let widest = budget::ledger(&PlanRequest { shape: shape(4096, 2048), ..base.clone() }, &sizes[2], baseline);
    let (low, high) = (roomy.total - roomy.cache_bytes() - (16 << 20), widest.total + (16 << 20));
    let margin = 2 << 20; // the process grows a little between plans
    let mut seen = std::collections::BTreeSet::new();
    let mut sd_larger = false;
    for step in 0..=48 {
        let b = low + (high - low) * step / 48;
        let baseline = budget::plan_within_budget(&base).unwrap().bytes(Item::RuntimeOverhead) - OVERHEAD_BYTES;
        let mut chose = Vec::new();
        for medium in [Medium::Sd, Medium::Nvme] {
            let expected = by_hand(b, baseline + margin, medium);
            if expected != by_hand(b, baseline.saturating_sub(margin), medium) {
                continue; // too near a threshold to tell
            }
            let req = PlanRequest { budget: Sourced { value: b, source: "test".into() }, ..base.clone() };
            let chosen = match budget::plan_batch_from_budget(&req, medium) {
                Ok(l) => {
                    assert!(l.describe().contains(&format!("prompt batch {}: from the budget", l.n_batch)));
                    l.n_batch
                }
                Err(e) => {
                    assert!(e.ledger().is_some(), "a refusal with its ledger: {e}");
                    0
                }
            };
            assert_eq!(chosen, expected, "{medium:?} at a budget of {:.1} MiB", b as f64 / f64::from(1 << 20));
            seen.insert((medium.name(), chosen));
            chose.push(chosen);
        }
        sd_larger |= matches!(chose[..], [sd, nvme] if sd > nvme && nvme > 0);
    }
    for (medium, batch) in [("nvme", 0), ("nvme", 512), ("nvme", 2048), ("sd", 2048)] {
        assert!(seen.contains(&(medium, batch)), "no budget gave {medium} batch {batch}: {seen:?}");
    }
    assert!(sd_larger, "at some budget SD storage takes a larger batch than NVMe, which keeps its cache: {seen:?}");

    // A slot of 600 positions (768 in the context) takes no batch beyond them.
    let short = PlanRequest { shape: shape(600, 512), ..base.clone() };
    let l = budget::plan_batch_from_budget(&short, Medium::Nvme).unwrap();
    assert_eq!(l.n_batch, 768, "{}", l.describe());
    assert!(l.batch_basis.contains("768 positions take no larger batch"), "{}", l.batch_basis);
}
