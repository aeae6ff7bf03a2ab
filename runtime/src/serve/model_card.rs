//! What the served model is, for the APIs that describe it (Ollama's `/api/tags`, `/api/show`,
//! `/api/ps`; llama-server's `/props`): read from the GGUF's metadata and the loaded model once,
//! when it is loaded.

use std::path::PathBuf;
use std::time::SystemTime;

use ggml_sys::{GgufFile, Model};
use sha2::{Digest as _, Sha256};

/// Whether a request's `name` reaches the served model `id`: the id itself or, as Ollama's
/// `/api/tags` lists a model without a tag, the id with `:latest` (editors list models from
/// `/api/tags` and then chat over `/v1/chat/completions`).
pub fn names_served(name: &str, id: &str) -> bool {
    name == id || name.strip_suffix(":latest") == Some(id)
}

/// The served model's description.
#[derive(Debug, Clone)]
pub struct ModelCard {
    /// The GGUF file.
    pub path: PathBuf,
    /// `general.architecture`.
    pub architecture: String,
    /// Weights, counted over the tensors.
    pub parameters: u64,
    /// The quantization's name (`general.file_type`, as llama.cpp names it).
    pub quantization: String,
    /// The chat template's source (`tokenizer.chat_template`; empty when the file has none).
    pub template: String,
    /// The context the model was trained for.
    pub trained_context: u32,
    /// The context this server runs.
    pub context: u32,
    /// Bytes of the file.
    pub size: u64,
    /// The file's modification time.
    pub modified: SystemTime,
    /// A sha256 of the file's path, size and modification time: a name for this file that
    /// changes when it does (hashing the whole file would read gigabytes at every start).
    pub digest: String,
    /// Whether the template has a thinking block.
    pub thinks: bool,
    /// The file's metadata as Ollama's `model_info` shows it: each scalar key with its value,
    /// arrays (the vocabulary's, per-layer ones) as null, the chat template left out (it is
    /// [`ModelCard::template`]).
    pub info: serde_json::Map<String, serde_json::Value>,
}

impl ModelCard {
    /// The card of `model`, served with `context` positions.
    pub fn of(model: &Model, context: u32, thinks: bool) -> ModelCard {
        let path = model.path().to_path_buf();
        let meta = std::fs::metadata(&path).ok();
        let size = meta.as_ref().map_or(0, std::fs::Metadata::len);
        let modified = meta.and_then(|m| m.modified().ok()).unwrap_or(SystemTime::UNIX_EPOCH);
        let gguf = GgufFile::open(&path).ok();
        let get = |key: &str| gguf.as_ref().and_then(|g| g.get_str(key)).unwrap_or_default();
        let parameters = gguf
            .as_ref()
            .map_or(0, |g| g.tensors().iter().map(|t| t.ne.iter().map(|&n| n.max(1) as u64).product::<u64>()).sum());
        let info = gguf.as_ref().map(model_info).unwrap_or_default();
        let since = modified.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let digest = Sha256::digest(format!("{}\n{size}\n{}", path.display(), since.as_nanos()));
        ModelCard {
            architecture: get("general.architecture"),
            parameters,
            quantization: gguf.as_ref().and_then(crate::metadata::quantization_of).unwrap_or_else(|| "unknown".into()),
            template: get("tokenizer.chat_template"),
            trained_context: model.n_ctx_train(),
            context,
            size,
            modified,
            digest: digest.iter().map(|b| format!("{b:02x}")).collect(),
            thinks,
            info,
            path,
        }
    }

    /// The weights as Ollama writes them (`30.5B`, `494.0M`).
    pub fn parameter_size(&self) -> String {
        let p = self.parameters as f64;
        if p >= 1e9 {
            format!("{:.1}B", p / 1e9)
        } else {
            format!("{:.1}M", p / 1e6)
        }
    }
}

/// The metadata of `gguf` as `model_info`: scalars with their values, arrays as null.
fn model_info(gguf: &GgufFile) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::{json, Value};
    gguf.keys()
        .into_iter()
        .filter(|k| k != "tokenizer.chat_template")
        .map(|k| {
            let v = gguf
                .get_u64(&k)
                .map(|n| json!(n))
                .or_else(|| gguf.get_f64(&k).map(|f| json!(f)))
                .or_else(|| gguf.get_str(&k).map(Value::String))
                .or_else(|| gguf.get_bool(&k).map(Value::Bool))
                .unwrap_or(Value::Null);
            (k, v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantizations_and_sizes_are_named_as_ollama_shows_them() {
        assert_eq!(crate::metadata::quantization_name(15), "Q4_K_M");
        assert_eq!(crate::metadata::quantization_name(99), "file type 99");
        let mut card = ModelCard::of_nothing();
        card.parameters = 30_532_122_624;
        assert_eq!(card.parameter_size(), "30.5B");
        card.parameters = 494_032_768;
        assert_eq!(card.parameter_size(), "494.0M");
    }

    impl ModelCard {
        fn of_nothing() -> ModelCard {
            ModelCard {
                path: PathBuf::new(),
                architecture: String::new(),
                parameters: 0,
                quantization: String::new(),
                template: String::new(),
                trained_context: 0,
                context: 0,
                size: 0,
                modified: SystemTime::UNIX_EPOCH,
                digest: String::new(),
                thinks: false,
                info: serde_json::Map::new(),
            }
        }
    }
}
