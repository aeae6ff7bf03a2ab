//! A replay's outcomes as a table and as CSV: each policy's hit rate by bytes on the
//! single-token decodes, the MiB it reads per decode, and how far it is from MIN at its budget.

use super::Outcome;
use crate::bench::report::{column, columns_csv, render, Column};
use crate::units::mib;

/// MIN's byte hit rate at `o`'s budget among `all`.
fn min_rate(all: &[Outcome], o: &Outcome) -> Option<f64> {
    all.iter().find(|m| m.budget == o.budget && m.policy == super::Replayed::Min).map(|m| m.decode.byte_hit_rate())
}

fn columns(outcomes: &[Outcome], per_layer: bool) -> Vec<Column> {
    let pct = |v: f64| format!("{:.1}", 100.0 * v);
    let mut cols = vec![
        column("cache", outcomes, |o| o.cache.clone()),
        column("cache MiB", outcomes, |o| format!("{:.1}", mib(o.budget))),
        column("policy", outcomes, |o| o.policy.to_string()),
        column("decode byte hit %", outcomes, |o| pct(o.decode.byte_hit_rate())),
        column("of MIN %", outcomes, |o| {
            min_rate(outcomes, o).filter(|&m| m > 0.0).map_or("-".into(), |m| pct(o.decode.byte_hit_rate() / m))
        }),
        column("MiB/decode", outcomes, |o| format!("{:.2}", o.mib_per_decode())),
        column("all steps hit %", outcomes, |o| pct(o.all.byte_hit_rate())),
        column("hits", outcomes, |o| o.all.hits.to_string()),
        column("misses", outcomes, |o| o.all.misses.to_string()),
    ];
    if per_layer {
        let n = outcomes.first().map_or(0, |o| o.per_layer.len());
        for l in 0..n {
            cols.push(column(format!("layer {l} %"), outcomes, move |o| pct(o.per_layer[l].byte_hit_rate())));
        }
    }
    cols
}

/// The outcomes as an aligned table; with `per_layer`, a column per layer's decode byte hit rate.
pub fn table(outcomes: &[Outcome], per_layer: bool) -> String {
    render(&columns(outcomes, per_layer), outcomes.len())
}

/// The outcomes as CSV (every layer's column included).
pub fn csv(outcomes: &[Outcome]) -> String {
    columns_csv(&columns(outcomes, true), outcomes.len())
}

/// The outcomes as CSV with one row per policy and size, `policy,cache,hit_pct,of_min_pct`
/// (the decode byte hit rate, and it as a share of MIN's at the size), and a second row named
/// `default` for the outcomes of `default`, the policy a run uses unless told otherwise.
pub fn summary_csv(outcomes: &[Outcome], default: crate::stream::CachePolicy) -> String {
    let mut w = csv::Writer::from_writer(Vec::new());
    let row = |w: &mut csv::Writer<Vec<u8>>, policy: &str, o: &Outcome| {
        let hit = o.decode.byte_hit_rate();
        let of_min =
            min_rate(outcomes, o).filter(|&m| m > 0.0).map_or(String::new(), |m| format!("{:.1}", 100.0 * hit / m));
        w.write_record([policy, &o.cache, &format!("{:.1}", 100.0 * hit), &of_min]).expect("writing to memory");
    };
    w.write_record(["policy", "cache", "hit_pct", "of_min_pct"]).expect("writing to memory");
    for o in outcomes {
        row(&mut w, &o.policy.to_string(), o);
        if o.policy == super::Replayed::Online(default) {
            row(&mut w, "default", o);
        }
    }
    String::from_utf8(w.into_inner().expect("writing to memory")).expect("CSV of UTF-8 fields")
}
