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
}

/// Every layer's router copy and the scratch of a guess.
pub struct Lookahead {
    n_expert: usize,
    routers: Vec<Option<Router>>,
    scores: Vec<(f32, u32)>,
    guess: Vec<u32>,
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
        }
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
        *slot = Some(Router { n_embd, weights, bias });
    }

    /// The `k` experts `next`'s router would choose for the single token whose router input is
    /// under `topk` (this layer's top-k node), best first; empty when `next`'s router is not
    /// known or the input cannot be read.
    pub fn guess(&mut self, topk: &TensorView<'_>, next: u32, k: usize) -> &[u32] {
        self.guess.clear();
        let Some(Some(r)) = self.routers.get(next as usize) else { return &self.guess };
        let Some(x) = router_product(topk).and_then(|(p, _)| p.src(1)) else { return &self.guess };
        if x.ty() != GgmlType::F32 || x.ne()[0] as usize != r.n_embd || x.ne()[1] != 1 {
            return &self.guess;
        }
        let Some(input) = floats(&x) else { return &self.guess };
        self.choose(next, &input, k)
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
        look.routers[2] = Some(Router { n_embd: 2, weights, bias: Some(vec![0.0, 0.0, 0.0, 0.6]) });
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
}
