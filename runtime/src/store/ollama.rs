//! Ollama's model folder layout (`~/.ollama/models`, `$OLLAMA_MODELS`, the service's
//! `/usr/share/ollama/.ollama/models`), so that the models of an Ollama installation on the
//! board are served as they are, and those sluice pulls by an Ollama name are Ollama's too:
//!
//! ```text
//! <dir>/manifests/registry.ollama.ai/<namespace>/<model>/<tag>   the manifest (JSON)
//! <dir>/blobs/sha256-<hex>                                       its layers, named by digest
//! ```
//!
//! The manifest is written last, once every layer's digest was checked: a model is found only
//! when it is whole.

use std::fs;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ModelName;

/// The registry host Ollama names its library's manifests by.
pub const REGISTRY_HOST: &str = "registry.ollama.ai";
/// The media type of the layer that holds the GGUF model.
pub const MODEL_LAYER: &str = "application/vnd.ollama.image.model";
/// The most bytes a manifest may have.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// One layer (or the config) of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// What it holds (`application/vnd.ollama.image.model`, `...template`, `...params`).
    #[serde(rename = "mediaType")]
    pub media_type: String,
    /// `sha256:<hex>`.
    pub digest: String,
    /// Bytes.
    pub size: u64,
}

impl Layer {
    /// The hex of a `sha256:` digest, when it is one.
    pub fn sha256(&self) -> Option<&str> {
        self.digest.strip_prefix("sha256:").filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    }
}

/// A model's manifest (the Docker v2 shape Ollama's registry serves).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// 2.
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    /// The manifest's media type.
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    /// The model's config blob.
    pub config: Layer,
    /// Its layers.
    pub layers: Vec<Layer>,
}

impl Manifest {
    /// The layer holding the GGUF model.
    pub fn model_layer(&self) -> Option<&Layer> {
        self.layers.iter().find(|l| l.media_type == MODEL_LAYER)
    }

    /// The config and every layer.
    pub fn blobs(&self) -> impl Iterator<Item = &Layer> {
        std::iter::once(&self.config).chain(&self.layers)
    }
}

/// An Ollama model folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OllamaDir {
    /// The folder (holding `manifests/` and `blobs/`).
    pub root: PathBuf,
}

impl OllamaDir {
    /// Where the manifest of `namespace/model:tag` is.
    pub fn manifest_path(&self, namespace: &str, model: &str, tag: &str) -> PathBuf {
        self.root.join("manifests").join(REGISTRY_HOST).join(namespace).join(model).join(tag)
    }

    /// Where the blob of `sha256:<hex>` is.
    pub fn blob(&self, hex: &str) -> PathBuf {
        self.root.join("blobs").join(format!("sha256-{hex}"))
    }

    /// The manifest stored for `namespace/model:tag`.
    pub fn manifest(&self, namespace: &str, model: &str, tag: &str) -> Option<Manifest> {
        let bytes =
            sluice_hal::file::read_regular(&self.manifest_path(namespace, model, tag), MAX_MANIFEST_BYTES).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// The model file of `namespace/model:tag` when its manifest and model blob are there.
    pub fn find(&self, namespace: &str, model: &str, tag: &str) -> Option<PathBuf> {
        let m = self.manifest(namespace, model, tag)?;
        let path = self.blob(m.model_layer()?.sha256()?);
        path.is_file().then_some(path)
    }

    /// Writes the manifest of `namespace/model:tag` (its blobs must be there).
    pub fn write_manifest(&self, namespace: &str, model: &str, tag: &str, m: &Manifest) -> io::Result<()> {
        let path = self.manifest_path(namespace, model, tag);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        let bytes = serde_json::to_vec(m).map_err(io::Error::other)?;
        crate::framed::write_atomically(&path, &bytes)
    }

    /// The models whose manifests are here (Ollama's names).
    pub fn names(&self) -> Vec<ModelName> {
        let base = self.root.join("manifests").join(REGISTRY_HOST);
        let mut out = Vec::new();
        for ns in dir_names(&base) {
            for model in dir_names(&base.join(&ns)) {
                for tag in dir_names(&base.join(&ns).join(&model)) {
                    out.push(ModelName::Ollama { namespace: ns.clone(), model: model.clone(), tag });
                }
            }
        }
        out.sort_by_key(|n| n.to_string());
        out
    }

    /// Removes the manifest of `namespace/model:tag` and the blobs no other manifest here uses;
    /// the bytes freed.
    pub fn remove(&self, namespace: &str, model: &str, tag: &str) -> io::Result<u64> {
        let Some(m) = self.manifest(namespace, model, tag) else { return Ok(0) };
        fs::remove_file(self.manifest_path(namespace, model, tag))?;
        let used: Vec<String> = self
            .names()
            .iter()
            .filter_map(|n| match n {
                ModelName::Ollama { namespace, model, tag } => self.manifest(namespace, model, tag),
                ModelName::Hub { .. } => None,
            })
            .flat_map(|m| m.blobs().map(|l| l.digest.clone()).collect::<Vec<_>>())
            .collect();
        let mut freed = 0;
        for layer in m.blobs().filter(|l| !used.contains(&l.digest)) {
            if let Some(hex) = layer.sha256() {
                let path = self.blob(hex);
                freed += fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                let _ = fs::remove_file(&path);
            }
        }
        Ok(freed)
    }
}

/// The names of the entries of `dir` (empty when it cannot be read).
fn dir_names(dir: &std::path::Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    names
}
