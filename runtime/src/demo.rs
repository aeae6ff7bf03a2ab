//! `sluice demo`: a synthetic model, generated once into a cache directory, run end to end.

use std::path::{Path, PathBuf};

use crate::synth::{self, OutputType, SynthArch, SynthSpec};

/// The demo model: small enough to generate in seconds, big enough to route across 16 experts.
pub fn demo_spec() -> SynthSpec {
    SynthSpec {
        arch: SynthArch::Qwen3moe,
        fused_gate_up: false,
        layers: 4,
        embd: 512,
        heads: 8,
        kv_heads: 4,
        experts: 16,
        experts_used: 4,
        expert_ff: 512,
        ctx_len: 4096,
        seed: 2026,
        out_type: OutputType::F16,
        alignment: 32,
        split_max_tensors: None,
        chat_template: None,
        routing: synth::Routing::Uniform,
        reuse: None,
        words: true,
        key_length: None,
        vocab_size: None,
        favour: None,
        sliding_window: None,
    }
}

/// The prompt the demo gives the trained KJV model (`sluice demo --model`).
pub const TRAINED_PROMPT: &str = "And it came to pass, when the king heard";

/// The prompt the demo runs.
pub const DEMO_PROMPT: &str = "The board reads each expert from storage when a token needs it.";

/// The demo model's path in `dir`; the name encodes the spec, so a changed spec regenerates.
pub fn demo_model_path(dir: &Path) -> PathBuf {
    let s = demo_spec();
    dir.join(format!(
        "demo-{}-l{}-e{}-x{}k{}-ff{}-s{}-words.gguf",
        demo_spec().arch.name(),
        s.layers,
        s.embd,
        s.experts,
        s.experts_used,
        s.expert_ff,
        s.seed
    ))
}

/// Returns the demo model, synthesizing it first when it is not in `dir` yet. The file appears
/// atomically (written under a temporary name, then renamed), so an interrupted run leaves no
/// half-written model behind. The flag says whether it was created now.
pub fn ensure_demo_model(dir: &Path, n_threads: u32) -> anyhow::Result<(PathBuf, bool)> {
    use anyhow::Context as _;
    let path = demo_model_path(dir);
    if path.is_file() {
        return Ok((path, false));
    }
    std::fs::create_dir_all(dir).with_context(|| {
        format!("cannot create the cache directory {} (set SLUICE_CACHE_DIR to a writable one)", dir.display())
    })?;
    let tmp = path.with_extension(format!("{}.partial.gguf", std::process::id()));
    let result = synth::synthesize(&demo_spec(), &tmp, n_threads);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).context("synthesizing the demo model");
    }
    std::fs::rename(&tmp, &path).with_context(|| format!("moving the demo model into place at {}", path.display()))?;
    Ok((path, true))
}
