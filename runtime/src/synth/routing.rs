//! Skewed routing for synthetic models: a router bias that makes some experts popular.
//!
//! A real MoE router sends most tokens to a minority of each layer's experts; a random router
//! spreads them almost evenly, which flatters nothing and predicts nothing about a cache. With
//! `--routing skewed`, expert popularity follows a log-normal profile: the expert of rank `r`
//! (of `n`) gets a share of the layer's routing mass proportional to `exp(σ · z_r)`, with `z_r`
//! the standard normal quantile at `(n - r + 0.5) / n`. σ = 0 is uniform.
//!
//! The default σ = 1.3 puts 90% of the routing mass in half the experts of a 128-expert layer
//! (53% of a 32-expert one), as measured for Qwen3-30B-A3B from llama-imatrix's per-expert
//! selection counts (45-51% of its 128 experts for 90% coverage, narrow and diverse workloads;
//! gpu-container's "routing de-risk" handbook). Its hottest expert gets about 14x the uniform
//! share, above that model's 5.5-8x: one σ cannot match both, and the coverage is what sizes a
//! cache.
//!
//! The profile is written as the router's logit bias (`ffn_gate_inp.bias`, so gpt-oss only: the
//! architecture whose router adds a bias before its top-k), so that each expert's chance of being
//! among a token's top k is `k` times its share. A first estimate comes from sampling the
//! router's other term, the product of its weights with the normalized hidden state, as
//! independent normals of standard deviation [`ROUTER_GAIN`] per expert
//! ([`calibrated_bias`]); [`super::calibrate`] then corrects it against the written model's own
//! routing. Each layer permutes which experts are hot, so popularity is not tied to file order.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The router's weight gain: its logits' standard deviation per expert for a normalized state.
pub const ROUTER_GAIN: f32 = 4.0;

/// The default popularity spread σ of `--routing skewed`.
pub const DEFAULT_SKEW: f64 = 1.3;

/// The largest chance of being routed the hottest expert may be given: above it the calibration
/// cannot leave the other experts their share.
const MAX_ROUTED_CHANCE: f64 = 0.95;

/// How experts are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// A random router: every expert about equally often.
    Uniform,
    /// Log-normal popularity of spread σ (the field), written as a calibrated router bias.
    Skewed(f64),
}

/// Each expert's share of a layer's routing mass, hottest first: log-normal with spread `sigma`.
pub fn popularity(n: u32, sigma: f64) -> Vec<f64> {
    let normal = normal_quantiles(n);
    let w: Vec<f64> = normal.iter().map(|z| (sigma * z).exp()).collect();
    let total: f64 = w.iter().sum();
    w.into_iter().map(|x| x / total).collect()
}

/// Standard normal quantiles at `(n - r + 0.5) / n` for ranks `r = 1..=n` (descending).
fn normal_quantiles(n: u32) -> Vec<f64> {
    (1..=n).map(|r| inverse_normal((f64::from(n - r) + 0.5) / f64::from(n))).collect()
}

/// The standard normal quantile function (Acklam's rational approximation, relative error below
/// 1.2e-9: far below what a router bias needs).
fn inverse_normal(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] =
        [7.784_695_709_041_462e-3, 3.224_671_290_700_398e-1, 2.445_134_137_142_996, 3.754_408_661_907_416];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// Why a skew cannot be written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("σ {sigma} would route the hottest of {n} experts to {chance:.2} of tokens with top-{k}; at most {max} is possible (use a smaller --skew)")]
pub struct SkewTooLarge {
    /// The spread asked for.
    pub sigma: f64,
    /// Experts.
    pub n: u32,
    /// Experts per token.
    pub k: u32,
    /// The chance the hottest expert would need.
    pub chance: f64,
    /// The most allowed.
    pub max: f64,
}

/// Each expert's chance of being among a token's top `k`, hottest first: `k` times its share.
pub fn routed_chances(n: u32, k: u32, sigma: f64) -> Result<Vec<f64>, SkewTooLarge> {
    let chances: Vec<f64> = popularity(n, sigma).into_iter().map(|w| f64::from(k) * w).collect();
    match chances.first() {
        Some(&c) if c > MAX_ROUTED_CHANCE => Err(SkewTooLarge { sigma, n, k, chance: c, max: MAX_ROUTED_CHANCE }),
        _ => Ok(chances),
    }
}

/// Tokens sampled per calibration round.
const SAMPLES: usize = 4096;
/// Calibration rounds.
const ROUNDS: usize = 80;

/// A standard normal draw (the sum of twelve uniforms less six: only additions, so the same on
/// every platform).
fn normal_draw(rng: &mut ChaCha8Rng) -> f32 {
    let mut s = 0.0f32;
    for _ in 0..12 {
        s += (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
    }
    s - 6.0
}

/// Counts how often each expert is among the top `k` of `bias + noise` over `noise`'s tokens.
fn routed_counts(bias: &[f32], noise: &[f32], k: usize, counts: &mut [u32]) {
    let n = bias.len();
    counts.fill(0);
    let mut logits: Vec<(f32, usize)> = Vec::with_capacity(n);
    for token in noise.chunks(n) {
        logits.clear();
        logits.extend(token.iter().zip(bias).enumerate().map(|(e, (z, b))| (b + z, e)));
        // The k highest; ties to the lower id, as ggml's argsort does.
        logits.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, e) in &logits[..k] {
            counts[e] += 1;
        }
    }
}

/// The router bias (hottest expert first) that routes each expert to `chances[e]` of tokens
/// with top-`k` selection over independent logits of standard deviation [`ROUTER_GAIN`]: the
/// starting point of the calibration on the model. Deterministic for a given `seed`.
pub fn calibrated_bias(chances: &[f64], k: u32, seed: u64) -> Vec<f32> {
    let n = chances.len();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let noise: Vec<f32> = (0..SAMPLES * n).map(|_| ROUTER_GAIN * normal_draw(&mut rng)).collect();
    // Start from the log-shares, then correct by the measured miss in log space.
    let mut bias: Vec<f32> = chances.iter().map(|c| ROUTER_GAIN * (c.ln() as f32)).collect();
    let mut counts = vec![0u32; n];
    for round in 0..ROUNDS {
        routed_counts(&bias, &noise, k as usize, &mut counts);
        let step = if round < ROUNDS / 2 { 1.0 } else { 0.5 };
        for (b, (&c, &want)) in bias.iter_mut().zip(counts.iter().zip(chances)) {
            let got = (f64::from(c) + 0.5) / SAMPLES as f64;
            *b += step * ROUTER_GAIN * 0.5 * ((want / got).ln() as f32);
        }
    }
    let mean = bias.iter().sum::<f32>() / n as f32;
    bias.iter().map(|b| b - mean).collect()
}

/// Which expert of layer `layer` holds each popularity rank (hottest first): an order drawn
/// from `seed` and the layer (Fisher-Yates).
pub fn layer_order(n: usize, seed: u64, layer: u32) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_0fad);
    rng.set_stream(u64::from(layer));
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// `by_rank` (hottest first) laid out by expert for layer `layer`'s order.
pub fn by_expert<T: Copy + Default>(by_rank: &[T], seed: u64, layer: u32) -> Vec<T> {
    let mut out = vec![T::default(); by_rank.len()];
    for (rank, slot) in layer_order(by_rank.len(), seed, layer).into_iter().enumerate() {
        out[slot] = by_rank[rank];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_skew_puts_90_percent_of_routing_in_about_half_the_experts() {
        let cover = |n: u32| {
            let mut acc = 0.0;
            let hot = popularity(n, DEFAULT_SKEW).iter().position(|w| {
                acc += w;
                acc >= 0.9
            });
            hot.map_or(n, |i| i as u32 + 1)
        };
        assert_eq!(cover(128), 64);
        assert_eq!(cover(32), 17);
        let flat = popularity(16, 0.0);
        assert!(flat.iter().all(|w| (w - 1.0 / 16.0).abs() < 1e-12));
    }

    #[test]
    fn the_calibrated_bias_routes_each_expert_at_its_chance() {
        let (n, k) = (32u32, 4u32);
        let chances = routed_chances(n, k, DEFAULT_SKEW).unwrap();
        let bias = calibrated_bias(&chances, k, 7);
        assert_eq!(bias, calibrated_bias(&chances, k, 7), "deterministic");
        // Measured on tokens the calibration never saw.
        let mut rng = ChaCha8Rng::seed_from_u64(99);
        let noise: Vec<f32> = (0..20_000 * n as usize).map(|_| ROUTER_GAIN * normal_draw(&mut rng)).collect();
        let mut counts = vec![0u32; n as usize];
        routed_counts(&bias, &noise, k as usize, &mut counts);
        for (e, (&c, &want)) in counts.iter().zip(&chances).enumerate() {
            let got = f64::from(c) / 20_000.0;
            assert!((got - want).abs() < 0.01 + 0.05 * want, "expert {e}: routed {got:.4}, want {want:.4}");
        }
    }

    #[test]
    fn a_skew_beyond_what_top_k_allows_is_refused_and_layers_differ_in_order() {
        let e = routed_chances(8, 4, 3.0).unwrap_err();
        assert!(e.to_string().contains("--skew"), "{e}");
        let profile: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let (a, b) = (by_expert(&profile, 1, 0), by_expert(&profile, 1, 1));
        assert_ne!(a, b);
        let mut sorted = a.clone();
        sorted.sort_by(f32::total_cmp);
        assert_eq!(sorted, profile, "a permutation of the profile");
    }
}
