use super::*;
use crate::stream::RouteRecord;

/// Two layers of four 10-byte experts, a budget of three: a 3-token prompt batch, then four
/// single-token decodes.
fn trace() -> RouteTrace {
    let step = |decode, layer, tokens, experts: &[u32]| RouteRecord {
        decode,
        layer,
        tokens,
        staged: false,
        experts: experts.to_vec(),
    };
    RouteTrace {
        model: "hand-made".into(),
        n_layer: 2,
        n_expert: 4,
        expert_bytes: vec![10; 8],
        staging: 0,
        budget: 30,
        policy: CachePolicy::Lru,
        steps: vec![
            step(0, 0, 3, &[0, 1, 2]),
            step(0, 1, 3, &[0]),
            step(1, 0, 1, &[0]),
            step(1, 1, 1, &[1]),
            step(2, 0, 1, &[0]),
            step(2, 1, 1, &[0]),
            step(3, 0, 1, &[3]),
            step(3, 1, 1, &[1]),
            step(4, 0, 1, &[0]),
            step(4, 1, 1, &[0]),
        ],
    }
}

fn tally(hits: u64, misses: u64) -> Tally {
    Tally { hits, misses, hit_bytes: 10 * hits, miss_bytes: 10 * misses }
}

// Worked by hand (layer.expert; a half-life is 8 plans here, too short a time for one later
// use to outweigh two earlier ones, so frequency ranks by uses, then recency):
// - LRU evicts 0.0, 0.1, 0.2 for 1.0, 0.0, 1.1; hits 0.0 and 1.0; then 0.3 evicts 1.1, 1.1
//   evicts 0.0, 0.0 evicts 1.0 and 1.0 evicts 0.3: hits at decode 2 only.
// - Frequency evicts the same first three, hits 0.0 (3 uses) and 1.0 (2 uses); 0.3 evicts 1.1
//   (1 use), 1.1 evicts 0.3 (1 use, of another layer), so 0.0 and 1.0 hit again at decode 4.
// - MIN keeps 0.0, 1.0 and 1.1 (used again soonest) from decode 1 on and lets 0.1, 0.2 and 0.3
//   (never used again) go: only 1.1 and 0.3 miss among the decodes.
#[test]
fn the_policies_count_what_was_worked_by_hand() {
    let t = trace();
    let lru = replay(&t, CachePolicy::Lru, 30);
    assert_eq!((lru.all, lru.decode, lru.decodes), (tally(2, 10), tally(2, 6), 4));
    assert_eq!(lru.per_layer, vec![tally(1, 3), tally(1, 3)]);
    assert!((lru.mib_per_decode() - crate::units::mib(60) / 4.0).abs() < 1e-12);

    let freq = replay(&t, CachePolicy::Frequency, 30);
    assert_eq!((freq.all, freq.decode), (tally(4, 8), tally(4, 4)));
    assert_eq!(freq.per_layer, vec![tally(2, 2), tally(2, 2)]);

    let min = belady(&t, 30);
    assert_eq!((min.all, min.decode), (tally(6, 6), tally(6, 2)));
    assert_eq!(min.per_layer, vec![tally(3, 1), tally(3, 1)]);
    assert_eq!(min.policy, Replayed::Min);
}

// The decodes route 0.0 three times, 1.0 and 1.1 twice each and 0.3 once: the fixed set of three
// is 0.0, 1.0 and 1.1. 0.0 and 1.0 were read by the prompt; 1.1 is read at its first use (decode
// 1) and 0.3 at its only one (decode 3): the decodes' 2 misses of MIN.
#[test]
fn the_best_fixed_set_counts_what_was_worked_by_hand() {
    let fixed = hindsight(&trace(), 30);
    assert_eq!((fixed.all, fixed.decode, fixed.decodes), (tally(6, 6), tally(6, 2), 4));
    assert_eq!(fixed.per_layer, vec![tally(3, 1), tally(3, 1)]);
    assert_eq!(fixed.policy, Replayed::Hindsight);
}

#[test]
fn recency_beats_the_best_fixed_set_when_routing_moves_on() {
    // One layer of two experts, room for one; the decodes route 0, 0, 1, 1. The fixed set keeps 0
    // (a tie, the lower expert) and reads 1 twice; LRU and MIN read each expert once.
    let step = |decode, e| RouteRecord { decode, layer: 0, tokens: 1, staged: false, experts: vec![e] };
    let t = RouteTrace {
        n_layer: 1,
        n_expert: 2,
        expert_bytes: vec![10; 2],
        steps: vec![step(1, 0), step(2, 0), step(3, 1), step(4, 1)],
        ..trace()
    };
    assert_eq!(hindsight(&t, 10).decode, tally(1, 3));
    assert_eq!(replay(&t, CachePolicy::Lru, 10).decode, tally(2, 2));
    assert_eq!(belady(&t, 10).decode, tally(2, 2));
}

#[test]
fn min_is_never_beaten_and_a_larger_budget_never_hurts_it() {
    let t = trace();
    let mut last = 0;
    for budget in [0, 10, 20, 30, 40, 80] {
        let min = belady(&t, budget);
        for p in CachePolicy::ALL {
            assert!(replay(&t, p, budget).all.hits <= min.all.hits, "{p} beat MIN at {budget}");
        }
        assert!(hindsight(&t, budget).all.hits <= min.all.hits, "the fixed set beat MIN at {budget}");
        assert!(min.all.hits >= last);
        last = min.all.hits;
    }
    // Room for every expert: each is read once.
    assert_eq!(belady(&t, 80).all.misses, 6);
    assert_eq!(replay(&t, CachePolicy::Lru, 80).all.misses, 6);
}

#[test]
fn the_replay_of_a_staged_prompt_passes_what_the_live_cache_passes() {
    // One layer of eight: a prompt batch routes all eight with a budget of two and a staging of
    // one, so six pass through and are not resident for the decode after it.
    let t = RouteTrace {
        n_layer: 1,
        n_expert: 8,
        expert_bytes: vec![10; 8],
        staging: 10,
        budget: 20,
        steps: vec![
            RouteRecord { decode: 0, layer: 0, tokens: 8, staged: true, experts: (0..8).collect() },
            RouteRecord { decode: 1, layer: 0, tokens: 1, staged: true, experts: vec![0, 7] },
        ],
        ..trace()
    };
    let lru = replay(&t, CachePolicy::Lru, 20);
    assert_eq!(lru.decode, tally(1, 1), "0 was kept, 7 passed through");
}

#[test]
fn the_table_names_each_policy_and_its_share_of_min() {
    let outcomes = compare(&trace(), &CachePolicy::ALL, &[CacheSize { budget: 30, label: "30 B".into() }]);
    let policies: Vec<Replayed> = outcomes.iter().map(|o| o.policy).collect();
    assert_eq!(
        policies,
        [
            Replayed::Online(CachePolicy::Lru),
            Replayed::Online(CachePolicy::Frequency),
            Replayed::Online(CachePolicy::Adaptive),
            Replayed::Hindsight,
            Replayed::Min
        ]
    );
    let text = table(&outcomes, true);
    // LRU's decode byte hit rate is 25%, MIN's 75%: a third of MIN's.
    assert!(
        text.lines().nth(1).is_some_and(|l| l.contains("lru") && l.contains("25.0") && l.contains("33.3")),
        "{text}"
    );
    assert!(text.contains("layer 1 %"), "{text}");
    let csv = csv(&outcomes);
    assert_eq!(csv.lines().count(), 6, "{csv}");
    let summary = summary_csv(&outcomes, CachePolicy::Lru);
    let rows: Vec<&str> = summary.lines().collect();
    assert_eq!(rows[..3], ["policy,cache,hit_pct,of_min_pct", "lru,30 B,25.0,33.3", "default,30 B,25.0,33.3"]);
    assert_eq!(rows.last(), Some(&"belady-min,30 B,75.0,100.0"));
}
