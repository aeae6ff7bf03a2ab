//! moe-beyond's training data: a folder of `prompt_<n>_data.csv`, each one forward pass over a
//! prompt with a row per (layer, token): `Layer ID,Batch Number,Token,Activated Expert IDs`,
//! the ids a JSON list. The prompts are read in the order of `n`; each is a sequence of
//! decode-like tokens (causal attention routes token t as a decode of the same text would).

use std::collections::BTreeMap;
use std::path::Path;

use super::{FormatError, Routes, Token};

#[derive(serde::Deserialize)]
struct Row {
    #[serde(rename = "Layer ID")]
    layer: u32,
    #[serde(rename = "Activated Expert IDs")]
    experts: String,
}

/// Reads every `prompt_<n>_data.csv` in the folder `dir`.
pub(super) fn read(dir: &Path) -> Result<Routes, FormatError> {
    let io = |path: &Path, source| FormatError::Io { path: path.into(), source };
    let mut files: Vec<(u64, std::path::PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let path = entry.map_err(|e| io(dir, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if let Some(n) = name.strip_prefix("prompt_").and_then(|n| n.strip_suffix("_data.csv")) {
            if let Ok(n) = n.parse() {
                files.push((n, path));
            }
        }
    }
    if files.is_empty() {
        return Err(FormatError::Bad { path: dir.into(), detail: "no prompt_<n>_data.csv in the folder".into() });
    }
    files.sort();
    let mut total = 0u64;
    for (_, path) in &files {
        total += std::fs::metadata(path).map_err(|e| io(path, e))?.len();
    }
    if total > super::MAX_TEXT_BYTES {
        let detail = format!("its CSVs hold {total} bytes, over the {} a trace may have", super::MAX_TEXT_BYTES);
        return Err(FormatError::Bad { path: dir.into(), detail });
    }
    let mut routes =
        Routes { model: dir.file_name().unwrap_or_default().to_string_lossy().into(), ..Routes::default() };
    let mut layer_ids: Option<Vec<u32>> = None;
    for (_, path) in &files {
        let bad = |detail: String| FormatError::Bad { path: path.clone(), detail };
        let mut per_layer: BTreeMap<u32, Vec<Vec<u32>>> = BTreeMap::new();
        let mut rows = csv::Reader::from_path(path).map_err(|e| bad(super::csv_error(&e, None)))?;
        let headers = rows.headers().map_err(|e| bad(super::csv_error(&e, None)))?.clone();
        for (i, row) in rows.deserialize().enumerate() {
            let r: Row = row.map_err(|e| bad(super::csv_error(&e, Some(&headers))))?;
            let experts: Vec<u32> = serde_json::from_str(&r.experts)
                .map_err(|e| bad(format!("row {}: `{}` is not a list of expert ids: {e}", i + 1, r.experts)))?;
            per_layer.entry(r.layer).or_default().push(experts);
        }
        let ids: Vec<u32> = per_layer.keys().copied().collect();
        super::same_layers(&mut layer_ids, ids.clone())
            .map_err(|first| bad(format!("its layers {ids:?} are not the first file's {first:?}")))?;
        let n = per_layer.values().map(Vec::len).min().unwrap_or(0);
        routes
            .sequences
            .push((0..n).map(|t| per_layer.values().map(|rows| Some(rows[t].clone())).collect::<Token>()).collect());
    }
    routes.n_layer = layer_ids.map_or(0, |ids| ids.len() as u32);
    Ok(routes)
}
