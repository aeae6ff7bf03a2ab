//! `sluice quantize`: a model in another weight type, through llama.cpp's quantizer.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

/// The weight types `sluice quantize` writes (llama.cpp's mixes of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum QuantKind {
    /// 8-bit blocks of 32.
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit k-quants, with 6-bit ones for the sensitive tensors.
    #[value(name = "q4_k_m")]
    Q4KM,
    /// 6-bit k-quants.
    #[value(name = "q6_k")]
    Q6K,
    /// bfloat16.
    #[value(name = "bf16")]
    Bf16,
}

impl QuantKind {
    fn quant_type(self) -> ggml_sys::QuantType {
        match self {
            QuantKind::Q8_0 => ggml_sys::QuantType::Q8_0,
            QuantKind::Q4KM => ggml_sys::QuantType::Q4KM,
            QuantKind::Q6K => ggml_sys::QuantType::Q6K,
            QuantKind::Bf16 => ggml_sys::QuantType::Bf16,
        }
    }
}

/// `sluice quantize` arguments.
#[derive(Args)]
pub struct QuantizeArgs {
    /// The model to convert (f32, f16 or bf16 weights for the best result).
    #[arg(short, long)]
    model: PathBuf,
    /// Where to write the converted model (.gguf); replaced only once the conversion succeeded.
    #[arg(short, long)]
    out: PathBuf,
    /// The weight type.
    #[arg(long = "type", value_enum)]
    out_type: QuantKind,
    /// Threads (default: every core).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: u32,
}

/// Runs `sluice quantize`: converts into a temporary file beside `--out`, then renames it.
pub fn run_quantize(a: &QuantizeArgs) -> Result<()> {
    sluice::metadata::check_model_file(&a.model)?;
    if a.out == a.model {
        anyhow::bail!("--out {} is the --model: write the converted model to another file", a.out.display());
    }
    let mut partial = a.out.clone().into_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let result = ggml_sys::quantize(&a.model, &partial, a.out_type.quant_type(), a.threads);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&partial);
        return Err(e).with_context(|| format!("quantizing {} to {:?}", a.model.display(), a.out_type));
    }
    std::fs::rename(&partial, &a.out)
        .with_context(|| format!("moving {} to --out {}", partial.display(), a.out.display()))?;
    outln!("{}", a.out.display());
    Ok(())
}
