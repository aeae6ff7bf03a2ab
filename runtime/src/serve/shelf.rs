//! The models a server answers to by name: the one it has loaded and the others in the store
//! ([`crate::store`]). A request that names another stored model gets it loaded in place of the
//! current one (one model at a time: a board holds one), once the new one's plan fits the
//! board's budget; `/api/pull` fetches from the hosts the settings name only.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use super::error::ApiError;
use crate::launch::Launch;
use crate::pull::PullSettings;
use crate::store::{ModelName, Store, StoredModel};

/// A model the engine loads: the name clients see and its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChoice {
    /// The name it is served under.
    pub id: String,
    /// Its file (a split model's first).
    pub path: PathBuf,
}

/// Why the model at a path cannot be served on the board (`None` when it can).
pub type Refusal = Box<dyn Fn(&Path) -> Option<String> + Send + Sync>;

/// The refusal of a model planned as the server's `launch` plans its own: the same board,
/// context, slots and cache, another model file.
pub fn planned_refusal(launch: Launch) -> Refusal {
    Box::new(move |path| {
        let other = Launch { model: path.to_path_buf(), ..launch.clone() };
        match other.plan() {
            Ok(p) => p.ledger.err().map(|e| e.to_string()),
            Err(e) => Some(e.to_string()),
        }
    })
}

/// A model a request may name, as listings show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The name it is listed under.
    pub name: String,
    /// Its file (a split model's first).
    pub path: PathBuf,
    /// Bytes of its files.
    pub bytes: u64,
}

/// What a server may do with the store.
#[derive(Debug, Clone)]
pub struct ShelfConfig {
    /// The store.
    pub store: Store,
    /// How pulls fetch; `None` refuses them (`pull = false`).
    pub pull: Option<PullSettings>,
    /// Whether a request may load another stored model (`switch_models`).
    pub switch: bool,
}

/// The server's models.
pub struct Shelf {
    cfg: ShelfConfig,
    /// The model the server started with (a file given by path need not be in the store).
    first: ModelChoice,
    current: Mutex<ModelChoice>,
    /// Why a model file cannot be served on this board (its plan's refusal), or `None`.
    refusal: Refusal,
    pulling: Mutex<BTreeSet<String>>,
    /// What the headers of stored models say, by file and its modification time.
    described: Mutex<HashMap<PathBuf, (SystemTime, Described)>>,
}

/// What a stored model's header and file say, for listings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    /// `general.architecture`.
    pub architecture: String,
    /// The quantization (`general.file_type`, as llama.cpp names it).
    pub quantization: String,
    /// The sha256 the store names its (first) file's bytes by, in hex.
    pub digest: String,
    /// When the file was written.
    pub modified: SystemTime,
}

impl std::fmt::Debug for Shelf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shelf").field("current", &self.current()).field("store", &self.cfg.store).finish()
    }
}

/// The name a stored model is listed under: Ollama's spelling (`model:tag`, and
/// `hf.co/owner/repo:QUANT` for a hub repository, as Ollama names those).
pub fn listed_name(m: &StoredModel) -> String {
    match &m.name {
        ModelName::Hub { .. } => format!("hf.co/{}", m.name),
        ModelName::Ollama { .. } => m.name.to_string(),
    }
}

impl Shelf {
    /// The shelf of a server that loaded `current`; `refusal` says why another model cannot be
    /// served ([`planned_refusal`]).
    pub fn new(cfg: ShelfConfig, current: ModelChoice, refusal: Refusal) -> Shelf {
        let (pulling, described) = (Mutex::new(BTreeSet::new()), Mutex::new(HashMap::new()));
        Shelf { cfg, first: current.clone(), current: Mutex::new(current), refusal, pulling, described }
    }

    /// The model loaded (or being loaded).
    pub fn current(&self) -> ModelChoice {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The engine switched to `choice`.
    pub(super) fn set_current(&self, choice: ModelChoice) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = choice;
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.cfg.store
    }

    /// How pulls fetch, when pulling is on.
    pub fn pull_settings(&self) -> Option<&PullSettings> {
        self.cfg.pull.as_ref()
    }

    /// The models other than the current one a request may name: the one the server started
    /// with, then the stored ones.
    pub fn others(&self) -> Vec<Listed> {
        let current = self.current();
        let first = (self.first.path != current.path).then(|| {
            let bytes = std::fs::metadata(&self.first.path).map_or(0, |m| m.len());
            let name =
                if self.first.id.contains(':') { self.first.id.clone() } else { format!("{}:latest", self.first.id) };
            Listed { name, path: self.first.path.clone(), bytes }
        });
        let stored = self.cfg.store.list().into_iter().filter(|m| m.path != current.path && m.path != self.first.path);
        first
            .into_iter()
            .chain(stored.map(|m| Listed { name: listed_name(&m), path: m.path, bytes: m.bytes }))
            .collect()
    }

    /// The stored model `name` means (any spelling a client may use: `hf.co/o/r:Q`, `o/r:Q`,
    /// `model`, `model:tag`).
    pub fn find(&self, name: &str) -> Option<StoredModel> {
        let parsed = ModelName::parse(name).ok()?;
        self.cfg.store.find(&parsed)
    }

    /// What a request naming `name` (not the current model) loads: another stored model whose
    /// plan fits the board, or the error a client gets (404 when it is not stored, 400 when
    /// switching is off or its plan does not fit).
    pub fn choose_other(&self, name: &str) -> Result<ModelChoice, ApiError> {
        if super::model_card::names_served(name, &self.first.id) {
            return self.switch_allowed(name).map(|()| self.first.clone());
        }
        let Some(found) = self.find(name) else {
            return Err(ApiError::new(
                404,
                "not_found_error",
                format!(
                    "model \"{name}\" not found, try pulling it first (this server serves \"{}\")",
                    self.current().id
                ),
            )
            .with_param("model"));
        };
        if found.path == self.current().path {
            return Ok(self.current());
        }
        self.switch_allowed(name)?;
        self.fits(&found)?;
        Ok(ModelChoice { id: listed_name(&found), path: found.path })
    }

    /// The stored model other than the current one that `name` means (`None` for any other
    /// name: the current model's, or one not stored), planned to fit.
    pub fn other_named(&self, name: &str, current_id: &str) -> Result<Option<ModelChoice>, ApiError> {
        if name.is_empty() || super::model_card::names_served(name, current_id) {
            return Ok(None);
        }
        if super::model_card::names_served(name, &self.first.id) {
            return self.choose_other(name).map(Some);
        }
        match self.find(name) {
            Some(m) if m.path != self.current().path => self.choose_other(name).map(Some),
            _ => Ok(None),
        }
    }

    /// Refuses a switch when the settings pin the model.
    fn switch_allowed(&self, name: &str) -> Result<(), ApiError> {
        if self.cfg.switch {
            return Ok(());
        }
        Err(ApiError::invalid(
            format!(
                "model \"{name}\" is stored, but this server serves \"{}\" only (switch_models = false)",
                self.current().id
            ),
            Some("model"),
        ))
    }

    /// Refuses a model whose plan does not fit the board's budget, with the plan's words.
    fn fits(&self, m: &StoredModel) -> Result<(), ApiError> {
        match (self.refusal)(&m.path) {
            None => Ok(()),
            Some(why) => Err(ApiError::invalid(
                format!("model \"{}\" cannot be served on this board: {why}", listed_name(m)),
                Some("model"),
            )),
        }
    }

    /// What the model file at `path` is (read from its header once per version of the file).
    pub fn describe(&self, path: &Path) -> Option<Described> {
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok()?;
        let mut cache = self.described.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((when, d)) = cache.get(path) {
            if *when == modified {
                return Some(d.clone());
            }
        }
        let g = ggml_sys::GgufFile::open(path).ok()?;
        let blob = std::fs::canonicalize(path).ok()?;
        let name = blob.file_name()?.to_string_lossy().into_owned();
        let d = Described {
            architecture: g.architecture().unwrap_or_default(),
            quantization: crate::metadata::quantization_of(&g).unwrap_or_else(|| "unknown".into()),
            digest: name.strip_prefix("sha256-").unwrap_or(&name).to_string(),
            modified,
        };
        cache.insert(path.to_path_buf(), (modified, d.clone()));
        Some(d)
    }

    /// Marks `name` as being pulled; false when a pull of it already runs.
    pub fn start_pull(&self, name: &str) -> bool {
        self.pulling.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string())
    }

    /// A pull of `name` ended.
    pub fn end_pull(&self, name: &str) {
        self.pulling.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
    }
}
