//! Token-to-token reuse for synthetic models: consecutive tokens that route to the same experts.
//!
//! A trained router sees hidden states that change little from one token to the next, so
//! consecutive tokens often share experts. Mixtral's routing analysis (Jiang et al. 2024,
//! "Mixtral of Experts", arXiv 2401.04088, section 5 and its table of expert assignment
//! repetitions) measured it on The Pile: a token's first-choice expert is the next token's
//! first choice in about 26-28% of pairs in the middle layer (layer 15 of 32), against 12.5% for
//! independent tokens over 8 balanced experts, and about 14% (near chance) in the first layer.
//! A random model has none of that: its attention mixes tokens at random.
//!
//! `--reuse L` asks for `L` times the first-choice repeats of independent tokens of the same
//! popularity ([`super::calibrate::Routes::reuse`]); the default 2.2 is that middle layer's ratio.
//! It is written into gpt-oss's attention: zero queries make each position of a local
//! (sliding-window) layer weigh the 16 tokens behind it alike, so consecutive positions, sharing
//! all but one of them, get almost the same attention output, and tokens further apart share
//! nothing: reuse between neighbours, not a drift over the whole prompt. Strong values in the local
//! layers ([`VALUE_GAIN`]) let that shared part steer the router; each head's attention sink, an
//! f32 logit that takes attention away from every position, sets how much of it reaches the hidden
//! state. The global layers' sinks are closed ([`CLOSED_SINK`]): averaging the whole prefix would
//! add a slow drift that moves every expert's popularity with the prompt. Synth searches the local
//! sink that gives the asked-for reuse on the written model itself, calibrating popularity anew for
//! each value tried (the two move each other).

use std::path::PathBuf;

use super::calibrate::{find_layer_tensors, router_biases, write_layers, write_values, Calibration};
use super::{SynthError, SynthSpec};

/// The default reuse: Mixtral's middle-layer ratio of first-choice repeats to chance.
pub const DEFAULT_REUSE: f64 = 2.2;

/// The largest reuse `--reuse` accepts. What a model can reach depends on its shape (about 3x
/// for small ones); synth reports what it reached.
pub const MAX_REUSE: f64 = 3.0;

/// The local layers' attention value weights' gain when reuse is asked for: the window's mean
/// value must be able to outweigh a token's own state. Only the local layers: ggml's CPU flash
/// attention sums a single query's weighted values in f16 before it divides by their weight, so
/// with zero queries a layer adds up every cell it sees; the window's 17 cells stay far below
/// f16's 65,504, a global layer's thousands do not (their values keep unit gain).
pub const VALUE_GAIN: f32 = 96.0;

/// The local layers' attention sink logit before the search.
pub const INITIAL_SINK: f32 = 4.0;

/// The global layers' sink logit: e^20 against at most a few thousand positions leaves their
/// attention a millionth of its weight.
pub const CLOSED_SINK: f32 = 20.0;

/// Whether gpt-oss layer `il` is local (sliding-window): llama.cpp's pattern for gpt-oss makes
/// every even layer local and every odd one global.
pub fn is_local(il: u32) -> bool {
    il % 2 == 0
}

/// The sink logits searched: at the low end attention reaches the state in full, at the high
/// end it is all but gone (reuse near 1).
const SINK_RANGE: (f32, f32) = (-4.0, 16.0);

/// Rounds of the search (each halves the range).
const ROUNDS: usize = 8;

/// Calibrates the skewed gpt-oss model written to `files` from `spec` for its popularity and
/// its reuse: each value of the attention sink tried (a search that halves its range each
/// round) gets the router biases calibrated anew from the last ones (`popularity`: biases in,
/// calibration, biases and reuse out), since the biases change the reuse a sink gives. Writes
/// the best sink and its biases.
pub fn calibrate(
    files: &[PathBuf],
    spec: &SynthSpec,
    mut biases: Vec<Vec<f32>>,
    popularity: impl Fn(Vec<Vec<f32>>) -> Result<(Calibration, Vec<Vec<f32>>, f64), SynthError>,
) -> Result<Calibration, SynthError> {
    let (layers, heads) = (spec.layers, spec.heads as usize);
    let target = spec.reuse.unwrap_or(1.0);
    let sinks = find_layer_tensors(files, layers, heads as u32, |il| format!("blk.{il}.attn_sinks.weight"))?;
    let local: Vec<_> = sinks.iter().zip(0..).filter(|(_, il)| is_local(*il)).map(|(t, _)| t).collect();
    let write_sinks = |value: f32| local.iter().try_for_each(|t| write_values(t, &vec![value; heads]));
    let (mut lo, mut hi) = SINK_RANGE;
    let mut rounds = 0;
    let mut best: Option<(f64, f32, Vec<Vec<f32>>, Calibration)> = None; // error, sink, biases
    for round in 1..=ROUNDS {
        let sink = (lo + hi) / 2.0;
        write_sinks(sink)?;
        let (c, b, reuse) = popularity(biases)?;
        rounds += c.rounds;
        log::debug!(
            "synth: reuse search round {round}: sink {sink:.3} gives reuse {reuse:.3}, popularity within {:.3}",
            c.max_error
        );
        let error = (reuse / target).ln().abs();
        if best.as_ref().is_none_or(|(e, ..)| error < *e) {
            best = Some((error, sink, b.clone(), Calibration { reuse: Some((sink, reuse)), ..c }));
        }
        biases = b;
        // More sink, less of the shared window in the state, less reuse.
        if reuse > target {
            lo = sink;
        } else {
            hi = sink;
        }
    }
    let Some((_, sink, chosen, c)) = best else { return Err(super::invalid("reuse", "no search round ran")) };
    write_sinks(sink)?;
    write_layers(&router_biases(files, layers, spec.experts)?, &chosen)?;
    Ok(Calibration { rounds, ..c })
}
