//! Forcing recorded routes on the routers: each top-k node's rows rewritten with the recorded
//! experts of the tokens they are, before the layer's products and routing weights read them.

use std::sync::Arc;

use ggml_sys::{EvalCallback, EvalPhase, TensorView};

use super::{RoutesEnd, TokenCursor, TokenRoutes};
use crate::stream::StreamError;

/// Forces a run's routes from recorded ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteForcer {
    routes: Arc<TokenRoutes>,
    end: RoutesEnd,
    cursor: TokenCursor,
}

impl RouteForcer {
    /// Forces `routes` from the run's first computed token on; past their end as `end` says.
    pub fn new(routes: Arc<TokenRoutes>, end: RoutesEnd) -> RouteForcer {
        RouteForcer { routes, end, cursor: TokenCursor::default() }
    }

    /// Rewrites the top-k node `t` of `layer` (`ne = [k, rows]`, a view of the router's
    /// ranking) with the recorded experts of its rows' tokens; a token without a row for the
    /// layer keeps the router's choice. The ranking after the first `k` is left as it was.
    pub fn force(&mut self, t: TensorView<'_>, layer: u32) -> Result<(), StreamError> {
        let graph = |what: String| StreamError::Graph(format!("{}: {what}", t.name()));
        let [k, rows, ..] = t.ne();
        let (k, rows) = (k.max(0) as usize, rows.max(0) as u64);
        let [nb0, nb1, ..] = t.nb();
        let first = self.cursor.first_row(layer, rows);
        for row in 0..rows {
            let Some(experts) = self.token(first + row)?.get(layer as usize).and_then(Option::as_ref) else {
                continue;
            };
            let experts = experts
                .get(..k)
                .ok_or_else(|| graph(format!("the recorded routes have {} experts for {k} places", experts.len())))?;
            for (j, &e) in experts.iter().enumerate() {
                let at = j * nb0 + row as usize * nb1;
                if !t.write_host_bytes(at, &(e as i32).to_ne_bytes()) {
                    return Err(graph("the router's choice could not be rewritten in host memory".into()));
                }
            }
        }
        Ok(())
    }

    /// The routes of the run's token `n`.
    fn token(&self, n: u64) -> Result<&super::TokenLayers, StreamError> {
        let len = self.routes.tokens.len() as u64;
        let n = match self.end {
            RoutesEnd::Wrap => n % len.max(1),
            RoutesEnd::Stop => n,
        };
        self.routes.tokens.get(n as usize).ok_or(StreamError::RoutesEnded { tokens: len })
    }

    /// An eval callback that forces the routes on every MoE layer of a resident run. A failure
    /// (logged) ends the decode: the caller bounds the run's tokens by the routes first
    /// ([`super::ForcedRoutes::n_predict`]).
    pub fn resident_callback<'m>(mut self) -> EvalCallback<'m> {
        Box::new(move |t, phase| match phase {
            EvalPhase::Ask => t.moe_topk_layer().is_some(),
            EvalPhase::Computed => {
                let Some(layer) = t.moe_topk_layer() else { return true };
                self.force(t, layer).map_err(|e| log::error!("--routes: {e}")).is_ok()
            }
        })
    }
}
