//! Counters of the server, rendered as Prometheus text for `GET /metrics` and as the JSON of
//! `GET /status` (which the status page at `/status.html` draws).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::budget::Ledger;
use crate::stream::TokenRow;
use sluice_hal::usage::Usage;

/// What one finished (or cancelled) generation did.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationCounts {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens whose memory a slot already held (not computed).
    pub reused_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Time spent in single-token decodes.
    pub decode: Duration,
    /// Single-token decodes.
    pub decoded: u64,
}

/// One slot as `/status` and `/metrics` show it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SlotView {
    /// Running a generation now.
    pub busy: bool,
    /// Tokens its memory holds that a later request may keep (whole prompt batches).
    pub tokens: usize,
    /// Prompt tokens its last request reused.
    pub reused: usize,
    /// Prompt tokens its last request computed.
    pub computed: usize,
}

/// The server's counters; every method takes `&self`.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    reused_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    slots: Mutex<Vec<SlotView>>,
    decode_ns: AtomicU64,
    decoded: AtomicU64,
    /// Decodes that carried tokens of several requests.
    shared_decodes: AtomicU64,
    last_tok_per_s_milli: AtomicU64,
    cancelled: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    warm_bytes: AtomicU64,
    ledger: Mutex<Vec<(String, u64)>>,
    budget: AtomicU64,
    connections_open: AtomicU64,
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    accept_errors: AtomicU64,
    substituted: AtomicU64,
    lossy: Mutex<crate::lossy::Lossy>,
    minutes: Mutex<VecDeque<Minute>>,
    heat: Mutex<Heat>,
}

/// Minutes of decode speed `/status` reports.
pub const STATUS_MINUTES: u64 = 15;

/// The decodes of one wall-clock minute.
#[derive(Debug, Clone, Copy)]
struct Minute {
    /// Minutes since the Unix epoch.
    at: u64,
    decoded: u64,
    decode_ns: u64,
}

/// How often each expert of each layer was routed, as the engine last reported.
#[derive(Debug, Clone, Default)]
struct Heat {
    layers: u32,
    experts: u32,
    counts: Vec<u64>,
}

fn unix_minute() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() / 60)
}

impl Metrics {
    /// Counts a request answered with `status` on `endpoint`.
    pub fn request(&self, endpoint: &str, status: u16) {
        let mut r = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *r.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// Adds a decode's expert traffic.
    pub fn decode_row(&self, row: &TokenRow) {
        self.hits.fetch_add(row.hits, Ordering::Relaxed);
        self.misses.fetch_add(row.misses, Ordering::Relaxed);
        self.bytes_read.fetch_add(row.bytes_read, Ordering::Relaxed);
        self.substituted.fetch_add(row.substituted, Ordering::Relaxed);
        if row.runs > 1 {
            self.shared_decodes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the lossy modes the engine runs with.
    pub fn set_lossy(&self, lossy: &crate::lossy::Lossy) {
        *self.lossy.lock().unwrap_or_else(|e| e.into_inner()) = *lossy;
    }

    /// Adds a generation's tokens and decode time.
    pub fn generation(&self, g: GenerationCounts) {
        self.prompt_tokens.fetch_add(g.prompt_tokens, Ordering::Relaxed);
        self.reused_tokens.fetch_add(g.reused_tokens, Ordering::Relaxed);
        self.completion_tokens.fetch_add(g.completion_tokens, Ordering::Relaxed);
        self.decode_ns.fetch_add(g.decode.as_nanos() as u64, Ordering::Relaxed);
        self.decoded.fetch_add(g.decoded, Ordering::Relaxed);
        if g.decoded > 0 && !g.decode.is_zero() {
            let rate = g.decoded as f64 / g.decode.as_secs_f64();
            self.last_tok_per_s_milli.store((rate * 1000.0) as u64, Ordering::Relaxed);
            let now = unix_minute();
            let mut minutes = self.minutes.lock().unwrap_or_else(|e| e.into_inner());
            match minutes.back_mut() {
                Some(m) if m.at == now => {
                    m.decoded += g.decoded;
                    m.decode_ns += g.decode.as_nanos() as u64;
                }
                _ => minutes.push_back(Minute { at: now, decoded: g.decoded, decode_ns: g.decode.as_nanos() as u64 }),
            }
            while minutes.front().is_some_and(|m| m.at + STATUS_MINUTES <= now) {
                minutes.pop_front();
            }
        }
    }

    /// Records the slots as they are now.
    pub fn set_slots(&self, slots: &[SlotView]) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        s.clear();
        s.extend_from_slice(slots);
    }

    /// The slots, as last recorded.
    pub fn slots(&self) -> Vec<SlotView> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records the expert heat map: route counts, `layer * experts + expert`.
    pub fn set_heat(&self, layers: u32, experts: u32, counts: &[u64]) {
        let mut h = self.heat.lock().unwrap_or_else(|e| e.into_inner());
        h.layers = layers;
        h.experts = experts;
        h.counts.clear();
        h.counts.extend_from_slice(counts);
    }

    /// Counts a generation stopped because its client went away or the server stopped.
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection was admitted.
    pub fn connection_opened(&self) {
        self.connections_open.fetch_add(1, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted connection closed.
    pub fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Ordering::Relaxed);
    }

    /// A connection was refused with 503: every open one was in a request.
    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// `accept` failed for want of file descriptors or memory.
    pub fn accept_error(&self) {
        self.accept_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Records the bytes a warm start read.
    pub fn warm_start(&self, bytes: u64) {
        self.warm_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Records the memory plan the engine runs under.
    pub fn set_ledger(&self, ledger: &Ledger) {
        let lines = ledger.lines.iter().map(|l| (l.item.label().to_string(), l.bytes)).collect();
        *self.ledger.lock().unwrap_or_else(|e| e.into_inner()) = lines;
        self.budget.store(ledger.budget, Ordering::Relaxed);
    }

    /// The JSON of `GET /status`: the server `state` (and why, when degraded), the model, decode
    /// speed per minute over the last [`STATUS_MINUTES`] (oldest first, 0 for a minute without
    /// decodes), the cache hit rate, memory against the ledger and budget, and the heat map.
    pub fn status(&self, state: &str, reason: Option<String>, model: &str, queued: usize) -> Value {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let now = unix_minute();
        let per_minute: Vec<f64> = {
            let minutes = self.minutes.lock().unwrap_or_else(|e| e.into_inner());
            (0..STATUS_MINUTES)
                .rev()
                .map(|ago| {
                    let at = now.saturating_sub(ago);
                    minutes
                        .iter()
                        .find(|m| m.at == at && m.decode_ns > 0)
                        .map_or(0.0, |m| m.decoded as f64 * 1e9 / m.decode_ns as f64)
                })
                .collect()
        };
        let (hits, misses) = (n(&self.hits), n(&self.misses));
        let ledger: Vec<Value> = {
            let l = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
            l.iter().map(|(item, bytes)| json!({ "item": item, "bytes": bytes })).collect()
        };
        let usage = Usage::sample();
        let heat = self.heat.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        json!({
            "state": state,
            "reason": reason,
            "model": model,
            "queued": queued,
            "tokens": {
                "prompt": n(&self.prompt_tokens),
                "prompt_reused": n(&self.reused_tokens),
                "completion": n(&self.completion_tokens),
            },
            "slots": slots,
            "shared_decodes": n(&self.shared_decodes),
            "decode_tokens_per_second": {
                "last": n(&self.last_tok_per_s_milli) as f64 / 1000.0,
                "per_minute": per_minute,
            },
            "expert_cache": {
                "hits": hits,
                "misses": misses,
                "hit_rate": if hits + misses == 0 { Value::Null } else { json!(hits as f64 / (hits + misses) as f64) },
                "bytes_read": n(&self.bytes_read),
            },
            "memory": {
                "rss_bytes": usage.rss(),
                "rss_peak_bytes": usage.rss_peak,
                "ledger": ledger,
                "budget_bytes": n(&self.budget),
            },
            "heat": { "layers": heat.layers, "experts": heat.experts, "counts": heat.counts },
        })
    }

    /// The Prometheus text exposition (format 0.0.4), with the server `state` and `queued`
    /// requests.
    pub fn render(&self, state: &str, queued: usize) -> String {
        let mut out = Exposition(String::new());
        self.render_front(&mut out, state, queued);
        self.render_decode(&mut out);
        self.render_memory(&mut out);
        out.0
    }

    /// The HTTP front's counters, the server's state and its queue.
    fn render_front(&self, out: &mut Exposition, state: &str, queued: usize) {
        let mut metric =
            |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| out.metric(name, kind, help, samples);
        let requests: Vec<(String, f64)> = {
            let r = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            r.iter().map(|((e, s), c)| (format!("{{endpoint=\"{e}\",status=\"{s}\"}}"), *c as f64)).collect()
        };
        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.", &requests);
        let state_samples: Vec<(String, f64)> = crate::serve::state::State::ALL
            .map(crate::serve::state::State::as_str)
            .iter()
            .map(|s| (format!("{{state=\"{s}\"}}"), if *s == state { 1.0 } else { 0.0 }))
            .collect();
        metric("state", "gauge", "The server's state (1 for the current one).", &state_samples);
        metric("connections_open", "gauge", "HTTP connections open.", &one(n(&self.connections_open)));
        metric("connections_total", "counter", "HTTP connections admitted.", &one(n(&self.connections_total)));
        metric(
            "connections_refused_total",
            "counter",
            "HTTP connections refused with 503 because every open one was in a request.",
            &one(n(&self.connections_refused)),
        );
        metric(
            "accept_errors_total",
            "counter",
            "Accepts that failed for want of file descriptors or memory (accepting paused).",
            &one(n(&self.accept_errors)),
        );
        metric("queued_requests", "gauge", "Generation requests waiting for the engine.", &one(queued as f64));
    }

    /// Tokens, decode speed, the expert cache and the lossy modes.
    fn render_decode(&self, out: &mut Exposition) {
        let mut metric =
            |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| out.metric(name, kind, help, samples);
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", &one(n(&self.prompt_tokens)));
        metric(
            "prompt_tokens_reused_total",
            "counter",
            "Prompt tokens whose memory a slot already held (not computed again).",
            &one(n(&self.reused_tokens)),
        );
        metric(
            "shared_decodes_total",
            "counter",
            "Decodes that carried tokens of several requests (one read of an expert for all of them).",
            &one(n(&self.shared_decodes)),
        );
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let per_slot = |f: fn(&SlotView) -> f64| -> Vec<(String, f64)> {
            slots.iter().enumerate().map(|(i, s)| (format!("{{slot=\"{i}\"}}"), f(s))).collect()
        };
        metric(
            "slot_busy",
            "gauge",
            "Whether the slot runs a generation now.",
            &per_slot(|s| f64::from(u8::from(s.busy))),
        );
        metric("slot_tokens", "gauge", "Tokens the slot's memory holds.", &per_slot(|s| s.tokens as f64));
        metric("completion_tokens_total", "counter", "Tokens generated.", &one(n(&self.completion_tokens)));
        metric(
            "generations_cancelled_total",
            "counter",
            "Generations stopped because the client disconnected or the server stopped.",
            &one(n(&self.cancelled)),
        );
        metric(
            "decode_seconds_total",
            "counter",
            "Time spent decoding generated tokens.",
            &one(n(&self.decode_ns) / 1e9),
        );
        metric("decode_tokens_total", "counter", "Single-token decodes.", &one(n(&self.decoded)));
        let avg =
            if self.decode_ns.load(Ordering::Relaxed) == 0 { 0.0 } else { n(&self.decoded) * 1e9 / n(&self.decode_ns) };
        metric("decode_tokens_per_second", "gauge", "Decode speed over all generations.", &one(avg));
        metric(
            "last_decode_tokens_per_second",
            "gauge",
            "Decode speed of the last generation.",
            &one(n(&self.last_tok_per_s_milli) / 1000.0),
        );
        let (hits, misses) = (n(&self.hits), n(&self.misses));
        metric("expert_cache_hits_total", "counter", "Routed experts found in the cache.", &one(hits));
        metric("expert_cache_misses_total", "counter", "Routed experts read from storage.", &one(misses));
        let ratio = if hits + misses == 0.0 { 0.0 } else { hits / (hits + misses) };
        metric("expert_cache_hit_ratio", "gauge", "Hits over routed experts, since start.", &one(ratio));
        metric("expert_bytes_read_total", "counter", "Expert bytes read from storage.", &one(n(&self.bytes_read)));
        let lossy = *self.lossy.lock().unwrap_or_else(|e| e.into_inner());
        let (experts_used, substitute) = (lossy.experts_used.unwrap_or(0), lossy.substitute.unwrap_or(0));
        metric(
            "lossy_experts_used",
            "gauge",
            "LOSSY --experts-used: experts per token, fewer than the model's (0: off, the model's own count).",
            &one(f64::from(experts_used)),
        );
        metric(
            "lossy_substitute_ranks",
            "gauge",
            "LOSSY --substitute: router ranks a cached substitute may come from (0: off).",
            &one(f64::from(substitute)),
        );
        metric(
            "expert_substitutions_total",
            "counter",
            "Chosen experts replaced by cached ones (LOSSY --substitute).",
            &one(n(&self.substituted)),
        );
    }

    /// The warm start, the memory plan and the process's memory.
    fn render_memory(&self, out: &mut Exposition) {
        let mut metric =
            |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| out.metric(name, kind, help, samples);
        let ledger: Vec<(String, f64)> = {
            let l = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
            l.iter().map(|(item, b)| (format!("{{item=\"{item}\"}}"), *b as f64)).collect()
        };
        metric(
            "warm_start_bytes",
            "gauge",
            "Expert bytes read at start from the saved heat map.",
            &one(n(&self.warm_bytes)),
        );
        metric("ledger_bytes", "gauge", "The memory plan, by item.", &ledger);
        metric("budget_bytes", "gauge", "The memory budget the plan fits.", &one(n(&self.budget)));
        let usage = Usage::sample();
        metric("resident_memory_bytes", "gauge", "Resident set size (anonymous + file).", &one(usage.rss() as f64));
        metric("resident_memory_peak_bytes", "gauge", "Peak resident set size (VmHWM).", &one(usage.rss_peak as f64));
    }
}

/// A Prometheus text exposition being written.
struct Exposition(String);

impl Exposition {
    /// One metric: its help, its type and its samples (labels, value).
    fn metric(&mut self, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
        let _ = writeln!(self.0, "# HELP sluice_{name} {help}\n# TYPE sluice_{name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(self.0, "sluice_{name}{labels} {v}");
        }
    }
}

/// A counter's value.
fn n(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

/// One unlabelled sample.
fn one(v: f64) -> Vec<(String, f64)> {
    vec![(String::new(), v)]
}

#[cfg(test)]
mod tests;
