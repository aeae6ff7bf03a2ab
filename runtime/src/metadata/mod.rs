//! The checks of a model's metadata and tensor table that llama.cpp asserts on instead of
//! reporting: run before any llama.cpp call, in every mode, so a malformed file gets an error
//! that names the key, tensor or value rather than an abort. Each check names the llama.cpp
//! assert or division it stands in for (pinned llama.cpp: `load_hparams`, the verified
//! architectures' `load_arch_hparams` and graph builders, `build_moe_ffn`, ggml's CPU ops).

mod attention;
mod experts;
pub mod layout;
mod tensors;
pub mod verified;
mod vocab;

use std::path::{Path, PathBuf};

use ggml_sys::GgufFile;

/// llama.cpp's most layers (`LLAMA_MAX_LAYERS`).
pub const MAX_LAYERS: u64 = 512;
/// llama.cpp's most experts (`LLAMA_MAX_EXPERTS`).
pub const MAX_EXPERTS: u64 = 1024;
/// The smallest tensor data alignment llama.cpp loads.
pub const MIN_ALIGNMENT: u64 = 32;

/// A metadata value llama.cpp would abort on.
#[derive(Debug, thiserror::Error)]
#[error("{key} {problem}; the file is malformed (re-download or re-convert it)")]
pub struct MetadataError {
    /// The metadata key (or tensor) at fault.
    pub key: String,
    /// What is wrong with it.
    pub problem: String,
}

/// The most of a key an error quotes: keys come from the file (an architecture's name is part of
/// its keys), and a file may hold megabytes there.
const MAX_KEY_QUOTED: usize = 128;

impl MetadataError {
    /// The error about `key`; both the key and the problem (which may quote the file's values)
    /// are capped, so a hostile file cannot make a message megabytes long.
    fn new(key: impl Into<String>, problem: impl Into<String>) -> MetadataError {
        let key = key.into();
        // The architecture's part cut, the key's own name (after the last dot) kept.
        let key = match key.rsplit_once('.') {
            Some((arch, name)) if key.len() > MAX_KEY_QUOTED => {
                format!("{}.{}", crate::text::excerpt(arch, MAX_KEY_QUOTED), crate::text::excerpt(name, 64))
            }
            _ => crate::text::excerpt(&key, MAX_KEY_QUOTED),
        };
        MetadataError { key, problem: crate::text::excerpt(&problem.into(), crate::text::MAX_QUOTED) }
    }
}

/// One file's metadata as the checks read it: the architecture's keys and the layer count.
struct Meta<'a> {
    gguf: &'a GgufFile,
    arch: String,
    /// `block_count`: the layers, NextN ones included (1 to [`MAX_LAYERS`]).
    layers: u64,
}

impl Meta<'_> {
    /// The full name of the architecture's key `name`.
    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }

    /// The integer at the architecture's key `name`.
    fn int(&self, name: &str) -> Option<u64> {
        self.gguf.get_u64(&self.key(name))
    }

    /// The number at the architecture's key `name`.
    fn float(&self, name: &str) -> Option<f64> {
        self.gguf.get_f64(&self.key(name))
    }

    /// The architecture's per-layer key `name` (see [`per_layer_values`]), one value per layer
    /// (a scalar repeated): `None` when absent.
    fn per_layer(&self, name: &str) -> Result<Option<Vec<i64>>, MetadataError> {
        Ok(per_layer_values(self.gguf, &self.key(name), self.layers)?.map(|v| {
            if v.len() == 1 {
                vec![v[0]; self.layers as usize]
            } else {
                v
            }
        }))
    }

    /// An error about the architecture's key `name`.
    fn error(&self, name: &str, problem: impl Into<String>) -> MetadataError {
        MetadataError::new(self.key(name), problem)
    }

    /// Whether this is architecture `arch`.
    fn is(&self, arch: &str) -> bool {
        self.arch == arch
    }

    /// Whether this is one of the architectures whose graph builders sluice's gates verify.
    fn is_verified(&self) -> bool {
        verified::is_verified(&self.arch)
    }
}

/// Checks `gguf`'s metadata and tensor table: alignment, layer and NextN counts, expert counts,
/// groups and gating, attention widths against the tensors, rotary and norm parameters, tensor
/// types per role, and the vocabulary.
pub fn check(gguf: &GgufFile) -> Result<(), MetadataError> {
    let Some(arch) = gguf.architecture() else {
        return Err(MetadataError::new("general.architecture", "is missing or not a string"));
    };
    let align = gguf.alignment();
    if align < MIN_ALIGNMENT || !align.is_power_of_two() {
        return Err(MetadataError::new(
            "general.alignment",
            format!("is {align}; it must be a power of two of at least {MIN_ALIGNMENT}"),
        ));
    }
    let layers_key = format!("{arch}.block_count");
    let layers =
        gguf.get_u64(&layers_key).ok_or_else(|| MetadataError::new(&layers_key, "is missing or not an integer"))?;
    if !(1..=MAX_LAYERS).contains(&layers) {
        return Err(MetadataError::new(&layers_key, format!("is {layers}; llama.cpp runs 1 to {MAX_LAYERS} layers")));
    }
    let meta = Meta { gguf, arch, layers };
    // NextN (multi-token prediction) blocks come after the model's own layers: at least one
    // layer must be left to run (llama.cpp asserts only <=, then builds a graph of no layers).
    if let Some(n) = meta.int("nextn_predict_layers").filter(|&n| n >= layers) {
        return Err(meta.error(
            "nextn_predict_layers",
            format!("is {n} of the {layers} layers; the NextN layers follow at least one model layer"),
        ));
    }
    experts::check(&meta)?;
    attention::check(&meta)?;
    tensors::check(gguf)?;
    vocab::check(gguf)
}

/// A key that holds one value for every layer or an array of one per layer: its values (one for
/// a scalar), `None` when it is absent or of another type, and an error for an array that does
/// not hold one value per layer (of `layers`).
pub(crate) fn per_layer_values(gguf: &GgufFile, key: &str, layers: u64) -> Result<Option<Vec<i64>>, MetadataError> {
    if let Some(v) = gguf.get_u64(key) {
        return Ok(Some(vec![i64::try_from(v).unwrap_or(i64::MAX)]));
    }
    match gguf.array_u32(key) {
        Some(per_layer) if per_layer.len() as u64 != layers => {
            Err(MetadataError::new(key, format!("has {} values for {layers} layers", per_layer.len())))
        }
        values => Ok(values),
    }
}

/// Per-layer values as an error shows them: the value when all are the same, else the list
/// (its first 16 values).
fn shown(values: &[i64]) -> String {
    match values {
        [first, rest @ ..] if rest.iter().all(|v| v == first) => first.to_string(),
        many if many.len() > 16 => format!("{:?} (and {} more)", &many[..16], many.len() - 16),
        many => format!("{many:?}"),
    }
}

/// Why a model file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelFileError {
    /// The file is missing, unreadable, or malformed where llama.cpp would abort.
    #[error("model file {path}: {reason}")]
    Unusable {
        /// The file at fault (for a split model, the shard).
        path: PathBuf,
        /// Why it cannot be used, and what to do.
        reason: String,
    },
    /// ggml could not read the file's header (the error names the file).
    #[error(transparent)]
    Gguf(#[from] ggml_sys::Error),
}

impl ModelFileError {
    fn new(path: &Path, reason: impl Into<String>) -> ModelFileError {
        ModelFileError::Unusable { path: path.into(), reason: reason.into() }
    }
}

/// Checks that `path` is an existing regular file holding a model llama.cpp can load without
/// aborting: its header (see [`check`]), and the tensor tables of the other files of a split
/// model, within the read bound: a header on storage that stopped answering is an error, not a
/// wait without end (the reading thread is left behind).
pub fn check_model_file(path: &Path) -> Result<(), ModelFileError> {
    let meta = std::fs::metadata(path).map_err(|e| {
        ModelFileError::new(
            path,
            match e.kind() {
                std::io::ErrorKind::NotFound => {
                    "no such file (check the path, or create one with `sluice synth`)".into()
                }
                _ => e.to_string(),
            },
        )
    })?;
    if !meta.is_file() {
        return Err(ModelFileError::new(path, "is not a regular file"));
    }
    let bound = sluice_hal::storage::READ_BOUND;
    let (done, result) = std::sync::mpsc::channel();
    let owned = path.to_path_buf();
    std::thread::Builder::new()
        .name("sluice-header".into())
        .spawn(move || {
            let _ = done.send(check_file_now(&owned));
        })
        .map_err(|e| ModelFileError::new(path, format!("cannot start a reader: {e}")))?;
    result.recv_timeout(bound).unwrap_or_else(|_| {
        Err(ModelFileError::new(
            path,
            format!("reading its header did not finish within {} s: the storage stopped answering", bound.as_secs()),
        ))
    })
}

/// The header checks of [`check_model_file`] on this thread, however long the reads take.
fn check_file_now(path: &Path) -> Result<(), ModelFileError> {
    let gguf = GgufFile::open(path)?;
    check(&gguf).map_err(|e| ModelFileError::new(path, e.to_string()))?;
    let shards = layout::shard_paths(path, &gguf).map_err(|e| ModelFileError::new(path, e))?;
    for shard in &shards[1..] {
        tensors::check(&GgufFile::open(shard)?).map_err(|e| ModelFileError::new(shard, e.to_string()))?;
    }
    Ok(())
}

/// The quantization a model's header names (`general.file_type`, as llama.cpp names it).
pub fn quantization_of(g: &GgufFile) -> Option<String> {
    g.get_u64("general.file_type").map(quantization_name)
}

/// llama.cpp's name of a `general.file_type` (`LLAMA_FTYPE_*`).
pub fn quantization_name(file_type: u64) -> String {
    const NAMES: [(u64, &str); 33] = [
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (7, "Q8_0"),
        (8, "Q5_0"),
        (9, "Q5_1"),
        (10, "Q2_K"),
        (11, "Q3_K_S"),
        (12, "Q3_K_M"),
        (13, "Q3_K_L"),
        (14, "Q4_K_S"),
        (15, "Q4_K_M"),
        (16, "Q5_K_S"),
        (17, "Q5_K_M"),
        (18, "Q6_K"),
        (19, "IQ2_XXS"),
        (20, "IQ2_XS"),
        (21, "Q2_K_S"),
        (22, "IQ3_XS"),
        (23, "IQ3_XXS"),
        (24, "IQ1_S"),
        (25, "IQ4_NL"),
        (26, "IQ3_S"),
        (27, "IQ3_M"),
        (28, "IQ2_S"),
        (29, "IQ2_M"),
        (30, "IQ4_XS"),
        (31, "IQ1_M"),
        (32, "BF16"),
        (36, "TQ1_0"),
        (37, "TQ2_0"),
        (38, "MXFP4_MOE"),
    ];
    NAMES.iter().find(|(t, _)| *t == file_type).map_or_else(|| format!("file type {file_type}"), |(_, n)| n.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_quote_at_most_an_excerpt_of_the_file() {
        let arch = "x".repeat(1 << 20);
        let e = MetadataError::new(format!("{arch}.block_count"), format!("is {arch}"));
        let text = e.to_string();
        assert!(text.len() < 1024, "{} bytes", text.len());
        assert!(text.contains("more bytes).block_count is"), "{text}");
    }

    #[test]
    fn shown_values_are_short() {
        assert_eq!(shown(&[4, 4, 4]), "4");
        assert_eq!(shown(&[0, 2]), "[0, 2]");
        assert!(shown(&(0..40).collect::<Vec<i64>>()).ends_with("(and 24 more)"));
    }
}
