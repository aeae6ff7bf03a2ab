//! `sluice quantize`: a model in another weight type, through llama.cpp's quantizer.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::synth::OutputType;

/// `sluice quantize` arguments.
#[derive(Args)]
pub struct QuantizeArgs {
    /// The model to convert (f32, f16 or bf16 weights for the best result).
    #[arg(short, long)]
    model: PathBuf,
    /// Where to write the converted model (.gguf); replaced only once the conversion succeeded.
    #[arg(short, long)]
    out: PathBuf,
    /// The weight type: q8_0, q4_k_m, q6_k, mxfp4_moe or bf16 (llama.cpp's mixes of those names).
    #[arg(long = "type", value_enum)]
    out_type: OutputType,
    /// Threads (default: every core).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: u32,
}

/// Runs `sluice quantize`: converts into a temporary file beside `--out`, then renames it.
pub fn run_quantize(a: &QuantizeArgs) -> Result<()> {
    let Some(ty) = a.out_type.quant() else {
        anyhow::bail!(
            "--type {}: llama.cpp's quantizer writes q8_0, q4_k_m, q6_k, mxfp4_moe and bf16, not f32 or f16",
            format!("{:?}", a.out_type).to_lowercase()
        );
    };
    sluice::metadata::check_model_file(&a.model)?;
    if a.out == a.model {
        anyhow::bail!("--out {} is the --model: write the converted model to another file", a.out.display());
    }
    let mut partial = a.out.clone().into_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let result = ggml_sys::quantize(&a.model, &partial, ty, a.threads);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&partial);
        return Err(e).with_context(|| format!("quantizing {} to {:?}", a.model.display(), a.out_type));
    }
    std::fs::rename(&partial, &a.out)
        .with_context(|| format!("moving {} to --out {}", partial.display(), a.out.display()))?;
    outln!("{}", a.out.display());
    Ok(())
}
