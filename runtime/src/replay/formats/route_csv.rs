//! BigMoeOnEdge's `route_trace v1`: `#` lines with the model's shape (`n_layer`, `n_expert`,
//! `n_expert_used`) and each layer's `expert_bytes`, then a CSV of one row per
//! (turn, phase, step, layer, slot) with the routed `expert`; phase 0 is the prompt, 1 a decode.
//! llama.cpp computes the last layer of a prompt only for its last token, so other prompt
//! tokens have no row there.

use std::collections::BTreeMap;
use std::path::Path;

use super::{FormatError, ReadOptions, Routes, Token};

/// The first line of the format.
pub(super) const MAGIC: &str = "# route_trace v1";

#[derive(serde::Deserialize)]
struct Row {
    turn: u32,
    phase: u8,
    step: u32,
    layer: u32,
    slot: u32,
    expert: u32,
}

/// One (turn, phase, step)'s rows: layer -> (slot, expert).
type Cell = BTreeMap<u32, Vec<(u32, u32)>>;

/// Reads a `route_trace v1` file: each turn a sequence, its phase-0 rows the prompt.
pub(super) fn read(path: &Path, options: ReadOptions) -> Result<Routes, FormatError> {
    let bad = |detail: String| FormatError::Bad { path: path.into(), detail };
    let text = super::read_text(path)?;
    let mut routes = Routes::default();
    let mut layer_bytes = BTreeMap::new();
    for line in text.lines().take_while(|l| l.starts_with('#')) {
        let fields: BTreeMap<&str, &str> = line[1..].split_whitespace().filter_map(|kv| kv.split_once('=')).collect();
        let number = |key: &str| -> Result<Option<u64>, FormatError> {
            fields
                .get(key)
                .map(|v| v.parse().map_err(|_| bad(format!("`{key}={v}` in `{line}` is not a number"))))
                .transpose()
        };
        if let Some(model) = fields.get("model") {
            routes.model = model.rsplit('/').next().unwrap_or(model).to_string();
            let shape = |key| number(key)?.ok_or_else(|| bad(format!("the model line has no `{key}=`")));
            routes.n_layer = u32::try_from(shape("n_layer")?).map_err(|_| bad("n_layer is out of range".into()))?;
            routes.n_expert = u32::try_from(shape("n_expert")?).map_err(|_| bad("n_expert is out of range".into()))?;
        } else if let (Some(layer), Some(bytes)) = (number("layer")?, number("expert_bytes")?) {
            layer_bytes.insert(layer, bytes);
        }
    }
    if routes.n_layer == 0 || routes.n_expert == 0 {
        return Err(bad("no `# model=... n_layer=N n_expert=N` line before the rows".into()));
    }
    // Every token's row is sized by the header's layers.
    super::check_shape(routes.n_layer, routes.n_expert).map_err(bad)?;
    if layer_bytes.len() == routes.n_layer as usize && layer_bytes.keys().copied().eq(0..u64::from(routes.n_layer)) {
        routes.layer_bytes = Some(layer_bytes.into_values().collect());
    }
    let mut cells: BTreeMap<(u32, u8, u32), Cell> = BTreeMap::new();
    let mut rows = csv::ReaderBuilder::new().comment(Some(b'#')).from_reader(text.as_bytes());
    let headers = rows.headers().map_err(|e| bad(super::csv_error(&e, None)))?.clone();
    for row in rows.deserialize() {
        let r: Row = row.map_err(|e| bad(super::csv_error(&e, Some(&headers))))?;
        if r.layer >= routes.n_layer {
            return Err(bad(format!("a row names layer {} of the {} layers", r.layer, routes.n_layer)));
        }
        if r.phase > 1 {
            return Err(bad(format!("a row has phase {} (0 is the prompt, 1 a decode)", r.phase)));
        }
        cells.entry((r.turn, r.phase, r.step)).or_default().entry(r.layer).or_default().push((r.slot, r.expert));
    }
    let mut turn = None;
    for ((t, phase, _), layers) in cells {
        if turn != Some(t) {
            turn = Some(t);
            routes.prompts.push(Vec::new());
            routes.sequences.push(Vec::new());
        }
        let token: Token = (0..routes.n_layer)
            .map(|l| {
                layers.get(&l).map(|slots| {
                    let mut slots = slots.clone();
                    slots.sort_unstable();
                    slots.into_iter().map(|(_, e)| e).collect()
                })
            })
            .collect();
        match phase {
            0 if options.prompt => routes.prompts.last_mut().expect("pushed above").push(token),
            0 => {}
            _ => routes.sequences.last_mut().expect("pushed above").push(token),
        }
    }
    Ok(routes)
}
