//! Route traces recorded by other engines, read into a [`RouteTrace`] so `sluice replay` runs
//! them through the same cache, best fixed set and MIN as its own traces.
//!
//! Every format gives, for each token and each MoE layer, the experts the router chose. Tokens
//! become single-token decode steps, the sequences of a trace (a dataset's problems, a folder's
//! prompts) one after another with the cache carried over, as a server would run them. A format
//! that records its prompt's rows can add the prompt first as one batch step per layer
//! ([`ReadOptions::prompt`]), as the engine would plan it; the decode statistics never count it.
//!
//! - [`Format::RouteCsv`]: BigMoeOnEdge's `route_trace v1` CSV (one row per turn, phase, step,
//!   layer and slot; the header gives the model's shape and each layer's expert bytes).
//! - [`Format::SpeculativeMoe`]: the JSON lines of speculative-moe's profiler (one row per
//!   problem, layer and decode token; or, in its `routing_raw` files, per layer and batch
//!   position, prompt then decode). Rows are indexed per layer and a few are missing near the
//!   end of a problem, so each problem keeps the tokens every layer has.
//! - [`Format::MoeBeyond`]: a folder of moe-beyond's `prompt_<n>_data.csv` (one row per layer
//!   and prompt token of one forward pass: with causal attention each token is routed as a
//!   decode of the same text would be).
//! - [`Format::Sluice`]: `sluice bench --trace`'s own file.

mod moe_beyond;
mod route_csv;
mod speculative;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use crate::stream::routes::TokenLayers;
use crate::stream::{CachePolicy, RouteRecord, RouteTrace, TokenRoutes, TraceError};

/// The largest text trace read (a file, or a folder's files together): the public traces are
/// 143 MB at most, and what a trace's text holds, parsed, takes a few times its size.
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// The most experts a trace's model may have over all its layers (a header saying more is not a
/// model's, and the per-layer tables would be sized by it).
const MAX_SHAPE_EXPERTS: u64 = 1 << 24;

/// The text of the trace file at `path`, at most [`MAX_TEXT_BYTES`].
fn read_text(path: &Path) -> Result<String, FormatError> {
    sluice_hal::file::read_regular_string(path, MAX_TEXT_BYTES)
        .map_err(|source| FormatError::Io { path: path.into(), source })
}

/// Whether `n_layer` layers of `n_expert` experts is a model's shape.
fn check_shape(n_layer: u32, n_expert: u32) -> Result<(), String> {
    if n_layer == 0 || u64::from(n_layer) * u64::from(n_expert) > MAX_SHAPE_EXPERTS {
        return Err(format!("{n_layer} layers of {n_expert} experts is not a model's shape"));
    }
    Ok(())
}

/// The bytes each expert is given where a format records none: 1 MiB, so a budget in MiB is
/// a count of experts.
pub const UNSIZED_EXPERT_BYTES: u64 = 1 << 20;

/// A route trace's file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// `sluice bench --trace`'s file.
    Sluice,
    /// BigMoeOnEdge's `route_trace v1` CSV (`*.route.csv`).
    RouteCsv,
    /// speculative-moe's routing JSON lines (`*_routing.jsonl`, `routing_raw`).
    SpeculativeMoe,
    /// A folder of moe-beyond's `prompt_<n>_data.csv`.
    MoeBeyond,
}

/// How a foreign trace is read.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Add the prompt's rows, where the format has them, as one batch step per layer before the
    /// decodes (the engine plans a prompt so).
    pub prompt: bool,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Reading the file or folder failed.
    #[error("route trace {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The contents are not the format's.
    #[error("route trace {path}: {detail}")]
    Bad {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        detail: String,
    },
    /// The format could not be told from the contents.
    #[error(
        "route trace {0}: not a format sluice reads (a sluice trace, a BigMoeOnEdge *.route.csv, \
         speculative-moe JSON lines or a folder of moe-beyond prompt_<n>_data.csv); name it with --format"
    )]
    Unknown(PathBuf),
    /// A sluice trace could not be read.
    #[error(transparent)]
    Sluice(#[from] TraceError),
}

/// The routes of one trace before they become steps: sequences of tokens, each token a list
/// over MoE layers of the routed experts (`None` where the source has no row for the layer).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Routes {
    /// The model's name, for reports.
    pub model: String,
    /// MoE layers.
    pub n_layer: u32,
    /// Experts per layer (0: one more than the largest id seen).
    pub n_expert: u32,
    /// Each layer's expert bytes where the source records them.
    pub layer_bytes: Option<Vec<u64>>,
    /// The prompt rows of each sequence (empty where the format has none, or not asked).
    pub prompts: Vec<Vec<Token>>,
    /// The decode rows of each sequence.
    pub sequences: Vec<Vec<Token>>,
}

/// One token's routed experts per layer.
pub(crate) type Token = Vec<Option<Vec<u32>>>;

/// Tells the format of `path` from its contents: a folder is moe-beyond's; a file by its first
/// bytes.
pub fn detect(path: &Path) -> Result<Format, FormatError> {
    let io = |source| FormatError::Io { path: path.into(), source };
    if std::fs::metadata(path).map_err(io)?.is_dir() {
        return Ok(Format::MoeBeyond);
    }
    let mut head = [0u8; 64];
    let n = std::io::Read::read(&mut std::fs::File::open(path).map_err(io)?, &mut head).map_err(io)?;
    let head = &head[..n];
    if head.starts_with(crate::stream::trace::MAGIC) {
        Ok(Format::Sluice)
    } else if head.starts_with(route_csv::MAGIC.as_bytes()) {
        Ok(Format::RouteCsv)
    } else if head.trim_ascii_start().starts_with(b"{") {
        Ok(Format::SpeculativeMoe)
    } else {
        Err(FormatError::Unknown(path.into()))
    }
}

/// Reads the trace at `path` in `format` (told from the contents when `None`).
pub fn read(path: &Path, format: Option<Format>, options: ReadOptions) -> Result<RouteTrace, FormatError> {
    let format = match format {
        Some(f) => f,
        None => detect(path)?,
    };
    let routes = match format {
        Format::Sluice => return Ok(RouteTrace::load(path)?),
        Format::RouteCsv => route_csv::read(path, options)?,
        Format::SpeculativeMoe => speculative::read(path, options)?,
        Format::MoeBeyond => moe_beyond::read(path)?,
    };
    into_trace(routes).map_err(|detail| FormatError::Bad { path: path.into(), detail })
}

/// Reads the trace at `path` in `format` (told from the contents when `None`) as its tokens in
/// order, each sequence's prompt rows before its decodes, for forcing them on a model
/// (`--routes`). A sluice trace gives its single-token decodes; one that planned a batch of
/// tokens as one step (a prompt) has no routes per token and is refused.
pub fn read_tokens(path: &Path, format: Option<Format>) -> Result<TokenRoutes, FormatError> {
    let format = match format {
        Some(f) => f,
        None => detect(path)?,
    };
    let bad = |detail: String| FormatError::Bad { path: path.into(), detail };
    let with_prompt = ReadOptions { prompt: true };
    let routes = match format {
        Format::Sluice => return sluice_tokens(path),
        Format::RouteCsv => route_csv::read(path, with_prompt)?,
        Format::SpeculativeMoe => speculative::read(path, with_prompt)?,
        Format::MoeBeyond => moe_beyond::read(path)?,
    };
    n_expert(&routes).map_err(bad)?;
    let mut tokens = Vec::new();
    for (i, sequence) in routes.sequences.into_iter().enumerate() {
        tokens.extend(routes.prompts.get(i).into_iter().flatten().cloned());
        tokens.extend(sequence);
    }
    Ok(TokenRoutes { model: routes.model, n_layer: routes.n_layer, n_expert: routes.n_expert, tokens })
}

/// A sluice trace's single-token decodes as tokens.
fn sluice_tokens(path: &Path) -> Result<TokenRoutes, FormatError> {
    let trace = RouteTrace::load(path)?;
    let mut tokens: Vec<TokenLayers> = Vec::new();
    let mut decode = None;
    for step in &trace.steps {
        if step.tokens != 1 {
            return Err(FormatError::Bad {
                path: path.into(),
                detail: format!(
                    "decode {} planned a batch of {} tokens as one step, without each token's experts; record routes per token with `sluice run --record-routes FILE`",
                    step.decode, step.tokens
                ),
            });
        }
        if decode != Some(step.decode) {
            decode = Some(step.decode);
            tokens.push(vec![None; trace.n_layer as usize]);
        }
        if let Some(token) = tokens.last_mut() {
            token[step.layer as usize] = Some(step.experts.clone());
        }
    }
    Ok(TokenRoutes { model: trace.model, n_layer: trace.n_layer, n_expert: trace.n_expert, tokens })
}

/// The experts per layer `routes` declares, or one more than the largest id it routes; checks
/// that every id is below it.
fn n_expert(routes: &Routes) -> Result<u32, String> {
    let every = routes.prompts.iter().chain(&routes.sequences).flatten().flatten().flatten().flatten();
    let n_expert = match every.clone().max() {
        _ if routes.n_expert > 0 => routes.n_expert,
        Some(&m) => m + 1,
        None => return Err("no routed experts in it".into()),
    };
    if let Some(e) = every.clone().find(|&&e| e >= n_expert) {
        return Err(format!("expert id {e} is out of range for the {n_expert} experts the header declares"));
    }
    Ok(n_expert)
}

/// The steps of `routes`: per sequence its prompt as one batch step per layer (the union of its
/// tokens' experts), then each token's layers as single-token decodes.
fn into_trace(routes: Routes) -> Result<RouteTrace, String> {
    let n_expert = n_expert(&routes)?;
    check_shape(routes.n_layer, n_expert)?;
    let expert_bytes = match &routes.layer_bytes {
        Some(b) => b.iter().flat_map(|&b| std::iter::repeat_n(b, n_expert as usize)).collect(),
        None => vec![UNSIZED_EXPERT_BYTES; (routes.n_layer * n_expert) as usize],
    };
    let mut steps = Vec::new();
    let mut decode = 0u64;
    let empty = Vec::new();
    for (i, sequence) in routes.sequences.iter().enumerate() {
        let prompt = routes.prompts.get(i).unwrap_or(&empty);
        if !prompt.is_empty() {
            for layer in 0..routes.n_layer {
                let experts = distinct(prompt.iter().filter_map(|t| t[layer as usize].as_ref()).flatten(), n_expert);
                if !experts.is_empty() {
                    let tokens = prompt.len().try_into().unwrap_or(u32::MAX);
                    steps.push(RouteRecord { decode, layer, tokens, staged: true, experts });
                }
            }
            decode += 1;
        }
        for token in sequence {
            for (layer, experts) in token.iter().enumerate() {
                if let Some(experts) = experts {
                    let experts = distinct(experts.iter(), n_expert);
                    steps.push(RouteRecord { decode, layer: layer as u32, tokens: 1, staged: true, experts });
                }
            }
            decode += 1;
        }
    }
    Ok(RouteTrace {
        model: routes.model,
        n_layer: routes.n_layer,
        n_expert,
        expert_bytes,
        staging: 0,
        budget: 0,
        policy: CachePolicy::Frequency,
        steps,
    })
}

/// The ids of `ids` (each below `n_expert`), each once, in the order first seen.
fn distinct<'a>(ids: impl Iterator<Item = &'a u32>, n_expert: u32) -> Vec<u32> {
    let mut seen = vec![false; n_expert as usize];
    ids.copied().filter(|&e| !std::mem::replace(&mut seen[e as usize], true)).collect()
}

/// A CSV reader's error as "line N: column `name`: what", naming the column where the error
/// is in one.
fn csv_error(e: &csv::Error, headers: Option<&csv::StringRecord>) -> String {
    match e.kind() {
        csv::ErrorKind::Deserialize { pos: Some(pos), err } => {
            let column = err.field().and_then(|i| headers?.get(i as usize));
            match column {
                Some(c) => format!("line {}: column `{c}`: {}", pos.line(), err.kind()),
                None => format!("line {}: {}", pos.line(), err.kind()),
            }
        }
        _ => e.to_string(),
    }
}

/// Checks that a sequence's layer ids `ids` are those of the first sequence (kept in `first`).
/// Returns the first sequence's ids where they differ.
fn same_layers(first: &mut Option<Vec<u32>>, ids: Vec<u32>) -> Result<(), Vec<u32>> {
    match first {
        None => {
            *first = Some(ids);
            Ok(())
        }
        Some(f) if *f != ids => Err(f.clone()),
        Some(_) => Ok(()),
    }
}
