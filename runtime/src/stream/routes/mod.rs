//! Routes per token: the recorded routes `--routes FILE` forces on a model's routers
//! ([`force`]), and the routes a run records for that (`--record-routes FILE`, [`record`]).
//!
//! Forcing is a measuring tool: every MoE layer's top-k choice of every computed token is
//! replaced by the file's, so the reads, the cache, waves, overlap and the ledger run exactly as
//! they would on the model that made the routes, while the text is not this model's own (lossy
//! by construction). The file's tokens go to the run's computed tokens in order, the prompt's
//! first; a file shorter than the run wraps or stops the run ([`RoutesEnd`]).
//!
//! Which token a row of a top-k node is: a graph's first MoE layer has a row per token of its
//! batch; a layer with fewer rows (llama.cpp computes the last layer for the output rows only)
//! has the batch's last tokens. A layer no deeper than the one before starts the next graph.

pub mod force;
pub mod record;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::ExpertIndex;
use force::RouteForcer;

/// Recorded routes to force on a run: the file they came from, and what a run longer than
/// them does.
#[derive(Debug, Clone)]
pub struct ForcedRoutes {
    /// The file.
    pub path: PathBuf,
    /// The routes.
    pub routes: Arc<TokenRoutes>,
    /// Past their end.
    pub end: RoutesEnd,
}

impl ForcedRoutes {
    /// The forcer of these routes on the model `index` describes, each token routed to `used`
    /// experts, once they are checked to fit it ([`TokenRoutes::check_fits`]).
    pub fn forcer(&self, index: &ExpertIndex, used: u32) -> Result<RouteForcer, RoutesError> {
        self.routes.check_fits(&self.path, index, used)?;
        Ok(RouteForcer::new(Arc::clone(&self.routes), self.end))
    }

    /// The same tokens' work on the fewest experts: every token routed, in every layer it routes,
    /// to experts 0 to k-1 of it (k its own count), so that a cache holding a few experts a layer
    /// holds them all. A routed expert's product costs the same whichever expert it is: a run of
    /// these routes with the cache warm measures the computation of the recorded ones with no read.
    pub fn folded(&self) -> ForcedRoutes {
        let fold =
            |layers: &TokenLayers| layers.iter().map(|l| l.as_ref().map(|e| (0..e.len() as u32).collect())).collect();
        let routes = TokenRoutes { tokens: self.routes.tokens.iter().map(fold).collect(), ..(*self.routes).clone() };
        ForcedRoutes { path: self.path.clone(), routes: Arc::new(routes), end: RoutesEnd::Wrap }
    }

    /// Routes for a model of `index`'s shape that send every token to its experts 0 to `used`-1
    /// in every layer with experts, from `path` (the model, for messages): [`ForcedRoutes::folded`]
    /// where no routes were recorded.
    pub fn fixed(index: &ExpertIndex, used: u32, path: &Path) -> ForcedRoutes {
        let token = (0..index.n_layer).map(|l| index.layer_tensors(l).next().map(|_| (0..used).collect())).collect();
        let routes = TokenRoutes {
            model: path.display().to_string(),
            n_layer: index.n_layer,
            n_expert: index.n_expert,
            tokens: vec![token],
        };
        ForcedRoutes { path: path.into(), routes: Arc::new(routes), end: RoutesEnd::Wrap }
    }

    /// The forcer of these routes on a run of the model `index` describes, each token routed to
    /// `used` experts ([`ForcedRoutes::forcer`]), and how many of the `n_predict` tokens asked
    /// the run may generate after a prompt of `prompt` tokens ([`TokenRoutes::tokens_after`]).
    pub fn fit(
        &self,
        index: &ExpertIndex,
        used: u32,
        prompt: usize,
        n_predict: u32,
    ) -> Result<(RouteForcer, u32), RoutesError> {
        let forcer = self.forcer(index, used)?;
        Ok((forcer, self.routes.tokens_after(&self.path, prompt, n_predict, self.end)?))
    }

    /// Sets `config` up to force these routes on the model `index` describes (its
    /// `--experts-used` included); returns the tokens the run may generate ([`ForcedRoutes::fit`]).
    pub fn apply(
        &self,
        config: &mut super::StreamConfig,
        index: &ExpertIndex,
        prompt: usize,
        n_predict: u32,
    ) -> Result<u32, RoutesError> {
        let used = config.lossy.experts_used.unwrap_or(index.n_expert_used);
        let (forcer, n) = self.fit(index, used, prompt, n_predict)?;
        config.force_routes = Some(forcer);
        Ok(n)
    }
}

/// One token's routed experts per layer, each list in the router's rank order (`None`: the
/// recording has no row for the layer, and the model's own router chooses there).
pub type TokenLayers = Vec<Option<Vec<u32>>>;

/// A run's tokens' routes, in the order the tokens were computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRoutes {
    /// The model that made them (for reports).
    pub model: String,
    /// Layers.
    pub n_layer: u32,
    /// Experts per layer (0: the file does not say).
    pub n_expert: u32,
    /// Every token's routes.
    pub tokens: Vec<TokenLayers>,
}

/// What a run does when it needs more tokens than the recorded routes have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoutesEnd {
    /// The run generates only as many tokens as the routes have after its prompt.
    #[default]
    Stop,
    /// The routes start again from their first token.
    Wrap,
}

/// Why recorded routes cannot be forced on a model.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    /// The routes were made by a model of another shape.
    #[error("--routes {path}: {detail}; give routes recorded from a model of this shape (`sluice replay --trace FILE` shows a file's)")]
    Shape {
        /// The file.
        path: PathBuf,
        /// What differs.
        detail: String,
    },
    /// The run is longer than the routes and they do not wrap.
    #[error("--routes {path} has {routes} tokens and the prompt alone takes {prompt}; give --routes-end wrap, or a shorter prompt")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Tokens in the routes.
        routes: usize,
        /// Tokens in the prompt.
        prompt: usize,
    },
    /// The routes could not be written.
    #[error("--record-routes {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl TokenRoutes {
    /// Checks that these routes, read from `path`, fit the model `index` describes when each
    /// token routes to `used` experts (the model's count, or the lossy `--experts-used`): the
    /// same layers and experts, a list of at least `used` experts in every routed layer (more
    /// are cut to the first `used`: fewer experts than recorded), and none in a layer without
    /// experts.
    pub fn check_fits(&self, path: &Path, index: &ExpertIndex, used: u32) -> Result<(), RoutesError> {
        let shape = |detail: String| RoutesError::Shape { path: path.into(), detail };
        if self.tokens.is_empty() {
            return Err(shape("it has no tokens".into()));
        }
        if self.n_layer != index.n_layer || ![0, index.n_expert].contains(&self.n_expert) {
            return Err(shape(format!(
                "it routes {} layers of {} experts, and the model has {} layers of {}",
                self.n_layer, self.n_expert, index.n_layer, index.n_expert
            )));
        }
        for (n, token) in self.tokens.iter().enumerate() {
            for (layer, experts) in token.iter().enumerate() {
                let Some(experts) = experts else { continue };
                let layer = layer as u32;
                if index.layer_tensors(layer).next().is_none() {
                    return Err(shape(format!("token {n} routes layer {layer}, which has no experts in the model")));
                }
                if experts.len() < used as usize {
                    return Err(shape(format!(
                        "token {n} routes {} experts in layer {layer}, and the model routes {used} (give --experts-used {} to run it with as many)",
                        experts.len(),
                        experts.len()
                    )));
                }
                if let Some(e) = experts.iter().find(|&&e| e >= index.n_expert) {
                    return Err(shape(format!("token {n} routes expert {e} in layer {layer}, of {}", index.n_expert)));
                }
            }
        }
        Ok(())
    }

    /// Tokens a run may generate after a prompt of `prompt` tokens: what the routes have left
    /// (`end` stop), or `wanted` (wrap).
    pub fn tokens_after(&self, path: &Path, prompt: usize, wanted: u32, end: RoutesEnd) -> Result<u32, RoutesError> {
        match end {
            RoutesEnd::Wrap => Ok(wanted),
            RoutesEnd::Stop if prompt >= self.tokens.len() => {
                Err(RoutesError::TooShort { path: path.into(), routes: self.tokens.len(), prompt })
            }
            RoutesEnd::Stop => Ok(wanted.min(u32::try_from(self.tokens.len() - prompt).unwrap_or(u32::MAX))),
        }
    }
}

/// Which token of a run each row of a top-k node is (see the module's text).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TokenCursor {
    /// The token number of the graph's first row.
    base: u64,
    /// Tokens in the graph's batch.
    batch: u64,
    /// The layer of the node before.
    last_layer: Option<u32>,
}

impl TokenCursor {
    /// At the top-k node of `layer` with `rows` rows: the token number of its first row.
    pub(crate) fn first_row(&mut self, layer: u32, rows: u64) -> u64 {
        if self.last_layer.is_none_or(|l| layer <= l) {
            self.base += self.batch;
            self.batch = rows;
        }
        self.last_layer = Some(layer);
        self.base + self.batch.saturating_sub(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_numbers_a_batch_its_output_layer_and_the_next_graphs() {
        let mut c = TokenCursor::default();
        // A prompt of 5: layers 0 and 1 have every token, the last layer its output row.
        assert_eq!([c.first_row(0, 5), c.first_row(1, 5), c.first_row(2, 1)], [0, 0, 4]);
        // Two single-token decodes.
        assert_eq!([c.first_row(0, 1), c.first_row(1, 1), c.first_row(2, 1)], [5, 5, 5]);
        assert_eq!(c.first_row(0, 1), 6);
    }

    #[test]
    fn folded_routes_keep_each_tokens_work_on_the_fewest_experts() {
        let tokens = vec![vec![None, Some(vec![7, 3])], vec![None, Some(vec![1, 6])]];
        let routes = TokenRoutes { model: "m".into(), n_layer: 2, n_expert: 8, tokens };
        let forced = ForcedRoutes { path: "r.csv".into(), routes: Arc::new(routes), end: RoutesEnd::Stop };
        let folded = forced.folded();
        assert_eq!(folded.routes.tokens, vec![vec![None, Some(vec![0, 1])]; 2]);
        assert_eq!((folded.routes.n_layer, folded.routes.n_expert, folded.end), (2, 8, RoutesEnd::Wrap));
    }

    #[test]
    fn a_stopping_run_is_cut_to_the_routes_it_has() {
        let routes = TokenRoutes { model: "m".into(), n_layer: 1, n_expert: 4, tokens: vec![vec![None]; 10] };
        let p = std::path::Path::new("r.csv");
        assert_eq!(routes.tokens_after(p, 4, 64, RoutesEnd::Stop).unwrap(), 6);
        assert_eq!(routes.tokens_after(p, 4, 3, RoutesEnd::Stop).unwrap(), 3);
        assert_eq!(routes.tokens_after(p, 12, 64, RoutesEnd::Wrap).unwrap(), 64);
        let e = routes.tokens_after(p, 10, 1, RoutesEnd::Stop).unwrap_err().to_string();
        assert!(e.contains("r.csv has 10 tokens and the prompt alone takes 10"), "{e}");
    }
}
