//! The workspace ledger: every byte the runtime will hold, by line, against the budget.

use std::fmt::Write as _;

use serde::Serialize;

use crate::units::mib;

/// What a ledger line accounts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Item {
    /// The always-needed weights (attention, norms, router, embeddings, shared experts).
    DenseWeights,
    /// The KV cache.
    KvCache,
    /// ggml's compute buffers for the graph.
    ComputeBuffers,
    /// The current layer's routed experts beyond what the expert cache holds (they are read in
    /// place, so this is their memory while the layer computes).
    IoStaging,
    /// The expert cache.
    ExpertCache,
    /// The lookahead's copies of the routers (`--lookahead`).
    LookaheadRouters,
    /// The process itself, llama.cpp's and the engine's own structures.
    RuntimeOverhead,
    /// What `serve` keeps of its answers (the responses for `previous_response_id`).
    KeptResponses,
}

impl Item {
    /// The line's label.
    pub fn label(self) -> &'static str {
        match self {
            Item::DenseWeights => "dense weights",
            Item::KvCache => "KV cache",
            Item::ComputeBuffers => "compute buffers",
            Item::IoStaging => "I/O staging",
            Item::ExpertCache => "expert cache",
            Item::LookaheadRouters => "lookahead routers",
            Item::RuntimeOverhead => "runtime overhead",
            Item::KeptResponses => "kept responses",
        }
    }
}

/// One line of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerLine {
    /// What it is.
    pub item: Item,
    /// Bytes.
    pub bytes: u64,
    /// How the number was found.
    pub basis: String,
    /// Whether it counts toward the total: `false` for memory the kernel may reclaim at will
    /// (dense weights left in the file mapping with `--dense mmap`).
    pub held: bool,
}

/// The ledger of one planned run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Ledger {
    /// The model's first file.
    pub model: String,
    /// Context positions the run sizes the KV cache for.
    pub n_ctx: u32,
    /// Largest batch a decode takes (prompt chunks).
    pub n_batch: u32,
    /// Why the prompt batch is `n_batch` when the plan chose it (`--batch auto`); empty when
    /// it was given.
    pub batch_basis: String,
    /// Where the dense weights live (`anon` or `mmap`).
    pub dense: String,
    /// The lines, in ledger order.
    pub lines: Vec<LedgerLine>,
    /// The budget, bytes.
    pub budget: u64,
    /// Where the budget came from.
    pub budget_source: String,
    /// Whether the expert cache was sized automatically (what the budget leaves).
    pub cache_auto: bool,
    /// One token's routed demand (layers × k × largest expert): the smallest useful cache.
    pub one_token_min: u64,
    /// All experts' window bytes (the most a cache can use).
    pub all_experts: u64,
    /// Bytes held: the sum of the held lines.
    pub total: u64,
    /// What streams and what does not.
    pub experts: ExpertLayout,
}

/// The model's expert layout as the plan lists it: which tensors stream, and every tensor of an
/// expert layout that does not (nothing stays resident unlisted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExpertLayout {
    /// `general.architecture`.
    pub arch: String,
    /// Whether a gate verifies streaming it.
    pub verified: bool,
    /// Experts per layer.
    pub n_expert: u32,
    /// Experts each token routes to (the most over the layers).
    pub n_expert_used: u32,
    /// Layers llama.cpp runs.
    pub layers: u32,
    /// Of which have routed experts.
    pub moe_layers: usize,
    /// The kinds of streamed tensors (`ffn_down_exps`, `ffn_gate_up_exps`, ...).
    pub streamed_kinds: Vec<String>,
    /// Streamed tensors.
    pub streamed_tensors: usize,
    /// Expert-layout tensors that stay resident (per-expert biases and scales), by name.
    pub resident_expert_tensors: Vec<String>,
    /// Their bytes (part of the dense weights).
    pub resident_expert_bytes: u64,
    /// NextN/MTP blocks after the last layer, which llama.cpp does not run.
    pub not_run_layers: u32,
    /// Their tensors' bytes: never loaded or read.
    pub not_run_bytes: u64,
}

impl ExpertLayout {
    /// The layout's lines of [`Ledger::describe`].
    fn describe(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "  experts: {} ({}), {} per layer, top-{}, in {} of {} layers; streamed: {} ({} tensors)",
            self.arch,
            if self.verified { "verified by a gate" } else { "not verified: streamed by the generic rule" },
            self.n_expert,
            self.n_expert_used,
            self.moe_layers,
            self.layers,
            self.streamed_kinds.join(", "),
            self.streamed_tensors
        );
        if !self.resident_expert_tensors.is_empty() {
            let shown: Vec<&str> = self.resident_expert_tensors.iter().take(3).map(String::as_str).collect();
            let more = self.resident_expert_tensors.len() - shown.len();
            let _ = writeln!(
                o,
                "  resident expert tensors (per-expert biases and scales, in the dense weights): {}, {:.2} MiB: {}{}",
                self.resident_expert_tensors.len(),
                mib(self.resident_expert_bytes),
                shown.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            );
        }
        if self.not_run_layers > 0 {
            let _ = writeln!(
                o,
                "  NextN/MTP blocks: {} after the last layer, {:.1} MiB, not run by llama.cpp: never loaded or read",
                self.not_run_layers,
                mib(self.not_run_bytes)
            );
        }
    }
}

impl Ledger {
    /// The bytes of `item`'s line.
    pub fn bytes(&self, item: Item) -> u64 {
        self.lines.iter().filter(|l| l.item == item).map(|l| l.bytes).sum()
    }

    /// Whether the held total is within the budget.
    pub fn fits(&self) -> bool {
        self.total <= self.budget
    }

    /// The expert cache the run will use, bytes.
    pub fn cache_bytes(&self) -> u64 {
        self.bytes(Item::ExpertCache)
    }

    /// The ledger as an aligned table.
    pub fn describe(&self) -> String {
        let mut o = format!(
            "ledger for {} (context {} positions, batch {}, dense {}):\n",
            self.model, self.n_ctx, self.n_batch, self.dense
        );
        for l in &self.lines {
            let _ = writeln!(
                o,
                "  {:<17} {:>10.1} MiB{}  {}",
                l.item.label(),
                mib(l.bytes),
                if l.held { "  " } else { " *" },
                l.basis
            );
        }
        let _ = writeln!(o, "  {:<17} {:>10.1} MiB", "total held", mib(self.total));
        let _ = writeln!(o, "  {:<17} {:>10.1} MiB    {}", "budget", mib(self.budget), self.budget_source);
        if !self.batch_basis.is_empty() {
            let _ = writeln!(o, "  prompt batch {}: {}", self.n_batch, self.batch_basis);
        }
        if self.lines.iter().any(|l| !l.held) {
            let _ = writeln!(o, "  (* in the page cache, reclaimable: not counted in the total)");
        }
        let _ = writeln!(
            o,
            "  one token's routed demand: {:.1} MiB (the smallest useful expert cache); all experts: {:.1} MiB",
            mib(self.one_token_min),
            mib(self.all_experts)
        );
        self.experts.describe(&mut o);
        o
    }
}
