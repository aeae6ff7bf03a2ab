//! `sluice synth`: deterministic synthetic Mixture-of-Experts models in GGUF.
//!
//! The models use one of llama.cpp's MoE architectures ([`SynthArch`]: `qwen3moe` by default,
//! `deepseek2`, `gpt-oss`) with random weights and a byte-fallback vocabulary, so a user can
//! exercise a board's storage and memory budget (and the test suite can exercise every code path
//! and expert layout) without downloading a real model. The same [`SynthSpec`] always gives
//! byte-identical files.

mod arch;
pub mod calibrate;
pub mod gguf_writer;
pub mod reuse;
pub mod routing;
mod size;
mod vocab;
mod weights;

use std::path::{Path, PathBuf};

use crate::metadata::layout::is_expert_weight;
pub use arch::SynthArch;
use gguf_writer::{GgufWriter, TensorSpec, TensorType, Value, WriteError};
pub use routing::Routing;
pub use size::{fit_expert_ff, SizeError};
use weights::Init;

/// The element type of the weights in the output file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputType {
    /// 32-bit floats everywhere.
    F32,
    /// 16-bit floats for matrices, f32 for norms.
    F16,
    /// 8-bit blocks of 32 (`llama_model_quantize`).
    #[value(name = "q8_0")]
    Q8_0,
    /// The 4-bit k-quant mix (`llama_model_quantize`).
    #[value(name = "q4_k_m")]
    Q4KM,
    /// 6-bit k-quants (`llama_model_quantize`).
    #[value(name = "q6_k")]
    Q6K,
    /// MXFP4 routed experts, Q8_0 for the other matrices, as gpt-oss ships
    /// (`llama_model_quantize`).
    #[value(name = "mxfp4_moe")]
    Mxfp4Moe,
    /// bfloat16 matrices, f32 for norms (`llama_model_quantize` from f16).
    #[value(name = "bf16")]
    Bf16,
}

impl OutputType {
    /// The quantization that produces this type, if it is a quantized one.
    fn quant(self) -> Option<ggml_sys::QuantType> {
        match self {
            OutputType::F32 | OutputType::F16 => None,
            OutputType::Q8_0 => Some(ggml_sys::QuantType::Q8_0),
            OutputType::Q4KM => Some(ggml_sys::QuantType::Q4KM),
            OutputType::Q6K => Some(ggml_sys::QuantType::Q6K),
            OutputType::Mxfp4Moe => Some(ggml_sys::QuantType::Mxfp4Moe),
            OutputType::Bf16 => Some(ggml_sys::QuantType::Bf16),
        }
    }

    /// Rows must be a multiple of this many elements for the type's blocks.
    pub fn block_width(self) -> u32 {
        match self {
            OutputType::F32 | OutputType::F16 | OutputType::Bf16 => 1,
            OutputType::Q8_0 | OutputType::Mxfp4Moe => 32,
            OutputType::Q4KM | OutputType::Q6K => 256,
        }
    }

    /// Approximate bytes per weight of a matrix (for `--size`).
    pub fn bytes_per_weight(self) -> f64 {
        match self {
            OutputType::F32 => 4.0,
            OutputType::F16 | OutputType::Bf16 => 2.0,
            OutputType::Q8_0 => 34.0 / 32.0,
            // Q4_K (144 B / 256) for most matrices, Q6_K (210 B / 256) for some down projections.
            OutputType::Q4KM => 0.62,
            OutputType::Q6K => 210.0 / 256.0,
            // MXFP4 (17 B / 32) for the experts, which are most of a MoE model.
            OutputType::Mxfp4Moe => 17.0 / 32.0,
        }
    }

    /// The type matrices are written in before any quantization.
    fn matrix_type(self) -> TensorType {
        if self == OutputType::F32 {
            TensorType::F32
        } else {
            TensorType::F16
        }
    }

    /// llama.cpp's `general.file_type` for the directly written types.
    fn file_type(self) -> u32 {
        if self == OutputType::F32 {
            0
        } else {
            1
        }
    }
}

/// Everything that determines a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// The architecture (tensor layout and metadata).
    pub arch: SynthArch,
    /// Routed experts' gate and up projections in one tensor (`ffn_gate_up_exps`; deepseek2).
    pub fused_gate_up: bool,
    /// Transformer layers (deepseek2 adds a NextN block after them).
    pub layers: u32,
    /// Embedding width.
    pub embd: u32,
    /// Attention heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u32,
    /// Routed experts per layer.
    pub experts: u32,
    /// Experts each token is routed to.
    pub experts_used: u32,
    /// Hidden width of each expert's feed-forward network.
    pub expert_ff: u32,
    /// Training context length recorded in the file.
    pub ctx_len: u32,
    /// Random seed.
    pub seed: u64,
    /// Output weight type.
    pub out_type: OutputType,
    /// Tensor data alignment in bytes (`general.alignment`).
    pub alignment: u64,
    /// Split into files of at most this many tensors (the first file holds only metadata).
    pub split_max_tensors: Option<u32>,
    /// A chat template stored as `tokenizer.chat_template` (llama.cpp recognises templates by
    /// their text, or by a name such as `chatml`).
    pub chat_template: Option<String>,
    /// How the router spreads tokens over experts.
    pub routing: Routing,
    /// Token-to-token reuse (skewed gpt-oss routing only): how many times more often consecutive
    /// tokens share their first-choice expert than independent tokens ([`reuse`]); `None`
    /// leaves the attention random.
    pub reuse: Option<f64>,
    /// A thousand common English words in the vocabulary besides the byte tokens (the demo
    /// model: random weights then print words).
    pub words: bool,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            arch: SynthArch::Qwen3moe,
            fused_gate_up: false,
            layers: 2,
            embd: 256,
            heads: 4,
            kv_heads: 2,
            experts: 8,
            experts_used: 2,
            expert_ff: 256,
            ctx_len: 4096,
            seed: 42,
            out_type: OutputType::F16,
            alignment: 32,
            split_max_tensors: None,
            chat_template: None,
            routing: Routing::Uniform,
            reuse: None,
            words: false,
        }
    }
}

/// Errors of the generator.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A parameter is out of range or inconsistent with another.
    #[error("invalid synth parameter --{field}: {reason}")]
    Invalid {
        /// The option.
        field: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// Writing failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// Quantization failed.
    #[error(transparent)]
    Quantize(#[from] ggml_sys::Error),
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> SynthError {
    SynthError::Invalid { field, reason: reason.into() }
}

/// What [`synthesize`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthOutput {
    /// The files, first one first (the one to pass to `--model`).
    pub files: Vec<PathBuf>,
    /// Total bytes written.
    pub total_bytes: u64,
    /// Bytes of routed-expert tensor data.
    pub expert_bytes: u64,
    /// How closely skewed routing was calibrated (`None` for uniform routing).
    pub calibration: Option<calibrate::Calibration>,
}

impl SynthSpec {
    /// Dimension of each attention head.
    pub fn head_dim(&self) -> u32 {
        self.embd / self.heads.max(1)
    }

    /// Checks the parameters against each other and against the output type's block width.
    pub fn validate(&self) -> Result<(), SynthError> {
        let nonzero = [
            ("layers", self.layers),
            ("embd", self.embd),
            ("heads", self.heads),
            ("kv-heads", self.kv_heads),
            ("experts", self.experts),
            ("experts-used", self.experts_used),
            ("expert-ff", self.expert_ff),
            ("ctx", self.ctx_len),
        ];
        for (field, v) in nonzero {
            if v == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if self.embd % self.heads != 0 || self.head_dim() % 2 != 0 {
            return Err(invalid(
                "heads",
                format!("--embd {} must split into {} heads of an even width", self.embd, self.heads),
            ));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(invalid("kv-heads", format!("{} does not divide --heads {}", self.kv_heads, self.heads)));
        }
        if self.experts_used > self.experts {
            return Err(invalid(
                "experts-used",
                format!("{} is more than --experts {}", self.experts_used, self.experts),
            ));
        }
        let w = self.out_type.block_width();
        for (field, v) in [("embd", self.embd), ("expert-ff", self.expert_ff)] {
            if v % w != 0 {
                return Err(invalid(
                    field,
                    format!("{v} is not a multiple of {w}, the block width of {:?}", self.out_type),
                ));
            }
        }
        if self.alignment < 8 || !self.alignment.is_power_of_two() {
            return Err(invalid("alignment", format!("{} is not a power of two of at least 8", self.alignment)));
        }
        arch::validate(self).map_err(|(field, reason)| invalid(field, reason))?;
        if let Routing::Skewed(sigma) = self.routing {
            if self.arch != SynthArch::GptOss {
                return Err(invalid(
                    "routing",
                    format!(
                        "skewed routing is written as a router bias, which {} has not; use --arch gpt-oss",
                        self.arch.name()
                    ),
                ));
            }
            if !(sigma.is_finite() && sigma >= 0.0) {
                return Err(invalid("skew", format!("{sigma} is not a spread of at least 0")));
            }
            routing::routed_chances(self.experts, self.experts_used, sigma)
                .map_err(|e| invalid("skew", e.to_string()))?;
        }
        if let Some(r) = self.reuse {
            if !matches!(self.routing, Routing::Skewed(_)) {
                return Err(invalid(
                    "reuse",
                    "token-to-token reuse is calibrated with skewed routing: add --routing skewed",
                ));
            }
            if !(r.is_finite() && (1.0..=reuse::MAX_REUSE).contains(&r)) {
                return Err(invalid(
                    "reuse",
                    format!(
                        "{r} is not between 1 (no reuse) and {} times the repeats of independent tokens",
                        reuse::MAX_REUSE
                    ),
                ));
            }
        }
        if self.split_max_tensors == Some(0) {
            return Err(invalid("split-max-tensors", "must be at least 1"));
        }
        if self.split_max_tensors.is_some() && self.out_type.quant().is_some() {
            return Err(invalid(
                "split-max-tensors",
                "split output is written directly and supports --type f32 or f16 only; quantize first, or drop the split",
            ));
        }
        Ok(())
    }

    /// The tensor table, in file order, with how each tensor's values are drawn (a skewed
    /// router's bias values are set by [`synthesize`], which computes them once).
    fn tensors(&self) -> Vec<(TensorSpec, Init)> {
        arch::tensors(self, None)
    }

    /// The `general.*`, architecture and vocabulary metadata.
    fn metadata(&self) -> Vec<(String, Value)> {
        let mut meta = vec![
            ("general.architecture".to_string(), Value::Str(self.arch.name().into())),
            ("general.name".to_string(), Value::Str("sluice synthetic MoE (random weights)".into())),
            ("general.file_type".to_string(), Value::U32(self.out_type.file_type())),
            ("sluice.synth.seed".to_string(), Value::Str(self.seed.to_string())),
        ];
        meta.extend(arch::metadata(self));
        if self.alignment != 32 {
            meta.push(("general.alignment".to_string(), Value::U32(self.alignment as u32)));
        }
        meta.extend(vocab::metadata(self.words));
        if let Some(t) = &self.chat_template {
            meta.push(("tokenizer.chat_template".to_string(), Value::Str(t.clone())));
        }
        if let Routing::Skewed(sigma) = self.routing {
            meta.push((
                "sluice.synth.routing".to_string(),
                Value::Str(format!("skewed, log-normal popularity σ {sigma}")),
            ));
        }
        if let Some(r) = self.reuse {
            meta.push((
                "sluice.synth.reuse".to_string(),
                Value::Str(format!(
                    "consecutive tokens share their first-choice expert {r}x as often as independent tokens"
                )),
            ));
        }
        meta
    }

    /// Bytes of all routed-expert tensors in the output type (exact for f32/f16, estimated for
    /// quantized types).
    pub fn expert_bytes(&self) -> u64 {
        self.estimated_bytes(|t| is_expert_weight(&t.name)) as u64
    }

    /// Estimated bytes of the tensors `keep` selects: f32 vectors (norms, biases) as written, the
    /// matrices at the output type's bytes per weight.
    fn estimated_bytes(&self, keep: impl Fn(&TensorSpec) -> bool) -> f64 {
        let bpw = self.out_type.bytes_per_weight();
        let per_element = |t: &TensorSpec| if t.ty == TensorType::F32 { 4.0 } else { bpw };
        self.tensors().iter().filter(|(t, _)| keep(t)).map(|(t, _)| t.n_elements() as f64 * per_element(t)).sum()
    }
}

/// Writes the model described by `spec` to `out` (for a split model, `out` is the first file and
/// must be named `<prefix>-00001-of-0000N.gguf`; see [`split_paths`]). Quantized types are written
/// as f16 next to `out` first, then quantized with `n_threads` threads.
pub fn synthesize(spec: &SynthSpec, out: &Path, n_threads: u32) -> Result<SynthOutput, SynthError> {
    spec.validate()?;
    // Skewed routing: each expert's wanted chance of being routed, and the bias profile that
    // gives it, computed once for the table and the calibration.
    let skew = match spec.routing {
        Routing::Uniform => None,
        Routing::Skewed(sigma) => {
            let chances = routing::routed_chances(spec.experts, spec.experts_used, sigma)
                .map_err(|e| invalid("skew", e.to_string()))?;
            let profile = routing::calibrated_bias(&chances, spec.experts_used, spec.seed);
            Some((chances, profile))
        }
    };
    let tensors = arch::tensors(spec, skew.as_ref().map(|(_, profile)| profile.as_slice()));
    let metadata = spec.metadata();
    let expert_bytes_of = |files: &[PathBuf]| -> Result<u64, SynthError> {
        let mut sum = 0;
        for f in files {
            let g = ggml_sys::GgufFile::open(f)?;
            sum += g.tensors().iter().filter(|t| is_expert_weight(&t.name)).map(|t| t.size).sum::<u64>();
        }
        Ok(sum)
    };
    let files = if let Some(max) = spec.split_max_tensors {
        write_split(out, &metadata, &tensors, spec, max)?
    } else {
        match spec.out_type.quant() {
            None => write_one(out, &metadata, &tensors, spec, None)?,
            Some(q) => {
                let tmp = out.with_extension("f16.tmp.gguf");
                let result = write_one(&tmp, &metadata, &tensors, spec, None)
                    .and_then(|()| Ok(ggml_sys::quantize(&tmp, out, q, n_threads)?));
                let _ = std::fs::remove_file(&tmp);
                result?;
            }
        }
        vec![out.to_path_buf()]
    };
    // Skewed routing: the router biases calibrated on the written model, and with reuse the
    // attention sinks around them.
    let calibration = match &skew {
        None => None,
        Some((chances, profile)) => {
            let biases = (0..spec.layers).map(|il| routing::by_expert(profile, spec.seed, il)).collect();
            let want: Vec<Vec<f64>> = (0..spec.layers).map(|il| routing::by_expert(chances, spec.seed, il)).collect();
            let popularity = |b| calibrate::calibrate(&files, b, &want, spec.experts_used, n_threads);
            Some(match spec.reuse {
                Some(_) => reuse::calibrate(&files, spec, biases, popularity)?,
                None => popularity(biases)?.0,
            })
        }
    };
    let total_bytes = files.iter().map(|f| file_len(f)).sum::<Result<u64, _>>()?;
    let expert_bytes = expert_bytes_of(&files)?;
    Ok(SynthOutput { files, total_bytes, expert_bytes, calibration })
}

fn file_len(path: &Path) -> Result<u64, SynthError> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|source| SynthError::Io { path: path.into(), source })
}

/// Writes `tensors` (all of them, or the `range` of them) into one file with `metadata`.
fn write_one(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[(TensorSpec, Init)],
    spec: &SynthSpec,
    range: Option<std::ops::Range<usize>>,
) -> Result<(), SynthError> {
    let range = range.unwrap_or(0..tensors.len());
    let specs: Vec<TensorSpec> = tensors[range.clone()].iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::create(path, metadata, &specs, spec.alignment)?;
    for (index, (ts, init)) in tensors.iter().enumerate().skip(range.start).take(range.len()) {
        w.write_tensor(ts, |o| weights::write_values(o, spec.seed, index as u64, ts.n_elements(), ts.ty, init))?;
    }
    w.finish()?;
    Ok(())
}

/// The file names of a split model whose first file is `first` (`<prefix>-00001-of-0000N.gguf`),
/// as llama.cpp's `llama_split_path` names them.
pub fn split_paths(prefix: &Path, count: usize) -> Vec<PathBuf> {
    (1..=count).map(|i| PathBuf::from(format!("{}-{i:05}-of-{count:05}.gguf", prefix.display()))).collect()
}

fn write_split(
    out: &Path,
    metadata: &[(String, Value)],
    tensors: &[(TensorSpec, Init)],
    spec: &SynthSpec,
    max: u32,
) -> Result<Vec<PathBuf>, SynthError> {
    let prefix = split_prefix(out)?;
    let chunks: Vec<std::ops::Range<usize>> =
        (0..tensors.len()).step_by(max as usize).map(|s| s..(s + max as usize).min(tensors.len())).collect();
    let count = chunks.len() + 1;
    let paths = split_paths(&prefix, count);
    let split_keys = |no: usize| {
        vec![
            ("split.no".to_string(), Value::U16(no as u16)),
            ("split.count".to_string(), Value::U16(count as u16)),
            ("split.tensors.count".to_string(), Value::I32(tensors.len() as i32)),
        ]
    };
    let mut first_meta = metadata.to_vec();
    first_meta.extend(split_keys(0));
    write_one(&paths[0], &first_meta, tensors, spec, Some(0..0))?;
    for (i, range) in chunks.into_iter().enumerate() {
        let mut meta = split_keys(i + 1);
        if spec.alignment != 32 {
            meta.push(("general.alignment".to_string(), Value::U32(spec.alignment as u32)));
        }
        write_one(&paths[i + 1], &meta, tensors, spec, Some(range))?;
    }
    Ok(paths)
}

/// The prefix of a split output: `out` without `-00001-of-NNNNN.gguf` or `.gguf`.
fn split_prefix(out: &Path) -> Result<PathBuf, SynthError> {
    let s = out.to_string_lossy();
    let stem = s.strip_suffix(".gguf").ok_or_else(|| invalid("out", format!("{s} does not end in .gguf")))?;
    let stem = match stem.rfind("-00001-of-") {
        Some(i) => &stem[..i],
        None => stem,
    };
    Ok(PathBuf::from(stem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_name_the_option() {
        SynthSpec::default().validate().unwrap();
        let bad = SynthSpec { experts_used: 9, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("--experts-used"));
        let bad = SynthSpec { out_type: OutputType::Q4KM, embd: 96, heads: 3, kv_heads: 1, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("multiple of 256"));
        let bad = SynthSpec { split_max_tensors: Some(4), out_type: OutputType::Q8_0, ..Default::default() };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn split_names_follow_llama_cpp() {
        let p = split_prefix(Path::new("/m/x-00001-of-00003.gguf")).unwrap();
        assert_eq!(p, PathBuf::from("/m/x"));
        assert_eq!(split_paths(&p, 2)[1], PathBuf::from("/m/x-00002-of-00002.gguf"));
        assert_eq!(split_prefix(Path::new("/m/y.gguf")).unwrap(), PathBuf::from("/m/y"));
    }

    #[test]
    fn expert_tensors_are_three_dimensional() {
        let spec = SynthSpec::default();
        let t = spec.tensors();
        let gate = t.iter().find(|(s, _)| s.name == "blk.1.ffn_gate_exps.weight").unwrap();
        assert_eq!(gate.0.ne, vec![256, 256, 8]);
        assert_eq!(t.len(), 3 + 12 * spec.layers as usize);
        assert_eq!(spec.expert_bytes(), 2 * 3 * 256 * 256 * 8 * 2, "f16 experts of 2 layers");
    }
}
