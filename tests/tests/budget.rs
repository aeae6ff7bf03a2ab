//! Memory budget gates: the ledger's arithmetic against numbers worked out by hand from the
//! fixture's spec and its GGUF headers (two fixtures), llama.cpp's metadata-only sizes against a
//! real context's, and the refusals with the fixes they offer.

use ggml_sys::{Context, GgufFile, Threads};
use sluice::board::resolve::Sourced;
use sluice::budget::{self, BudgetError, ContextSizes, Item, PlanRequest, OVERHEAD_BYTES};
use sluice::generate::{context_params, load_model};
use sluice::stream::{DensePolicy, ExpertIndex};
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
        let max_expert = (0..u64::from(spec.layers))
            .flat_map(|l| (0..u64::from(spec.experts)).map(move |e| (l, e)))
            .map(|(l, e)| {
                ["gate", "up", "down"].iter().map(|k| slice(&format!("blk.{l}.ffn_{k}_exps.weight"), e)).sum::<u64>()
            })
            .max()
            .unwrap();
        let all_experts: u64 = (0..u64::from(spec.layers))
            .flat_map(|l| (0..u64::from(spec.experts)).map(move |e| (l, e)))
            .map(|(l, e)| {
                ["gate", "up", "down"].iter().map(|k| slice(&format!("blk.{l}.ffn_{k}_exps.weight"), e)).sum::<u64>()
            })
            .sum();
        let working = u64::from(spec.experts.min(512 * spec.experts_used)) * max_expert;

        // llama.cpp's metadata-only sizes equal those of a real, allocated context.
        let sizes = budget::measure_context(&files[0], positions).unwrap();
        assert_eq!(sizes.kv, kv, "{fixture:?}: KV cache");
        let model = load_model(&files[0]).unwrap();
        let real =
            Context::new(&model, &context_params(positions, &Threads::unpinned(1)), None).unwrap().memory_sizes();
        assert_eq!((real.context, real.compute), (sizes.kv, sizes.compute), "{fixture:?}: dry run vs real context");

        let baseline = 10 << 20;
        let req = PlanRequest {
            model: &files[0],
            index: &index,
            positions,
            dense: DensePolicy::Anon,
            cache_bytes: None,
            budget: budget(64),
        };
        let l = budget::ledger(&req, sizes, baseline);
        let fixed = dense + kv + sizes.compute + baseline + OVERHEAD_BYTES;
        let cache = ((64 << 20) - fixed).min(all_experts);
        assert_eq!(l.bytes(Item::DenseWeights), dense, "{fixture:?}");
        assert_eq!(l.bytes(Item::KvCache), kv);
        assert_eq!(l.bytes(Item::ComputeBuffers), sizes.compute);
        assert_eq!(l.bytes(Item::ExpertCache), cache, "{fixture:?}: the cache gets what the budget leaves");
        assert_eq!(l.bytes(Item::IoStaging), working.saturating_sub(cache));
        assert_eq!(l.bytes(Item::RuntimeOverhead), baseline + OVERHEAD_BYTES);
        assert_eq!(l.total, fixed + cache + working.saturating_sub(cache));
        assert_eq!(l.one_token_min, u64::from(spec.layers * spec.experts_used) * max_expert);
        assert_eq!(l.all_experts, all_experts);
        assert_eq!((l.n_ctx, l.n_batch), (512, 512));

        // A fixed cache is taken as given; --dense mmap leaves the dense weights out of the total.
        let fixed_cache = budget::ledger(&PlanRequest { cache_bytes: Some(1 << 20), ..req.clone() }, sizes, baseline);
        assert_eq!(fixed_cache.bytes(Item::ExpertCache), 1 << 20);
        assert_eq!(fixed_cache.bytes(Item::IoStaging), working.saturating_sub(1 << 20));
        let mmap = budget::ledger(&PlanRequest { dense: DensePolicy::Mmap, ..req.clone() }, sizes, baseline);
        assert_eq!(mmap.total + dense, fixed + mmap.bytes(Item::ExpertCache).max(working));
        assert_eq!(mmap.bytes(Item::DenseWeights), index.dense_bytes());
    }
}

fn refusal(req: &PlanRequest) -> (String, BudgetError) {
    let e = budget::plan_within_budget(req).expect_err("the plan should be refused");
    (e.to_string(), e)
}

#[test]
fn plans_over_budget_are_refused_with_the_ledger_and_what_fits() {
    let dir = tempfile::tempdir().unwrap();
    let files = Fixture::F16.write(dir.path());
    let index = ExpertIndex::open(&files[0]).unwrap();
    let base = PlanRequest {
        model: &files[0],
        index: &index,
        positions: 256,
        dense: DensePolicy::Anon,
        cache_bytes: None,
        budget: budget(4096),
    };
    let fits = budget::plan_within_budget(&base).unwrap();
    assert!(fits.fits() && fits.cache_bytes() == index.all_expert_window_bytes(), "a roomy budget caches every expert");

    // A context too big for the budget: the fix is a smaller context.
    let sizes = |p| budget::measure_context(&files[0], p).unwrap();
    let small: ContextSizes = sizes(256);
    let big_positions = 32768;
    let big = sizes(big_positions);
    assert!(big.kv > 8 * small.kv);
    let room = big.kv / 2 + small.kv + small.compute + (64 << 20);
    let req = PlanRequest {
        positions: big_positions,
        budget: Sourced { value: room, source: "test".into() },
        ..base.clone()
    };
    let (msg, e) = refusal(&req);
    assert!(matches!(e, BudgetError::OverBudget { .. }), "{msg}");
    for needle in ["more than the budget", "KV cache", "total held", "fits with:", "a context of", "--ctx"] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }

    // A budget that leaves the automatic cache less than one token's routed demand. With eight
    // layers one token needs 8 × top-2 experts, more than the 8 experts a prompt batch can hold.
    let deep = sluice::synth::SynthSpec { layers: 8, ..Fixture::F16.spec() };
    let deep_path = dir.path().join("deep.gguf");
    sluice::synth::synthesize(&deep, &deep_path, 2).unwrap();
    let deep_index = ExpertIndex::open(&deep_path).unwrap();
    let deep_base = PlanRequest { model: &deep_path, index: &deep_index, ..base.clone() };
    let l = budget::plan_within_budget(&deep_base).unwrap();
    let working = u64::from(deep.experts) * deep_index.max_expert_window_bytes();
    assert!(working < l.one_token_min);
    let tight = l.total - l.cache_bytes() + (working + l.one_token_min) / 2;
    let req = PlanRequest { budget: Sourced { value: tight, source: "test".into() }, ..deep_base.clone() };
    let (msg, e) = refusal(&req);
    assert!(matches!(e, BudgetError::CacheBelowMinimum { .. }), "{msg}");
    for needle in ["below one token's routed demand", "expert cache", "--cache-mb 0"] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    // That fix does fit.
    budget::plan_within_budget(&PlanRequest { cache_bytes: Some(0), ..req }).unwrap();
}
