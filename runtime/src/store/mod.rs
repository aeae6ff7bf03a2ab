//! The model store: models by name, in the layouts other tools share.
//!
//! Hugging Face names (`owner/repo[:QUANT]`) live in the hub's cache layout ([`hub`]), by default
//! the hub's own cache directory, so what `huggingface-cli` or `llama-server -hf` downloaded is
//! found and the other way round. Ollama names (`model[:tag]`) live in Ollama's layout
//! ([`ollama`]): pulled into one folder, and read from the folders of an Ollama installation too.
//! Where each is (first that is set):
//!
//! - hub cache: `--hf-cache` (settings `store.hf_cache`), `$HF_HUB_CACHE`, `$HF_HOME/hub`,
//!   `$STATE_DIRECTORY/huggingface/hub` (the service), `~/.cache/huggingface/hub`;
//! - Ollama folder pulled into: `--ollama-models` (settings `store.ollama_models`),
//!   `$OLLAMA_MODELS`, `$STATE_DIRECTORY/ollama` (the service), `~/.ollama/models` where it exists,
//!   else `<sluice cache>/ollama`; also read: `~/.ollama/models` and Ollama's service folder
//!   `/usr/share/ollama/.ollama/models`.

use std::path::{Path, PathBuf};

use crate::dirs::env_path;

pub mod hub;
pub mod name;
pub mod ollama;
pub mod quant;

pub use hub::HubCache;
pub use name::{ModelName, NameError};
pub use ollama::OllamaDir;

/// Where Ollama's own service keeps its models.
const OLLAMA_SERVICE_DIR: &str = "/usr/share/ollama/.ollama/models";

/// Why a model argument names no model.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Not a path and not a name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A name of a model not in the store.
    #[error("{name} is not in the store ({places}); fetch it with `sluice pull {name}` (`sluice run --pull` fetches it first), or pass a .gguf file's path")]
    NotStored {
        /// The name.
        name: String,
        /// Where it was looked for.
        places: String,
    },
}

/// The store's folders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Store {
    /// Where Hugging Face names are kept.
    pub hub: HubCache,
    /// Where Ollama names are pulled to.
    pub ollama: OllamaDir,
    /// Other Ollama folders read (an Ollama installation's).
    pub ollama_read: Vec<OllamaDir>,
}

/// A stored model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredModel {
    /// Its name (a hub name with the quantization of its file).
    pub name: ModelName,
    /// The file to load.
    pub path: PathBuf,
    /// All of its files (a split model's shards; an Ollama model's model blob).
    pub files: Vec<PathBuf>,
    /// Bytes of its files.
    pub bytes: u64,
}

impl Store {
    /// The store for the folders given (`None`: the defaults, from the environment).
    pub fn new(hf_cache: Option<PathBuf>, ollama_models: Option<PathBuf>) -> Store {
        let home = env_path("HOME");
        let state = env_path("STATE_DIRECTORY");
        let hub = hf_cache
            .or_else(|| env_path("HF_HUB_CACHE"))
            .or_else(|| env_path("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| state.as_ref().map(|s| s.join("huggingface").join("hub")))
            .or_else(|| home.as_ref().map(|h| h.join(".cache").join("huggingface").join("hub")))
            .unwrap_or_else(|| crate::dirs::cache_dir().join("huggingface").join("hub"));
        let users_ollama = home.map(|h| h.join(".ollama").join("models"));
        let ollama = ollama_models
            .or_else(|| env_path("OLLAMA_MODELS"))
            .or_else(|| state.map(|s| s.join("ollama")))
            .or_else(|| users_ollama.clone().filter(|d| d.is_dir()))
            .unwrap_or_else(|| crate::dirs::cache_dir().join("ollama"));
        let ollama_read = users_ollama
            .into_iter()
            .chain([PathBuf::from(OLLAMA_SERVICE_DIR)])
            .filter(|d| *d != ollama && d.is_dir())
            .map(|root| OllamaDir { root })
            .collect();
        Store { hub: HubCache { root: hub }, ollama: OllamaDir { root: ollama }, ollama_read }
    }

    /// Every Ollama folder, the one pulled into first.
    fn ollama_dirs(&self) -> impl Iterator<Item = &OllamaDir> {
        std::iter::once(&self.ollama).chain(&self.ollama_read)
    }

    /// The stored model `name` means, when it is whole in the store.
    pub fn find(&self, name: &ModelName) -> Option<StoredModel> {
        let (path, files, name) = match name {
            ModelName::Hub { repo, quant } => {
                let (path, files) = self.hub.find(repo, quant.as_deref())?;
                let file = path.strip_prefix(self.hub.repo_dir(repo)).ok()?.to_string_lossy().into_owned();
                let quant = quant::quant_of(&file).or_else(|| quant.clone());
                (path, files, ModelName::Hub { repo: repo.clone(), quant })
            }
            ModelName::Ollama { namespace, model, tag } => {
                let path = self.ollama_dirs().find_map(|d| d.find(namespace, model, tag))?;
                (path.clone(), vec![path], name.clone())
            }
        };
        let bytes = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
        Some(StoredModel { name, path, files, bytes })
    }

    /// Every stored model: each hub repository's models, each Ollama manifest's.
    pub fn list(&self) -> Vec<StoredModel> {
        let mut out = Vec::new();
        for repo in self.hub.repos() {
            let Some((_, files)) = self.hub.files(&repo) else { continue };
            for set in quant::gguf_sets(&files) {
                let quant = set.quant.clone().or_else(|| Some(set.first().trim_end_matches(".gguf").to_string()));
                out.extend(self.find(&ModelName::Hub { repo: repo.clone(), quant }));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for dir in self.ollama_dirs() {
            for name in dir.names().into_iter().filter(|n| seen.insert(n.clone())) {
                out.extend(self.find(&name));
            }
        }
        out
    }

    /// Removes a stored model: its files, and what no other stored model uses. Models in an
    /// Ollama folder sluice only reads are left alone (an error says so). Returns the bytes freed.
    pub fn remove(&self, name: &ModelName) -> Result<u64, String> {
        let found = self.find(name).ok_or_else(|| format!("{name} is not in the store ({})", self.places()))?;
        match name {
            ModelName::Hub { repo, .. } => {
                let mut files = found.files.clone();
                files.extend(files.first().map(|f| crate::stream::checksums::sidecar_of(f)));
                self.hub.remove(repo, &files).map_err(|e| format!("removing {name}: {e}"))
            }
            ModelName::Ollama { namespace, model, tag } => {
                if self.ollama.find(namespace, model, tag).is_none() {
                    return Err(format!(
                        "{name} is in another Ollama folder ({}); remove it with `ollama rm {name}`",
                        found.path.display()
                    ));
                }
                let _ = std::fs::remove_file(crate::stream::checksums::sidecar_of(&found.path));
                self.ollama.remove(namespace, model, tag).map_err(|e| format!("removing {name}: {e}"))
            }
        }
    }

    /// The folders looked in, for messages.
    pub fn places(&self) -> String {
        std::iter::once(&self.hub.root)
            .chain(self.ollama_dirs().map(|d| &d.root))
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The file a `--model` value means: an existing file, anything ending in `.gguf` or holding
    /// a path's `./`, `/` start (a path, whether there or not), else a stored model's name.
    pub fn resolve(&self, arg: &Path) -> Result<PathBuf, StoreError> {
        let text = arg.to_string_lossy();
        let is_path = arg.exists()
            || text.ends_with(".gguf")
            || text.starts_with('/')
            || text.starts_with("./")
            || text.starts_with("../")
            || text.starts_with('~');
        if is_path {
            return Ok(arg.to_path_buf());
        }
        let name = ModelName::parse(&text)?;
        self.find(&name)
            .map(|m| m.path)
            .ok_or_else(|| StoreError::NotStored { name: name.to_string(), places: self.places() })
    }
}
