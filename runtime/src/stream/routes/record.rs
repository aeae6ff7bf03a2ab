//! Recording a run's routes per token (`sluice run --record-routes FILE`), written as
//! BigMoeOnEdge's `route_trace v1` CSV: the format of the public Qwen3, Gemma-4 and gpt-oss
//! traces, which `sluice replay` and `--routes` read back.

use std::io::Write;
use std::path::Path;

use ggml_sys::TensorView;

use super::{RoutesError, TokenCursor, TokenRoutes};
use crate::stream::StreamError;

/// Records every top-k node's rows as the routes of the tokens they are.
#[derive(Debug)]
pub struct RouteRecorder {
    routes: TokenRoutes,
    cursor: TokenCursor,
}

impl RouteRecorder {
    /// An empty recording of a model of `n_layer` layers of `n_expert` experts.
    pub fn new(n_layer: u32, n_expert: u32) -> RouteRecorder {
        RouteRecorder {
            routes: TokenRoutes { model: String::new(), n_layer, n_expert, tokens: Vec::new() },
            cursor: TokenCursor::default(),
        }
    }

    /// Records the top-k node `t` of `layer` (`ne = [k, rows]`).
    pub fn observe(&mut self, t: TensorView<'_>, layer: u32) -> Result<(), StreamError> {
        let [k, rows, ..] = t.ne();
        let first = self.cursor.first_row(layer, rows.max(0) as u64);
        for row in 0..rows.max(0) as usize {
            let experts = (0..k.max(0) as usize)
                .map(|j| t.i32_at(j, row).and_then(|e| u32::try_from(e).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| StreamError::Graph(format!("{}: a row could not be read", t.name())))?;
            let n = first as usize + row;
            if self.routes.tokens.len() <= n {
                self.routes.tokens.resize(n + 1, vec![None; self.routes.n_layer as usize]);
            }
            if let Some(slot) = self.routes.tokens[n].get_mut(layer as usize) {
                *slot = Some(experts);
            }
        }
        Ok(())
    }

    /// The routes recorded so far.
    pub fn routes(&self) -> &TokenRoutes {
        &self.routes
    }
}

/// What a `route_trace v1` file says of the model beside its rows.
#[derive(Debug, Clone, Copy)]
pub struct RouteCsvHeader<'a> {
    /// The architecture (llama.cpp's name).
    pub arch: &'a str,
    /// Experts per token.
    pub n_expert_used: u32,
    /// Each layer's bytes per expert (0 for a layer without experts).
    pub layer_bytes: &'a [u64],
    /// The run's first `prompt` tokens are its prompt (phase 0), the others decodes (phase 1).
    pub prompt: usize,
}

/// Writes `routes` to `path` as a `route_trace v1` CSV, one turn.
pub fn write_route_csv(path: &Path, routes: &TokenRoutes, header: RouteCsvHeader<'_>) -> Result<(), RoutesError> {
    let write = || -> std::io::Result<()> {
        let mut out = Vec::new();
        writeln!(out, "# route_trace v1")?;
        writeln!(
            out,
            "# model={} arch={} n_layer={} n_expert={} n_expert_used={}",
            routes.model, header.arch, routes.n_layer, routes.n_expert, header.n_expert_used
        )?;
        for (layer, bytes) in header.layer_bytes.iter().enumerate() {
            writeln!(out, "# layer={layer} expert_bytes={bytes}")?;
        }
        let mut rows = csv::Writer::from_writer(&mut out);
        rows.write_record(["turn", "phase", "step", "layer", "slot", "expert"])?;
        for (n, token) in routes.tokens.iter().enumerate() {
            let (phase, step) = if n < header.prompt { (0, n) } else { (1, n - header.prompt) };
            for (layer, experts) in token.iter().enumerate() {
                for (slot, e) in experts.iter().flatten().enumerate() {
                    rows.serialize((0, phase, step, layer, slot, e))?;
                }
            }
        }
        rows.flush()?;
        drop(rows);
        crate::framed::write_atomically(path, &out)
    };
    write().map_err(|source| RoutesError::Write { path: path.into(), source })
}
