//! The streamer's recorded routes: forcing them on each router (`--routes`) before the layer is
//! planned, and recording every computed token's (`--record-routes`).

use ggml_sys::TensorView;

use super::Streamer;
use crate::stream::routes::TokenRoutes;
use crate::stream::StreamError;

impl Streamer {
    /// At `layer`'s top-k node `t`: rewrites the router's choice with the forced routes, then
    /// records what the layer routes, as asked.
    pub(super) fn force_and_record(&mut self, t: TensorView<'_>, layer: u32) -> Result<(), StreamError> {
        if let Some(forcer) = self.forcer.as_mut() {
            forcer.force(t, layer)?;
        }
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.observe(t, layer)?;
        }
        Ok(())
    }

    /// Every computed token's routes so far (`record_routes`), their model named `model`.
    pub fn recorded_routes(&self, model: String) -> Option<TokenRoutes> {
        self.recorder.as_ref().map(|r| TokenRoutes { model, ..r.routes().clone() })
    }

    /// Each layer's bytes per expert as the cache accounts them (0 for a layer without experts).
    pub fn layer_expert_bytes(&self) -> Vec<u64> {
        let cache = self.memory.cache();
        (0..cache.n_layer()).map(|l| cache.bytes(l, 0)).collect()
    }
}
