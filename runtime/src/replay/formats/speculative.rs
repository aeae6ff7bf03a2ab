//! speculative-moe's routing profiler: JSON lines with `problem_id`, `layer` and `experts`, and
//! either `token_idx` (a decode token, counted per layer) or, in its `routing_raw` files,
//! `token_pos` (the batch position: the prompt's rows 0..P-1 of each layer, then a row per
//! decode, each at position 0).
//!
//! Rows are counted per layer, and the profiler dropped a few near a problem's end (those whose
//! two gate weights were exactly 0.5), so each problem (and each phase of a raw file) keeps the
//! tokens every layer has.

use std::collections::BTreeMap;
use std::path::Path;

use super::{FormatError, ReadOptions, Routes, Token};

#[derive(serde::Deserialize)]
struct Row {
    problem_id: u64,
    layer: u32,
    experts: Vec<u32>,
    token_idx: Option<u64>,
    token_pos: Option<u64>,
}

/// One layer's rows of a problem, in file order: (prompt, decode).
type Phases = (Vec<Vec<u32>>, Vec<Vec<u32>>);

/// One problem's rows per layer.
type Problem = BTreeMap<u32, Phases>;

/// Reads a speculative-moe routing file: each problem a sequence.
pub(super) fn read(path: &Path, options: ReadOptions) -> Result<Routes, FormatError> {
    let bad = |detail: String| FormatError::Bad { path: path.into(), detail };
    let text = super::read_text(path)?;
    let mut problems: BTreeMap<u64, Problem> = BTreeMap::new();
    // (problem, layer) -> the last token_pos seen, to find where a raw file's decode begins.
    let mut last_pos: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let r: Row = serde_json::from_str(line).map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
        let rows = problems.entry(r.problem_id).or_default().entry(r.layer).or_default();
        match (r.token_idx, r.token_pos) {
            (Some(t), _) => {
                if t != rows.1.len() as u64 {
                    return Err(bad(format!(
                        "line {}: token_idx {t} of problem {} layer {} follows {} rows",
                        i + 1,
                        r.problem_id,
                        r.layer,
                        rows.1.len()
                    )));
                }
                rows.1.push(r.experts);
            }
            (None, Some(pos)) => {
                let last = last_pos.insert((r.problem_id, r.layer), pos);
                // The prompt counts up from 0; a decode row (position 0) after it starts the decode.
                if rows.1.is_empty() && !(pos == 0 && last.is_some_and(|l| l > 0)) {
                    rows.0.push(r.experts);
                } else {
                    rows.1.push(r.experts);
                }
            }
            (None, None) => return Err(bad(format!("line {}: neither token_idx nor token_pos", i + 1))),
        }
    }
    let mut routes =
        Routes { model: path.file_name().unwrap_or_default().to_string_lossy().into(), ..Routes::default() };
    let mut layer_ids: Option<Vec<u32>> = None;
    for (id, layers) in &problems {
        let ids: Vec<u32> = layers.keys().copied().collect();
        super::same_layers(&mut layer_ids, ids.clone())
            .map_err(|first| bad(format!("problem {id} has layers {ids:?}, the first problem {first:?}")))?;
        let tokens = |rows: &dyn Fn(&Phases) -> &Vec<Vec<u32>>| -> Vec<Token> {
            let n = layers.values().map(|l| rows(l).len()).min().unwrap_or(0);
            (0..n).map(|t| layers.values().map(|l| Some(rows(l)[t].clone())).collect()).collect()
        };
        routes.prompts.push(if options.prompt { tokens(&|l| &l.0) } else { Vec::new() });
        routes.sequences.push(tokens(&|l| &l.1));
    }
    routes.n_layer = layer_ids.map_or(0, |ids| ids.len() as u32);
    Ok(routes)
}
