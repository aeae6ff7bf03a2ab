//! A layer's routing, read at its top-k node: the distinct experts the router chose (stride
//! aware: the node is a view of the whole argsort), the lossy substitution that may rewrite the
//! ranking first, and the observers of every choice: the heat map and the route trace.

use ggml_sys::TensorView;

use super::StreamError;

/// One layer's distinct routed experts in one decode as the cache was asked for them
/// (recorded when tracing is on).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RouteRecord {
    /// Decode number (0 = the first decode after capture).
    pub decode: u64,
    /// Layer.
    pub layer: u32,
    /// Tokens in the decode's batch.
    pub tokens: u32,
    /// Whether the layer could pass experts through (the cache's staging allowance applied).
    pub staged: bool,
    /// Distinct expert ids, in the order first routed.
    pub experts: Vec<u32>,
}

/// The routing state of one streamed session.
pub struct Routing {
    n_expert: u32,
    /// The layer's distinct routed experts, filled on the eval callback's path: fixed capacity,
    /// so routing allocates nothing there.
    ids: heapless::Vec<u32, { crate::metadata::MAX_EXPERTS as usize }>,
    seen: Vec<bool>,
    /// Lossy: the router ranks after a token's chosen experts a cached substitute may come from.
    substitute: Option<u32>,
    /// One token's router ranking (the argsort row), for substitution.
    ranking: Vec<i32>,
    /// Times each (layer, expert) was routed, `layer * n_expert + expert`.
    heat: Vec<u64>,
    trace: Option<Vec<RouteRecord>>,
}

impl Routing {
    /// Routing over `n_layer` layers of `n_expert` experts; with `substitute`, a single token's
    /// missed experts may be replaced by cached ones ranked within that many places after the
    /// chosen ones; with `trace`, every layer's routes are recorded.
    pub fn new(n_layer: u32, n_expert: u32, substitute: Option<u32>, trace: bool) -> Routing {
        let n = n_expert as usize;
        Routing {
            n_expert,
            ids: heapless::Vec::new(),
            seen: vec![false; n],
            substitute,
            ranking: Vec::with_capacity(n),
            heat: vec![0; n * n_layer as usize],
            trace: trace.then(Vec::new),
        }
    }

    /// Reads `layer`'s routing at its top-k node `t` (`ne = [k, n_tokens]`, rows `nb[1]` apart):
    /// first substitutes cached experts for a single token's missed ones when that is on
    /// (`cached` says which are resident; the count substituted is returned), then records the
    /// distinct routed experts ([`Routing::ids`]) in the heat map.
    pub fn read(&mut self, t: TensorView<'_>, layer: u32, cached: impl Fn(u32) -> bool) -> Result<u64, StreamError> {
        let substituted = match self.substitute.filter(|_| t.ne()[1] == 1) {
            Some(window) => self.substitute_cached(t, window, cached)?,
            None => 0,
        };
        self.read_routed_ids(t, layer)?;
        let row = (layer * self.n_expert) as usize;
        for &e in &self.ids {
            self.heat[row + e as usize] += 1;
        }
        Ok(substituted)
    }

    /// The distinct experts of the layer last read, in the order first routed.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Records the layer last read in the trace, when tracing: decode `decode` of `tokens`
    /// tokens, `staged` as the cache planned it.
    pub fn record(&mut self, decode: u64, layer: u32, tokens: u32, staged: bool) {
        if let Some(trace) = self.trace.as_mut() {
            trace.push(RouteRecord { decode, layer, tokens, staged, experts: self.ids.to_vec() });
        }
    }

    /// Starts tracing (again), from an empty trace.
    pub fn start_trace(&mut self) {
        self.trace = Some(Vec::new());
    }

    /// The recorded routes.
    pub fn trace(&self) -> &[RouteRecord] {
        self.trace.as_deref().unwrap_or(&[])
    }

    /// How often each expert was routed (distinct per layer and decode), indexed
    /// `layer * n_expert + expert`; includes what [`Routing::add_heat`] added.
    pub fn heat(&self) -> &[u64] {
        &self.heat
    }

    /// Adds earlier counts (a saved heat map of the same model) to the heat map.
    pub fn add_heat(&mut self, counts: &[u64]) {
        for (h, c) in self.heat.iter_mut().zip(counts) {
            *h = h.saturating_add(*c);
        }
    }

    /// Lossy substitution for one token: each chosen expert the cache misses (the lowest-ranked
    /// first) is swapped, in the router's ranking, with the best-ranked cached expert among the
    /// `window` ranked right after the chosen ones. The ranking is the argsort the top-k node
    /// `topk` views, rewritten in place before the layer's products (and the routing weights)
    /// read it. Returns how many were substituted.
    fn substitute_cached(
        &mut self,
        topk: TensorView<'_>,
        window: u32,
        cached: impl Fn(u32) -> bool,
    ) -> Result<u64, StreamError> {
        let graph = |what: &str| StreamError::Graph(format!("{}: {what}", topk.name()));
        let sorted = topk.src(0).filter(|s| s.op_name() == "ARGSORT").ok_or_else(|| {
            graph("--substitute needs the router's full ranking, and this node is not a view of an argsort")
        })?;
        let k = topk.ne()[0] as usize;
        let n = (sorted.ne()[0] as usize).min(self.n_expert as usize);
        let reach = n.min(k + window as usize);
        if !sorted.has_host_bytes() {
            return Err(graph("the ranking is not in host memory"));
        }
        self.ranking.clear();
        for r in 0..reach {
            self.ranking.push(sorted.i32_at(r, 0).ok_or_else(|| graph("the ranking is shorter than its shape"))?);
        }
        let n_expert = self.n_expert;
        let is_cached = |id: i32| u32::try_from(id).is_ok_and(|e| e < n_expert && cached(e));
        let mut next = k;
        let mut substituted = 0;
        for chosen in (0..k.min(reach)).rev() {
            if is_cached(self.ranking[chosen]) {
                continue;
            }
            while next < reach && !is_cached(self.ranking[next]) {
                next += 1;
            }
            if next == reach {
                break;
            }
            self.ranking.swap(chosen, next);
            next += 1;
            substituted += 1;
        }
        if substituted > 0 {
            let nb0 = sorted.nb()[0];
            for (r, id) in self.ranking.iter().enumerate() {
                if !sorted.write_host_bytes(r * nb0, &id.to_ne_bytes()) {
                    return Err(graph("the ranking could not be rewritten"));
                }
            }
        }
        Ok(substituted)
    }

    /// Fills `ids` with the distinct expert ids of the top-k view `t`.
    fn read_routed_ids(&mut self, t: TensorView<'_>, layer: u32) -> Result<(), StreamError> {
        if !t.has_host_bytes() {
            return Err(StreamError::Graph(format!("{} is not in host memory", t.name())));
        }
        let [k, n_tokens, ..] = t.ne();
        let n_expert = self.n_expert;
        let bad = |id: i32| StreamError::BadExpertId { layer, id, n_expert };
        self.ids.clear();
        self.seen.fill(false);
        for tok in 0..n_tokens as usize {
            for j in 0..k as usize {
                let id = t
                    .i32_at(j, tok)
                    .ok_or_else(|| StreamError::Graph(format!("{} is shorter than its shape", t.name())))?;
                let e = u32::try_from(id).ok().filter(|&e| e < n_expert).ok_or_else(|| bad(id))?;
                if !self.seen[e as usize] {
                    self.seen[e as usize] = true;
                    // Distinct ids below n_expert, which the metadata check bounds by the capacity.
                    self.ids.push(e).map_err(|_| bad(id))?;
                }
            }
        }
        Ok(())
    }
}
