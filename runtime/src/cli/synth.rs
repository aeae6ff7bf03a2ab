//! `sluice synth`: write a deterministic synthetic MoE model.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::synth::{self, OutputType, Routing, SynthArch, SynthSpec};
use sluice::units::mib;

/// `--routing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RoutingKind {
    /// A random router: every expert about equally often.
    Uniform,
    /// Popular experts, as real routers have (gpt-oss: written as the router's bias).
    Skewed,
}

/// `sluice synth` arguments.
#[derive(Args)]
pub struct SynthArgs {
    /// Output file (.gguf). With --split-max-tensors, the files are named
    /// <prefix>-0000K-of-0000N.gguf after it.
    #[arg(short, long)]
    out: PathBuf,
    /// Architecture: its tensor layout and metadata. deepseek2 adds a leading dense layer, a
    /// shared expert, expert-group routing and a NextN block; gpt-oss per-expert biases and
    /// attention sinks (use it with --type mxfp4_moe for gpt-oss's MXFP4 experts).
    #[arg(long, value_enum, default_value_t = SynthArch::Qwen3moe)]
    arch: SynthArch,
    /// Store each layer's routed gate and up projections in one tensor (`ffn_gate_up_exps`;
    /// deepseek2).
    #[arg(long)]
    fused_gate_up: bool,
    /// Transformer layers.
    #[arg(long, default_value_t = SynthSpec::default().layers)]
    layers: u32,
    /// Embedding width.
    #[arg(long, default_value_t = SynthSpec::default().embd)]
    embd: u32,
    /// Attention heads.
    #[arg(long, default_value_t = SynthSpec::default().heads)]
    heads: u32,
    /// Key/value heads.
    #[arg(long, default_value_t = SynthSpec::default().kv_heads)]
    kv_heads: u32,
    /// Routed experts per layer.
    #[arg(long, default_value_t = SynthSpec::default().experts)]
    experts: u32,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = SynthSpec::default().experts_used)]
    experts_used: u32,
    /// Hidden width of each expert (ignored with --size, which picks it).
    #[arg(long, default_value_t = SynthSpec::default().expert_ff)]
    expert_ff: u32,
    /// Training context length written to the file.
    #[arg(long, default_value_t = SynthSpec::default().ctx_len)]
    ctx: u32,
    /// Random seed: the same arguments and seed give byte-identical files.
    #[arg(long, default_value_t = SynthSpec::default().seed)]
    seed: u64,
    /// Weight type.
    #[arg(long = "type", value_enum, default_value_t = OutputType::F16)]
    out_type: OutputType,
    /// Tensor data alignment in bytes (a power of two; 4096 page-aligns every tensor).
    #[arg(long, default_value_t = SynthSpec::default().alignment)]
    alignment: u64,
    /// Target file size, e.g. 2GiB or 500MB: picks --expert-ff to come as close as possible
    /// without going over.
    #[arg(long)]
    size: Option<bytesize::ByteSize>,
    /// Split into files of at most N tensors each, after a first file holding only metadata.
    #[arg(long, value_name = "N")]
    split_max_tensors: Option<u32>,
    /// Store a chat template (`tokenizer.chat_template`): a name such as `chatml`, a template's
    /// text, or `@FILE` for the text in FILE.
    #[arg(long)]
    chat_template: Option<String>,
    /// How tokens spread over each layer's experts. skewed: log-normal expert popularity of
    /// spread --skew, calibrated into gpt-oss's router bias (needs --arch gpt-oss).
    #[arg(long, value_enum, default_value_t = RoutingKind::Uniform)]
    routing: RoutingKind,
    /// With --routing skewed: the popularity spread σ (expert shares ∝ exp(σ·z)); the default
    /// puts 90% of the routing in about half the experts, as measured for Qwen3-30B-A3B.
    #[arg(long, default_value_t = synth::routing::DEFAULT_SKEW)]
    skew: f64,
    /// With --routing skewed: token-to-token reuse, how many times more often consecutive tokens
    /// share their first-choice expert than independent tokens would (1: none). Default 2.2,
    /// Mixtral's middle layer (26-28% repeats against 12.5% by chance).
    #[arg(long)]
    reuse: Option<f64>,
    /// Put a thousand common English words in the vocabulary besides the byte tokens (random
    /// weights then generate words).
    #[arg(long)]
    words: bool,
    /// Width of each attention head (default: --embd / --heads); a real model's gives its KV
    /// cache's and attention weights' real size.
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    head_dim: Option<u32>,
    /// Pad the vocabulary with unused tokens to this many (a real model's: its embedding and
    /// output matrices' size, and the output product's work).
    #[arg(long)]
    vocab: Option<u32>,
    /// Make the weights favour a token at every position: a model that keeps writing it, for
    /// testing what a grammar bounds. One printable ASCII character (its byte token) or a token of
    /// the vocabulary, such as a chat marker of --chat-template (needs --type f16 or f32).
    #[arg(long, value_name = "TOKEN")]
    favour: Option<String>,
    /// gpt-oss's sliding window in tokens (default 16, so short prompts cross it; gpt-oss's own
    /// is 128).
    #[arg(long)]
    sliding_window: Option<u32>,
    /// Threads for quantizing (default: every CPU this process may run on).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,
}

/// The most bytes `--chat-template @FILE` reads.
const MAX_TEMPLATE_FILE: u64 = 64 << 20;

/// The text `--chat-template` stands for: the file's text for `@FILE`, else the argument.
fn chat_template_text(arg: &str) -> Result<String> {
    match arg.strip_prefix('@') {
        Some(file) => sluice_hal::file::read_regular_string(std::path::Path::new(file), MAX_TEMPLATE_FILE)
            .with_context(|| format!("--chat-template @{file}")),
        None => Ok(arg.to_string()),
    }
}

impl SynthArgs {
    pub fn spec(&self) -> Result<SynthSpec> {
        let mut spec = SynthSpec {
            arch: self.arch,
            fused_gate_up: self.fused_gate_up,
            layers: self.layers,
            embd: self.embd,
            heads: self.heads,
            kv_heads: self.kv_heads,
            experts: self.experts,
            experts_used: self.experts_used,
            expert_ff: self.expert_ff,
            ctx_len: self.ctx,
            seed: self.seed,
            out_type: self.out_type,
            alignment: self.alignment,
            split_max_tensors: self.split_max_tensors,
            chat_template: self.chat_template.as_deref().map(chat_template_text).transpose()?,
            routing: match self.routing {
                RoutingKind::Uniform => Routing::Uniform,
                RoutingKind::Skewed => Routing::Skewed(self.skew),
            },
            // Skewed routing has reuse by default; asked for without it, validation says why not.
            reuse: match self.routing {
                RoutingKind::Skewed => Some(self.reuse.unwrap_or(synth::reuse::DEFAULT_REUSE)),
                RoutingKind::Uniform => self.reuse,
            },
            words: self.words,
            key_length: self.head_dim,
            vocab_size: self.vocab,
            favour: self.favour.clone(),
            sliding_window: self.sliding_window,
        };
        if let Some(size) = self.size {
            spec.expert_ff = synth::fit_expert_ff(&spec, size.as_u64())?;
        }
        Ok(spec)
    }
}

/// Runs `sluice synth`.
pub fn run_synth(a: &SynthArgs) -> Result<()> {
    let spec = a.spec()?;
    let out = synth::synthesize(&spec, &a.out, a.threads.unwrap_or_else(sluice_hal::cpu::default_threads))
        .with_context(|| format!("writing {}", a.out.display()))?;
    for f in &out.files {
        outln!("{}", f.display());
    }
    noteln!(
        "wrote {} file(s), {:.1} MiB ({:.1} MiB of routed experts): {}, {} layers, {} experts (top-{}), expert FFN {}, {:?}",
        out.files.len(),
        mib(out.total_bytes),
        mib(out.expert_bytes),
        spec.arch.name(),
        spec.layers,
        spec.experts,
        spec.experts_used,
        spec.expert_ff,
        spec.out_type
    );
    if let Some(c) = out.calibration {
        noteln!(
            "skewed routing calibrated in {} round(s) on the model itself: each expert's routed share within {:.3} of its target",
            c.rounds, c.max_error
        );
        if let Some((sink, reuse)) = c.reuse {
            noteln!(
                "token-to-token reuse: consecutive tokens share their first-choice expert {reuse:.2}x as often as independent tokens (attention sink {sink:.2})"
            );
            let wanted = spec.reuse.unwrap_or(1.0);
            if (reuse / wanted).ln().abs() > 0.1 {
                noteln!(
                    "note: --reuse {wanted} was not reached (this shape's attention gives {reuse:.2}); more experts or layers widen the range"
                );
            }
        }
    }
    Ok(())
}
