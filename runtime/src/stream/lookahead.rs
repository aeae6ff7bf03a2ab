//! Lookahead: which experts the next layer's router will choose, guessed before that layer
//! runs, so that their reads can start while this layer computes.
//!
//! The guess is pre-gating: the next layer's router applied to this layer's router input (the
//! residual stream changes little from one layer to the next). Each layer's router weights
//! (and bias) are copied once, at its first top-k node, from the router product's operands
//! (`ffn_moe_logits-<il>` = router x normed input); the input is read at every decode from the
//! same node's second operand, which the layer's expert products still need, so it is
//! computed and intact there. A guess reads nothing the output depends on: the layer's real
//! routing still decides what is computed; a wrong guess costs a read.

use ggml_sys::{GgmlType, TensorView};

/// One layer's router, as f32: `n_expert` rows of `n_embd`.
struct Router {
    n_embd: usize,
    weights: Vec<f32>,
    bias: Option<Vec<f32>>,
    /// The weight of the norm that makes the router's input (`x = rms_norm(h) * norm`), where
    /// the graph shows it: a guess for the next layer swaps this layer's for the next one's.
    norm: Option<Vec<f32>>,
}

/// Experts a guess names beyond the `k` its layer routes: the runner-up of the next router's
/// ranking is often chosen instead of its `k`-th (on the KJV model trained here, 10 held-out
/// windows decoded a token at a time, `k` guesses named 74.5% of the routed experts and `k + 1`
/// named 81.6%, `k + 2` 85.4%: one spare gains most for its read). A spare already resident
/// costs nothing; one read in vain is a wrong guess's read.
pub const SPARE_GUESSES: usize = 1;

/// Decodes a layer is guessed before its record decides whether its guesses are read.
const TRIAL_DECODES: u64 = 8;

/// The share of a layer's routed experts its guesses must have named for them to be read
/// ahead: below it, more than half of what the guesses read would be wasted.
pub const MIN_GUESS_RATE: f64 = 0.5;

/// How well one layer's experts were guessed: over the single-token decodes whose layer
/// before guessed it, the experts routed and how many of them the guess named.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuessTally {
    /// Decodes in which the layer was guessed.
    pub decodes: u64,
    /// Experts the layer's router chose in those decodes.
    pub routed: u64,
    /// Of them, those the guess named.
    pub guessed: u64,
}

impl GuessTally {
    /// The share of routed experts the guesses named (0 when none was guessed).
    pub fn rate(&self) -> f64 {
        if self.routed == 0 {
            0.0
        } else {
            self.guessed as f64 / self.routed as f64
        }
    }
}

/// The guesses per layer as one line: each guessed layer's share of routed experts named, and
/// all layers' together (`None` when no layer was guessed).
pub fn describe_tally(tally: &[GuessTally]) -> Option<String> {
    let all = tally.iter().fold(GuessTally::default(), |a, t| GuessTally {
        decodes: a.decodes + t.decodes,
        routed: a.routed + t.routed,
        guessed: a.guessed + t.guessed,
    });
    if all.routed == 0 {
        return None;
    }
    let layers: Vec<String> = tally
        .iter()
        .enumerate()
        .filter(|(_, t)| t.routed > 0)
        .map(|(l, t)| format!("{l}: {:.1}", 100.0 * t.rate()))
        .collect();
    Some(format!(
        "lookahead guessed {:.1}% of the routed experts ({} of {}); per layer %: {}",
        100.0 * all.rate(),
        all.guessed,
        all.routed,
        layers.join(", ")
    ))
}

/// Every layer's router copy and the scratch of a guess.
pub struct Lookahead {
    n_expert: usize,
    routers: Vec<Option<Router>>,
    scores: Vec<(f32, u32)>,
    guess: Vec<u32>,
    /// Each layer's last guess, until its router has chosen.
    pending: Vec<Vec<u32>>,
    /// Each layer's guesses against its router's choices.
    tally: Vec<GuessTally>,
}

/// The elements of `t` as f32, for the types routers are stored in (llama.cpp's quantizer
/// keeps them in float).
fn floats(t: &TensorView<'_>) -> Option<Vec<f32>> {
    let raw = t.read_host_bytes(0, t.n_bytes())?;
    let two = |c: &[u8]| [c[0], c[1]];
    match t.ty() {
        GgmlType::F32 => Some(raw.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()),
        GgmlType::F16 => Some(raw.chunks_exact(2).map(|c| half::f16::from_ne_bytes(two(c)).to_f32()).collect()),
        GgmlType::BF16 => Some(raw.chunks_exact(2).map(|c| half::bf16::from_ne_bytes(two(c)).to_f32()).collect()),
        _ => None,
    }
}

/// The router product under a top-k node: `ffn_moe_logits-<il>`, reached through the argsort
/// and what lies between (a softmax or sigmoid, the router bias, a selection bias), with the
/// router bias when one was added on the way.
fn router_product<'a>(topk: &TensorView<'a>) -> Option<(TensorView<'a>, Option<TensorView<'a>>)> {
    let mut node = topk.src(0)?;
    let mut bias = None;
    for _ in 0..8 {
        if node.op_name() == "MUL_MAT" {
            return Some((node, bias));
        }
        if node.op_name() == "ADD" {
            bias = bias.or_else(|| node.src(1).filter(|b| b.name().ends_with("ffn_gate_inp.bias")));
        }
        node = node.src(0)?;
    }
    None
}

impl Lookahead {
    /// Lookahead over `n_layer` layers of `n_expert` experts; it knows no router yet.
    pub fn new(n_layer: u32, n_expert: u32) -> Lookahead {
        Lookahead {
            n_expert: n_expert as usize,
            routers: (0..n_layer).map(|_| None).collect(),
            scores: Vec::with_capacity(n_expert as usize),
            guess: Vec::new(),
            pending: vec![Vec::new(); n_layer as usize],
            tally: vec![GuessTally::default(); n_layer as usize],
        }
    }

    /// Whether `layer`'s guesses are worth reading: still on trial, or naming at least
    /// [`MIN_GUESS_RATE`] of what its router chose so far. (A layer below it is still guessed
    /// and scored, so it is read again once its guesses improve.)
    pub fn worth_reading(&self, layer: u32) -> bool {
        self.tally.get(layer as usize).is_some_and(|t| t.decodes < TRIAL_DECODES || t.rate() >= MIN_GUESS_RATE)
    }

    /// Each layer's guesses against its router's choices so far.
    pub fn tally(&self) -> &[GuessTally] {
        &self.tally
    }

    /// Scores the pending guess of `layer` (if any) against the experts its router `chose`
    /// for a single token.
    pub fn score(&mut self, layer: u32, chose: &[u32]) {
        let (Some(pending), Some(tally)) = (self.pending.get_mut(layer as usize), self.tally.get_mut(layer as usize))
        else {
            return;
        };
        if pending.is_empty() {
            return;
        }
        tally.decodes += 1;
        tally.routed += chose.len() as u64;
        tally.guessed += chose.iter().filter(|e| pending.contains(e)).count() as u64;
        pending.clear();
    }

    /// Bytes of the router copies held.
    pub fn bytes(&self) -> u64 {
        let f = std::mem::size_of::<f32>();
        self.routers
            .iter()
            .flatten()
            .map(|r| (r.weights.len() + r.bias.as_ref().map_or(0, Vec::len)) * f)
            .sum::<usize>() as u64
    }

    /// Copies `layer`'s router from its top-k node `topk` if it has none yet (a router in
    /// another type, or not in host memory, is left out: that layer is never guessed).
    pub fn learn(&mut self, topk: &TensorView<'_>, layer: u32) {
        let Some(slot) = self.routers.get_mut(layer as usize).filter(|r| r.is_none()) else { return };
        let Some((product, bias)) = router_product(topk) else { return };
        let Some(w) = product.src(0).filter(|w| w.name().ends_with("ffn_gate_inp.weight")) else { return };
        let n_embd = w.ne()[0] as usize;
        if n_embd == 0 || w.ne()[1] as usize != self.n_expert {
            return;
        }
        let Some(weights) = floats(&w).filter(|v| v.len() == n_embd * self.n_expert) else { return };
        let bias = bias.and_then(|b| floats(&b)).filter(|b| b.len() == self.n_expert);
        let norm = product
            .src(1)
            .filter(|x| x.op_name() == "MUL")
            .and_then(|x| x.src(1))
            .filter(|g| g.name().ends_with("norm.weight") && g.ne()[0] as usize == n_embd && g.ne()[1] == 1)
            .and_then(|g| floats(&g));
        *slot = Some(Router { n_embd, weights, bias, norm });
    }

    /// The `k` experts `next`'s router would choose for the single token whose router input is
    /// under `topk` (this layer's top-k node), and [`SPARE_GUESSES`] runners-up, best first;
    /// empty when `next`'s router is not known or the input cannot be read.
    pub fn guess(&mut self, topk: &TensorView<'_>, next: u32, k: usize) -> &[u32] {
        self.guess.clear();
        let Some(Some(r)) = self.routers.get(next as usize) else { return &self.guess };
        let Some(x) = router_product(topk).and_then(|(p, _)| p.src(1)) else { return &self.guess };
        if x.ty() != GgmlType::F32 || x.ne()[0] as usize != r.n_embd || x.ne()[1] != 1 {
            return &self.guess;
        }
        let Some(mut input) = floats(&x) else { return &self.guess };
        let this = topk.moe_topk_layer().and_then(|l| self.routers.get(l as usize)).and_then(Option::as_ref);
        if let (Some(ours), Some(theirs)) = (this.and_then(|r| r.norm.as_ref()), r.norm.as_ref()) {
            for ((v, &a), &b) in input.iter_mut().zip(ours).zip(theirs) {
                *v = if a == 0.0 { 0.0 } else { *v / a * b };
            }
        }
        self.choose(next, &input, k + SPARE_GUESSES);
        if let Some(pending) = self.pending.get_mut(next as usize) {
            pending.clone_from(&self.guess);
        }
        &self.guess
    }

    /// The `k` best-scored experts of `next`'s router for `input`, best first (ties: the lower
    /// id first).
    fn choose(&mut self, next: u32, input: &[f32], k: usize) -> &[u32] {
        self.guess.clear();
        let Some(Some(r)) = self.routers.get(next as usize) else { return &self.guess };
        self.scores.clear();
        for (e, row) in r.weights.chunks_exact(r.n_embd).enumerate() {
            let dot: f32 = row.iter().zip(input).map(|(a, b)| a * b).sum();
            self.scores.push((dot + r.bias.as_ref().map_or(0.0, |b| b[e]), e as u32));
        }
        self.scores.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        self.guess.extend(self.scores.iter().take(k).map(|&(_, e)| e));
        &self.guess
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guess_is_the_next_routers_top_k_with_its_bias() {
        let mut look = Lookahead::new(3, 4);
        // Layer 2's router over a 2-wide input: expert e scores row_e . x + bias_e.
        let weights = vec![1.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.5, 0.5];
        look.routers[2] = Some(Router { n_embd: 2, weights, bias: Some(vec![0.0, 0.0, 0.0, 0.6]), norm: None });
        let x = [1.0, 0.2];
        // Scores: 1.0, 0.2, -1.0, 0.6 + 0.6 = 1.2.
        assert_eq!(look.choose(2, &x, 2), &[3, 0]);
        assert_eq!(look.choose(2, &x, 4), &[3, 0, 1, 2]);
        // A layer whose router is not known is never guessed.
        assert!(look.choose(1, &x, 2).is_empty());
        assert!(look.choose(7, &x, 2).is_empty());
        look.routers[2].as_mut().unwrap().bias = None;
        assert_eq!(look.choose(2, &x, 1), &[0]);
        assert_eq!(look.bytes(), 8 * 4);
    }

    #[test]
    fn each_layers_guesses_are_scored_against_what_its_router_chose() {
        let mut look = Lookahead::new(3, 4);
        // Layer 1 was guessed {3, 0} and chose {0, 2}; then {1, 2} and chose {1, 2}. Layer 2
        // was never guessed, so what it chose counts nowhere.
        for (guess, chose) in [([3, 0], [0, 2]), ([1, 2], [2, 1])] {
            look.pending[1] = guess.to_vec();
            look.score(1, &chose);
            look.score(2, &[0, 1]);
        }
        look.score(1, &[3, 0]);
        assert_eq!(look.tally()[1], GuessTally { decodes: 2, routed: 4, guessed: 3 });
        assert_eq!(look.tally()[2], GuessTally::default());
        assert_eq!(
            describe_tally(look.tally()).as_deref(),
            Some("lookahead guessed 75.0% of the routed experts (3 of 4); per layer %: 1: 75.0")
        );
        assert_eq!(describe_tally(&[GuessTally::default()]), None);
    }
}
