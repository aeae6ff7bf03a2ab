use super::*;

fn plan(c: &mut ExpertCache, layer: u32, ids: &[u32]) -> LayerPlan {
    let mut p = LayerPlan::with_capacity(8);
    c.plan_layer(layer, ids, &mut p, None);
    p
}

#[test]
fn unbounded_cache_reads_each_expert_once() {
    let mut c = ExpertCache::new(CachePolicy::Lru, 2, 4, u64::MAX, |_, _| 10);
    assert_eq!(plan(&mut c, 0, &[1, 2]).load, vec![1, 2]);
    assert_eq!(plan(&mut c, 1, &[0]).load, vec![0]);
    assert!(plan(&mut c, 0, &[2, 1]).load.is_empty());
    assert_eq!(c.counters(), CacheCounters { hits: 2, misses: 3, evictions: 0, rereads: 0 });
    assert_eq!(c.used(), 30);
}

#[test]
fn zero_budget_keeps_only_the_current_layer() {
    let mut c = ExpertCache::new(CachePolicy::Lru, 2, 4, 0, |_, _| 10);
    plan(&mut c, 0, &[1, 2]);
    let p = plan(&mut c, 1, &[1]);
    assert_eq!(p.load, vec![1]);
    assert_eq!(p.evict.len(), 2);
    assert!(p.evict.contains(&(0, 1)) && p.evict.contains(&(0, 2)));
    let p = plan(&mut c, 0, &[1]);
    assert_eq!(p.load, vec![1], "with no cache every routed expert is read every time");
    assert_eq!(c.counters().rereads, 1);
    assert_eq!(c.used(), 10);
}

#[test]
fn lru_evicts_the_coldest_and_never_the_current_layer() {
    let mut c = ExpertCache::new(CachePolicy::Lru, 2, 4, 30, |_, _| 10);
    plan(&mut c, 0, &[0, 1, 2]);
    plan(&mut c, 0, &[0]); // 0 is now the most recent; 1 is the coldest
    let p = plan(&mut c, 1, &[3]);
    assert_eq!(p.evict, vec![(0, 1)]);
    // A layer needing more than the budget keeps all it needs.
    let p = plan(&mut c, 1, &[0, 1, 2, 3]);
    assert_eq!(p.load, vec![0, 1, 2]);
    assert!(p.evict.iter().all(|&(l, _)| l == 0));
    assert!(c.used() >= 40);
    assert!((0..4).all(|e| c.is_resident(1, e)));
}

#[test]
fn a_layer_beyond_budget_and_staging_passes_the_rest_through() {
    let mut c = ExpertCache::new(CachePolicy::Lru, 2, 8, 30, |_, _| 10);
    plan(&mut c, 0, &[0]);
    let mut p = LayerPlan::with_capacity(8);
    // Within the budget plus 20 of staging: everything stays, as without a bound.
    c.plan_layer(1, &[0, 1, 2, 3, 4], &mut p, Some(20));
    assert_eq!((p.load.len(), p.pass.len()), (5, 0));
    assert_eq!(c.used(), 50);
    // Seven misses need 70 beyond the budget's 30: three are kept, four pass through.
    c.plan_layer(0, &[7, 6, 5, 4, 3, 2, 1], &mut p, Some(20));
    assert_eq!(p.load, vec![7, 6, 5]);
    assert_eq!(p.pass, vec![4, 3, 2, 1]);
    assert_eq!(p.evict.len(), 5, "the other layer's experts went first");
    assert_eq!(c.used(), 30);
    assert!(!c.is_resident(0, 4) && c.is_resident(0, 5));
    assert_eq!(c.counters().misses, 13, "passed experts count as misses");
    // Hits stay resident even when they alone exceed the budget.
    c.set_budget(10);
    c.plan_layer(0, &[5, 6, 7, 0], &mut p, Some(0));
    assert_eq!((p.load.len(), p.pass, c.used()), (0, vec![0], 30));
}

#[test]
fn admitted_experts_fit_the_budget_and_are_evicted_hottest_last() {
    let mut c = ExpertCache::new(CachePolicy::Lru, 2, 4, 30, |_, _| 10);
    assert!(c.admit(0, 1));
    assert!(c.admit(1, 2));
    assert!(!c.admit(1, 2), "already resident");
    assert!(c.admit(0, 3));
    assert!(!c.admit(1, 0), "over the budget: admitting never evicts");
    assert_eq!(c.used(), 30);
    assert_eq!(c.counters(), CacheCounters::default());
    // A hit on an admitted expert; a miss then evicts the coldest: the last admitted.
    assert!(plan(&mut c, 0, &[1]).load.is_empty());
    let p = plan(&mut c, 1, &[0]);
    assert_eq!(p.evict, vec![(0, 3)]);
}

#[test]
fn shrinking_the_budget_evicts_on_the_next_layer() {
    let mut c = ExpertCache::new(CachePolicy::Lru, 2, 4, 100, |_, _| 10);
    plan(&mut c, 0, &[0, 1, 2, 3]);
    c.set_budget(20);
    let p = plan(&mut c, 1, &[0]);
    assert_eq!(p.evict.len(), 3);
    assert_eq!(c.used(), 20);
}

#[test]
fn frequency_keeps_the_often_routed_over_the_recent() {
    // 64 layers, of which only layer 0 is routed: a half-life is 256 plans, so over these ten
    // the weights hardly decay and uses decide.
    let mut c = ExpertCache::new(CachePolicy::Frequency, 64, 8, 30, |_, _| 10);
    for _ in 0..3 {
        plan(&mut c, 0, &[0]);
    }
    plan(&mut c, 0, &[1]);
    plan(&mut c, 0, &[2]);
    plan(&mut c, 0, &[2]);
    // Full: 0 routed three times, 2 twice, 1 once. LRU would evict 0; frequency evicts 1,
    // then the newcomer that came after it.
    assert_eq!(plan(&mut c, 0, &[3]).evict, vec![(0, 1)]);
    assert_eq!(plan(&mut c, 0, &[4]).evict, vec![(0, 3)]);
    // Routed once more, 4 ties with 2 at two uses: the older (2) goes.
    assert!(plan(&mut c, 0, &[4]).load.is_empty());
    assert_eq!(plan(&mut c, 0, &[5]).evict, vec![(0, 2)]);
    assert!(c.is_resident(0, 0) && c.is_resident(0, 4));
}

#[test]
fn frequency_ages_out_an_expert_no_longer_routed() {
    // One layer: a half-life is 4 plans. Expert 0 is routed in plans 1-3, weighing
    // 2^(1/4) + 2^(2/4) + 2^(3/4) = 4.29; then plan 3 + e routes newcomer e once, weighing
    // 2^((3 + e)/4). Newcomer e finds 0 and e - 1 resident, and 0 goes once e - 1 outweighs it:
    // 2^((2 + e)/4) > 4.29 from e = 7 (2^(9/4) = 4.76).
    let mut c = ExpertCache::new(CachePolicy::Frequency, 1, 512, 20, |_, _| 10);
    for _ in 0..3 {
        plan(&mut c, 0, &[0]);
    }
    let mut gone = None;
    for e in 1..30 {
        if plan(&mut c, 0, &[e]).evict.contains(&(0, 0)) {
            gone = Some(e);
            break;
        }
    }
    assert_eq!(gone, Some(7), "the three early uses of 0 are outweighed by the sixth newcomer");
}

#[test]
fn every_policy_keeps_what_the_layer_needs_and_counts_alike() {
    for policy in CachePolicy::ALL {
        let mut c = ExpertCache::new(policy, 2, 4, 20, |_, _| 10);
        plan(&mut c, 0, &[0, 1]);
        let p = plan(&mut c, 1, &[0, 1, 2]);
        assert_eq!((p.load.len(), p.evict.len()), (3, 2), "{policy}");
        assert!((0..3).all(|e| c.is_resident(1, e)), "{policy}");
        assert_eq!(c.counters(), CacheCounters { hits: 0, misses: 5, evictions: 2, rereads: 0 }, "{policy}");
    }
}

#[test]
fn admission_keeps_out_what_ranks_below_its_victim_and_evicts_what_ranks_below_it() {
    // Keys (score, stamp): entries 1..=3 resident at keys 10, 20 and 30 (entry 3 pinned); the
    // misses rank 25 and 5, each 10 bytes, with 10 bytes of room short.
    let order: BTreeSet<(Key, u32)> = [((10, 0), 1), ((20, 0), 2), ((30, 0), 3)].into();
    let a = adaptive::admit(&order, |i| i == 3, vec![((5, 0), 8), ((25, 0), 9)], -10, |_| 10);
    // 9 outranks 1 and 2: both go (10 short, then room for 9). 8 ranks below 3, the only one
    // left and pinned anyway: it passes through.
    assert_eq!((a.admitted, a.passed, a.evicted), (vec![9], vec![8], vec![1, 2]));
    // With room, nothing is evicted and both stay.
    let a = adaptive::admit(&order, |_| false, vec![((5, 0), 8), ((25, 0), 9)], 20, |_| 10);
    assert_eq!((a.admitted, a.passed, a.evicted), (vec![9, 8], vec![], vec![]));
}

#[test]
fn adaptive_passes_a_newcomer_through_then_follows_the_text_to_its_new_experts() {
    // One layer (a decode is one plan), room for three: 0, 1 and 2 routed together for twenty
    // decodes, then 3, 4 and 5 for twenty.
    let mut c = ExpertCache::new(CachePolicy::Adaptive, 1, 8, 30, |_, _| 10);
    let plan_staged = |c: &mut ExpertCache, ids: &[u32]| {
        let mut p = LayerPlan::default();
        c.plan_layer(0, ids, &mut p, Some(0));
        p
    };
    for _ in 0..20 {
        plan_staged(&mut c, &[0, 1, 2]);
    }
    // The newcomers rank below twenty decodes of use: read, used and given back.
    let p = plan_staged(&mut c, &[3, 4, 5]);
    assert_eq!((p.load.len(), p.pass.len(), p.evict.len()), (0, 3, 0));
    for _ in 0..19 {
        plan_staged(&mut c, &[3, 4, 5]);
    }
    assert!((3..6).all(|e| c.is_resident(0, e)), "the cache followed the text to 3, 4 and 5");
    // Without a staging allowance (a layer that cannot pass experts through) it keeps them all.
    let mut p = LayerPlan::default();
    c.plan_layer(0, &[6], &mut p, None);
    assert_eq!((p.load, p.pass.len(), p.evict.len()), (vec![6], 0, 1));
}
