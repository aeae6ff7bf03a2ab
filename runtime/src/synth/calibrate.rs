//! Calibrating a written skewed model's router biases against the model's own routing.
//!
//! The bias [`super::routing::calibrated_bias`] computes assumes router logits of independent
//! noise around the bias. A model's hidden states also share a common part from token to token
//! (attention and its biases add nearly the same vector to every position), which gives each
//! expert a fixed offset and shrinks the noise, so the written model routes more unevenly than
//! asked. This pass runs the model on a fixed prompt, counts each layer's top-k choices per
//! token, moves each bias by the log of wanted over measured, writes the biases back into the
//! file and repeats, all layers at once (a layer's routing changes the next one's input).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ggml_sys::{EvalPhase, GgufFile, Threads, Token};

use super::{invalid, SynthError};
use crate::generate::{load_model, Session};

/// Tokens of the calibration prompt.
pub const CALIBRATION_TOKENS: usize = 512;
/// The most calibration rounds.
const MAX_ROUNDS: usize = 16;
/// Log-space step: how far the first round moves a bias per unit of log(want / got); halved
/// whenever a round does worse than the best so far.
const INITIAL_STEP: f32 = 1.5;

/// The calibration prompt: byte tokens (ids 8 to 258) in a fixed scrambled order, so every
/// round and every run sees the same tokens and many different ones.
pub fn calibration_prompt(n: usize, scramble: u32) -> Vec<Token> {
    (0..n as u32).map(|i| ((i.wrapping_mul(scramble).wrapping_add(13)) % 251 + 8) as Token).collect()
}

/// What a resident run of a prompt routed, layer by layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routes {
    /// How often each expert was among a token's top k.
    pub counts: Vec<Vec<u64>>,
    /// How often each expert was a token's first choice.
    pub first: Vec<Vec<u64>>,
    /// Consecutive tokens whose first choices were the same expert.
    pub repeats: Vec<u64>,
    /// Consecutive token pairs.
    pub pairs: u64,
}

impl Routes {
    /// Token-to-token reuse in `layer`: how much more often consecutive tokens share their first
    /// choice than independent tokens of the same popularity would (1: no reuse).
    pub fn reuse(&self, layer: usize) -> f64 {
        let firsts: u64 = self.first[layer].iter().sum();
        let independent: f64 = self.first[layer].iter().map(|&c| (c as f64 / firsts.max(1) as f64).powi(2)).sum();
        if self.pairs == 0 || independent == 0.0 {
            return 1.0;
        }
        self.repeats[layer] as f64 / self.pairs as f64 / independent
    }

    /// [`Routes::reuse`] averaged over the layers.
    pub fn mean_reuse(&self) -> f64 {
        let n = self.repeats.len();
        (0..n).map(|l| self.reuse(l)).sum::<f64>() / n.max(1) as f64
    }
}

/// What the model at `path`, loaded resident, routed over `prompt`, read from its
/// `ffn_moe_topk-<il>` nodes (each a view of the router's ranking, best first).
pub fn routes(
    path: &std::path::Path,
    prompt: &[Token],
    layers: usize,
    experts: usize,
    threads: u32,
) -> Result<Routes, SynthError> {
    let model = load_model(path).map_err(|e| invalid("routing", format!("calibrating {}: {e}", path.display())))?;
    let routes = Arc::new(Mutex::new(Routes {
        counts: vec![vec![0; experts]; layers],
        first: vec![vec![0; experts]; layers],
        repeats: vec![0; layers],
        pairs: prompt.len().saturating_sub(1) as u64,
    }));
    let record = Arc::clone(&routes);
    // Each layer's last first choice, for pairs that straddle two batches.
    let mut last: Vec<Option<i32>> = vec![None; layers];
    let callback: ggml_sys::EvalCallback<'_> = Box::new(move |t, phase| {
        let Some(layer) = t.moe_topk_layer().map(|l| l as usize) else {
            return phase == EvalPhase::Computed;
        };
        if phase == EvalPhase::Ask {
            return true;
        }
        let Ok(mut r) = record.lock() else { return true };
        if layer >= layers {
            return true;
        }
        let [k, n, ..] = t.ne();
        for tok in 0..n as usize {
            for j in 0..k as usize {
                let Some(id) = t.i32_at(j, tok) else { continue };
                let Some(e) = usize::try_from(id).ok().filter(|&e| e < experts) else { continue };
                r.counts[layer][e] += 1;
                if j == 0 {
                    r.first[layer][e] += 1;
                    if last[layer] == Some(id) {
                        r.repeats[layer] += 1;
                    }
                    last[layer] = Some(id);
                }
            }
        }
        true
    });
    let fail = |e: crate::generate::GenerateError| invalid("routing", format!("calibrating {}: {e}", path.display()));
    let mut session = Session::new(
        &model,
        crate::generate::ContextShape::one(prompt.len() as u32 + 2),
        &Threads::unpinned(threads),
        Some(callback),
    )
    .map_err(fail)?;
    // One token: it is chosen from the prompt's logits and never decoded, so only the prompt
    // is routed.
    session.generate(prompt, 1, |_, _| {}, &mut |_| Ok(())).map_err(fail)?;
    drop(session);
    let routes = routes.lock().map(|r| r.clone()).unwrap_or_default();
    Ok(routes)
}

/// One f32 tensor per layer in the written files (a router bias, attention sinks).
pub(super) struct LayerTensor {
    file: PathBuf,
    offset: u64,
}

/// Finds tensor `name(il)` of every layer: f32 and `values` long.
pub(super) fn find_layer_tensors(
    files: &[PathBuf],
    layers: u32,
    values: u32,
    name: impl Fn(u32) -> String,
) -> Result<Vec<LayerTensor>, SynthError> {
    let mut found = Vec::new();
    for il in 0..layers {
        let name = name(il);
        let hit = files.iter().find_map(|f| {
            let g = GgufFile::open(f).ok()?;
            let t = g.tensor(&name)?;
            (t.ty == ggml_sys::GgmlType::F32 && t.size == 4 * u64::from(values))
                .then(|| LayerTensor { file: f.clone(), offset: t.offset })
        });
        found.push(
            hit.ok_or_else(|| invalid("routing", format!("{name} (f32, {values} values) is not in the written file")))?,
        );
    }
    Ok(found)
}

/// Every layer's router bias (`experts` values) in the written files.
pub(super) fn router_biases(files: &[PathBuf], layers: u32, experts: u32) -> Result<Vec<LayerTensor>, SynthError> {
    find_layer_tensors(files, layers, experts, |il| format!("blk.{il}.ffn_gate_inp.bias"))
}

/// Rewrites each tensor of `tensors` with its layer's `values`.
pub(super) fn write_layers(tensors: &[LayerTensor], values: &[Vec<f32>]) -> Result<(), SynthError> {
    tensors.iter().zip(values).try_for_each(|(t, v)| write_values(t, v))
}

/// Rewrites `t`'s values in place.
pub(super) fn write_values(t: &LayerTensor, values: &[f32]) -> Result<(), SynthError> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let io = |source| SynthError::Io { path: t.file.clone(), source };
    let f = OpenOptions::new().write(true).open(&t.file).map_err(io)?;
    f.write_all_at(&bytes, t.offset).map_err(io)
}

/// What calibration reached.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// Rounds run.
    pub rounds: usize,
    /// The largest difference between an expert's measured and wanted chance of being routed,
    /// over every layer, after the last round.
    pub max_error: f64,
    /// With a reuse target: the attention sink chosen and the reuse it gave.
    pub reuse: Option<(f32, f64)>,
}

/// Calibrates the router biases of the model written to `files` (first file first): `biases`
/// are each layer's written values, `want` each layer's wanted chance per expert of being among
/// a token's top `k`. Rewrites the biases in place and returns how close they came (with the
/// reuse they give, [`Routes::mean_reuse`]) and the biases written.
pub fn calibrate(
    files: &[PathBuf],
    mut biases: Vec<Vec<f32>>,
    want: &[Vec<f64>],
    k: u32,
    threads: u32,
) -> Result<(Calibration, Vec<Vec<f32>>, f64), SynthError> {
    let layers = biases.len() as u32;
    let experts = biases.first().map_or(0, Vec::len) as u32;
    let tensors = router_biases(files, layers, experts)?;
    let prompt = calibration_prompt(CALIBRATION_TOKENS, 7919);
    let tokens = prompt.len() as f64;
    let error_of = |counts: &[Vec<u64>]| {
        want.iter()
            .flatten()
            .zip(counts.iter().flatten())
            .map(|(w, &c)| (c as f64 / tokens - w).abs())
            .fold(0.0, f64::max)
    };
    let mut best: Option<Round> = None;
    let mut step = INITIAL_STEP;
    let mut rounds = 0;
    loop {
        let r = routes(&files[0], &prompt, layers as usize, experts as usize, threads)?;
        rounds += 1;
        let error = error_of(&r.counts);
        log::debug!("synth: routing calibration round {rounds}: largest error {error:.3} (step {step})");
        if best.as_ref().is_none_or(|b| error < b.error) {
            best = Some(Round { biases: biases.clone(), reuse: r.mean_reuse(), counts: r.counts, error });
        } else {
            // Overshot: retry from the best with a shorter step.
            step *= 0.5;
        }
        let Some(from) = best.as_ref() else { break };
        if from.error <= CONVERGED + f64::from(k) / 100.0 || rounds == MAX_ROUNDS {
            break;
        }
        biases = from.biases.clone();
        for ((b, w), c) in biases.iter_mut().zip(want).zip(&from.counts) {
            for ((b, &want), &count) in b.iter_mut().zip(w).zip(c) {
                // Half a count keeps an expert never routed moving up by a bounded step.
                let ratio = (want * tokens + 0.5) / (count as f64 + 0.5);
                *b += step * ratio.ln() as f32;
            }
            let mean = b.iter().sum::<f32>() / b.len() as f32;
            b.iter_mut().for_each(|v| *v -= mean);
        }
        write_layers(&tensors, &biases)?;
    }
    let Round { biases: chosen, error: max_error, reuse, .. } = best.unwrap_or_default();
    if chosen != biases {
        write_layers(&tensors, &chosen)?;
    }
    Ok((Calibration { rounds, max_error, reuse: None }, chosen, reuse))
}

/// A calibration round: the biases it ran with (written or not), what they routed, their
/// largest error and the reuse they gave.
#[derive(Default)]
struct Round {
    biases: Vec<Vec<f32>>,
    counts: Vec<Vec<u64>>,
    error: f64,
    reuse: f64,
}

/// Calibration stops once every expert's chance is within this (plus a point per routed
/// expert) of what it should be.
const CONVERGED: f64 = 0.02;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_is_repeats_over_what_independent_tokens_of_the_same_popularity_repeat() {
        // Two experts chosen first equally often: independent tokens repeat half the time.
        let r = Routes { counts: vec![vec![0; 2]], first: vec![vec![50, 50]], repeats: vec![75], pairs: 99 };
        assert!((r.reuse(0) - 75.0 / 99.0 / 0.5).abs() < 1e-12);
        // One expert always first: every pair repeats, as independent tokens would.
        let r = Routes { counts: vec![vec![0; 2]], first: vec![vec![100, 0]], repeats: vec![99], pairs: 99 };
        assert!((r.mean_reuse() - 1.0).abs() < 1e-12);
    }
}
