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
mod spec;
mod vocab;
mod weights;

use std::path::{Path, PathBuf};

use crate::metadata::layout::is_expert_weight;
pub use arch::SynthArch;
use gguf_writer::{GgufWriter, TensorSpec, TensorType, Value, WriteError};
pub use routing::Routing;
pub use size::{fit_expert_ff, SizeError};
pub use spec::{OutputType, SynthSpec};
use weights::Init;

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
        meta.extend(vocab::metadata(self.words, self.chat_template.as_deref(), self.vocab_size));
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

    /// Estimated bytes of the tensors `keep` selects: exact for the types written directly; for a
    /// quantization, f32 vectors (norms, biases) as written and the matrices at the output type's
    /// bytes per weight.
    fn estimated_bytes(&self, keep: impl Fn(&TensorSpec) -> bool) -> f64 {
        let bpw = self.out_type.bytes_per_weight();
        let quantized = self.out_type.quant().is_some();
        let bytes = |t: &TensorSpec| match t.ty {
            TensorType::F32 => t.n_bytes() as f64,
            _ if quantized => t.n_elements() as f64 * bpw,
            _ => t.n_bytes() as f64,
        };
        self.tensors().iter().filter(|(t, _)| keep(t)).map(|(t, _)| bytes(t)).sum()
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
