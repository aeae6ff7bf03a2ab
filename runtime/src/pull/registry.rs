//! What an Ollama name means on an Ollama registry: its manifest (Docker's v2 shape), then
//! every blob by its sha256 digest, the model's GGUF first; they go into an Ollama folder as
//! Ollama keeps them.

use super::http::Http;
use super::{Planned, PlannedFile, PullError, Source};
use crate::store::ollama::{Manifest, OllamaDir};
use crate::store::ModelName;

/// The media type a registry serves manifests as.
const MANIFEST_TYPE: &str = "application/vnd.docker.distribution.manifest.v2+json";

/// The blobs of `namespace/model:tag` at `registry`, and where they go in `dir`.
pub fn plan(
    http: &Http,
    registry: &str,
    dir: &OllamaDir,
    namespace: &str,
    model: &str,
    tag: &str,
) -> Result<Planned, PullError> {
    let registry = registry.trim_end_matches('/');
    let name = ModelName::Ollama { namespace: namespace.into(), model: model.into(), tag: tag.into() };
    let what = format!("{name} on {registry}");
    let url = format!("{registry}/v2/{namespace}/{model}/manifests/{tag}");
    let manifest: Manifest = http.json(&url, Some(MANIFEST_TYPE), None, &what)?;
    let model_layer = manifest
        .model_layer()
        .ok_or_else(|| PullError::Http { url: url.clone(), why: format!("the manifest of {name} has no model layer") })?
        .clone();
    let mut files = Vec::new();
    for layer in std::iter::once(&model_layer).chain(manifest.blobs().filter(|l| l.digest != model_layer.digest)) {
        let hex = layer.sha256().ok_or_else(|| PullError::Http {
            url: url.clone(),
            why: format!("the manifest of {name} names a blob {:?}, not a sha256 digest", layer.digest),
        })?;
        files.push(PlannedFile {
            label: layer.digest.clone(),
            url: format!("{registry}/v2/{namespace}/{model}/blobs/{}", layer.digest),
            size: layer.size,
            sha256: hex.to_ascii_lowercase(),
            dest: dir.blob(&hex.to_ascii_lowercase()),
            gguf: layer.digest == model_layer.digest,
        });
    }
    Ok(Planned { name, files, token: None, source: Source::Ollama { manifest: Box::new(manifest) } })
}
