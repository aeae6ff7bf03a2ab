//! `sluice pull NAME`: a model fetched by name into the store ([`crate::store`]), from the hosts
//! the settings name (a Hugging Face endpoint as `HF_ENDPOINT` names one, an Ollama registry).
//!
//! Every file is fetched in several ranges at once ([`fetch`]), resumed where a dropped
//! connection, a stall or a stopped pull left it, and checked against its sha256 (the hub's LFS
//! digest, the registry's blob digest) as it lands; only a file whose digest is right is moved
//! into place, and a model is found in the store only once all of its files are. The checksum
//! sidecar of `sluice verify` is written in the same pass. The free space is checked against the
//! sizes the host announces before the first byte.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub mod fetch;
pub mod header;
pub mod http;
pub mod hub;
pub mod partial;
pub mod progress;
pub mod registry;
pub mod sha256;

use crate::store::ollama::Manifest;
use crate::store::quant::QuantError;
use crate::store::{ModelName, NameError, Store, StoredModel};
use crate::stream::checksums::streaming::SumsBuilder;
use fetch::FetchSettings;
use http::{Http, Token};
use progress::Progress;

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// Not a name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// No file of the repository answers the name.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// The network failed (tried again where it can be).
    #[error("{url}: {why}")]
    Http {
        /// The URL.
        url: String,
        /// What happened.
        why: String,
    },
    /// The host answered what a pull cannot use.
    #[error("{url}: {why}")]
    Broken {
        /// The URL.
        url: String,
        /// What it answered.
        why: String,
    },
    /// 401 or 403.
    #[error("{what}: access denied (HTTP {status}): {hint}")]
    Denied {
        /// What was asked for.
        what: String,
        /// The status.
        status: u16,
        /// How to get access.
        hint: String,
    },
    /// 404.
    #[error("{what}: not found ({url})")]
    NotFound {
        /// What was asked for.
        what: String,
        /// The URL.
        url: String,
    },
    /// A local file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Not enough free space.
    #[error("{name} needs {need} more in {dir}, which has {free} free; free some space (`sluice models --rm NAME` removes a stored model) or pull into another store")]
    NoSpace {
        /// The model.
        name: String,
        /// The folder.
        dir: PathBuf,
        /// Bytes needed, readable.
        need: bytesize::ByteSize,
        /// Bytes free, readable.
        free: bytesize::ByteSize,
    },
    /// Bigger than the settings allow.
    #[error("{name} is {size}, more than the {max} this server may pull (store.max_model_mb)")]
    TooBig {
        /// The model.
        name: String,
        /// Its size.
        size: bytesize::ByteSize,
        /// The most allowed.
        max: bytesize::ByteSize,
    },
    /// A file's bytes do not have the digest the host announced.
    #[error("{file}: its sha256 is {got}, not {expected} as the host announced: the download was damaged; it was deleted and nothing was stored; pull again")]
    Digest {
        /// The file.
        file: String,
        /// The announced digest.
        expected: String,
        /// The digest of what came.
        got: String,
    },
    /// The host's file changed during the pull.
    #[error("{file} changed on the host during the pull; pull again to fetch the new version")]
    Changed {
        /// The file.
        file: String,
    },
    /// A range failed too many times.
    #[error("{file}: gave up after {tries} tries: {last}")]
    GaveUp {
        /// The file.
        file: String,
        /// Tries.
        tries: u32,
        /// The last error.
        last: Box<PullError>,
    },
    /// Another part of the same pull failed first.
    #[error("stopped")]
    Stopped,
}

impl PullError {
    /// Whether trying again may succeed (the network's errors).
    pub fn is_transient(&self) -> bool {
        matches!(self, PullError::Http { .. })
    }
}

/// One file to fetch.
#[derive(Debug, Clone)]
pub struct PlannedFile {
    /// Its name in messages (a repository's file name, a blob's digest).
    pub label: String,
    /// Where it is fetched from.
    pub url: String,
    /// Bytes, as the host announced.
    pub size: u64,
    /// Its sha256, lowercase hex, as the host announced.
    pub sha256: String,
    /// Where it goes.
    pub dest: PathBuf,
    /// Whether it is one of the model's GGUF files (whose sums make the sidecar), in order.
    pub gguf: bool,
}

/// Where a plan's files come from, for putting them in place.
#[derive(Debug, Clone)]
pub enum Source {
    /// A hub repository at a commit.
    Hub {
        /// `owner/repo`.
        repo: String,
        /// The commit.
        commit: String,
    },
    /// An Ollama registry's manifest.
    Ollama {
        /// The manifest.
        manifest: Box<Manifest>,
    },
}

/// A model's files on its host.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The model's name, its quantization resolved.
    pub name: ModelName,
    /// Its files, the GGUF files first and in order.
    pub files: Vec<PlannedFile>,
    /// The token for the host, when one is set.
    pub token: Option<Token>,
    /// Where they come from.
    pub source: Source,
}

impl Planned {
    /// Bytes of all files.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// Where and how pulls fetch.
#[derive(Debug, Clone)]
pub struct PullSettings {
    /// The Hugging Face endpoint (`$HF_ENDPOINT`, else https://huggingface.co).
    pub hf_endpoint: String,
    /// The Ollama registry (`$SLUICE_OLLAMA_REGISTRY`, else https://registry.ollama.ai).
    pub ollama_registry: String,
    /// Ranges, retries.
    pub fetch: FetchSettings,
    /// A read without a byte for this long is a stall (the connection is dropped and the range
    /// tried again).
    pub stall: Duration,
    /// The largest model a pull takes.
    pub max_model_bytes: Option<u64>,
}

impl Default for PullSettings {
    fn default() -> Self {
        PullSettings {
            hf_endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            ollama_registry: std::env::var("SLUICE_OLLAMA_REGISTRY")
                .ok()
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "https://registry.ollama.ai".into()),
            fetch: FetchSettings { connections: 4, chunk: 16 << 20, retries: 6, backoff: Duration::from_millis(500) },
            stall: Duration::from_secs(30),
            max_model_bytes: None,
        }
    }
}

/// What a pull did.
#[derive(Debug)]
pub struct PullReport {
    /// The model, now in the store.
    pub model: StoredModel,
    /// Bytes fetched this time.
    pub fetched: u64,
    /// Wall time.
    pub seconds: f64,
    /// The checksum sidecar, when one was written (or was there).
    pub sidecar: Option<PathBuf>,
}

/// The files `name` means on its host and where they go in `store`.
pub fn plan(store: &Store, name: &ModelName, settings: &PullSettings) -> Result<Planned, PullError> {
    let http = Http::new(settings.stall);
    match name {
        ModelName::Hub { repo, quant } => hub::plan(&http, &settings.hf_endpoint, &store.hub, repo, quant.as_deref()),
        ModelName::Ollama { namespace, model, tag } => {
            registry::plan(&http, &settings.ollama_registry, &store.ollama, namespace, model, tag)
        }
    }
}

/// Free bytes for an unprivileged writer in the filesystem of `dir`.
fn free_bytes(dir: &Path) -> Result<u64, PullError> {
    let st = nix::sys::statvfs::statvfs(dir)
        .map_err(|e| PullError::Io { path: dir.into(), source: std::io::Error::from_raw_os_error(e as i32) })?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// Refuses a plan bigger than the settings allow or than the free space (less what its partial
/// files already hold), before the first byte.
pub fn check_room(planned: &Planned, settings: &PullSettings) -> Result<(), PullError> {
    let name = planned.name.to_string();
    if let Some(max) = settings.max_model_bytes.filter(|&m| planned.bytes() > m) {
        return Err(PullError::TooBig {
            name,
            size: bytesize::ByteSize(planned.bytes()),
            max: bytesize::ByteSize(max),
        });
    }
    let missing: Vec<&PlannedFile> = planned.files.iter().filter(|f| !f.dest.is_file()).collect();
    let Some(first) = missing.first() else { return Ok(()) };
    let dir = first.dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|source| PullError::Io { path: dir.into(), source })?;
    let need: u64 = missing.iter().map(|f| f.size.saturating_sub(partial::allocated(&f.dest))).sum();
    let free = free_bytes(dir)?;
    if need > free {
        return Err(PullError::NoSpace {
            name,
            dir: dir.into(),
            need: bytesize::ByteSize(need),
            free: bytesize::ByteSize(free),
        });
    }
    Ok(())
}

/// Deletes the partial files of the same files left by a pull of other versions of them (the
/// host's file changed since): their bytes would never be used.
fn drop_stale_partials(planned: &Planned) {
    let dirs: std::collections::BTreeSet<&Path> = planned.files.iter().filter_map(|f| f.dest.parent()).collect();
    let wanted: Vec<PathBuf> = planned.files.iter().map(|f| partial::partial_paths(&f.dest).1).collect();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for state in entries.flatten().map(|e| e.path()) {
            let is_state = state.to_string_lossy().ends_with(".sluice-state");
            if is_state
                && !wanted.contains(&state)
                && partial::state_label(&state).is_some_and(|l| planned.files.iter().any(|f| f.label == l))
            {
                let partial = state.with_extension("sluice-partial");
                let _ = std::fs::remove_file(&partial);
                let _ = std::fs::remove_file(&state);
            }
        }
    }
}

/// Pulls `name` into `store`, showing progress on `progress`.
pub fn pull(
    store: &Store,
    name: &ModelName,
    settings: &PullSettings,
    progress: &dyn Progress,
) -> Result<PullReport, PullError> {
    let t0 = Instant::now();
    let planned = plan(store, name, settings)?;
    pull_planned(store, &planned, settings, progress, t0)
}

/// Fetches what [`plan`] found into `store` (after [`check_room`], which it repeats); `t0` is
/// when the pull began.
pub fn pull_planned(
    store: &Store,
    planned: &Planned,
    settings: &PullSettings,
    progress: &dyn Progress,
    t0: Instant,
) -> Result<PullReport, PullError> {
    check_room(planned, settings)?;
    drop_stale_partials(planned);
    let http = Http::new(settings.stall);
    let first_path = place_of_first(store, planned);
    let sidecar = crate::stream::checksums::sidecar_of(&first_path);
    let mut sums_on = !sidecar.is_file();
    let mut builder: Option<SumsBuilder> = None;
    let mut fetched = 0;
    for file in &planned.files {
        let want = sums_on && file.gguf;
        let done = if file.dest.is_file() {
            if !want {
                continue;
            }
            if builder.is_none() {
                builder = first_header(&file.dest, progress);
            }
            match &builder {
                Some(b) => fetch::sums_of_stored(&file.dest, b)?,
                None => None,
            }
        } else {
            fetched += file.size;
            let slot = if want { Some(&mut builder) } else { None };
            fetch::fetch(&http, planned.token.as_ref(), file, &settings.fetch, progress, slot)?
        };
        if want {
            match (builder.as_mut(), done) {
                (Some(b), Some(d)) => b.push(d),
                _ => (sums_on, builder) = (false, None),
            }
        }
    }
    let model = put_in_place(store, planned)?;
    let sidecar = match builder.filter(|_| sums_on) {
        Some(b) => {
            b.save(&model.path)
                .map_err(|e| PullError::Io { path: sidecar.clone(), source: std::io::Error::other(e.to_string()) })?;
            Some(sidecar)
        }
        None => sidecar.is_file().then_some(sidecar),
    };
    Ok(PullReport { model, fetched, seconds: t0.elapsed().as_secs_f64(), sidecar })
}

/// A sidecar builder from the header of the model's first file, or `None` (said why).
pub(crate) fn first_header(path: &Path, progress: &dyn Progress) -> Option<SumsBuilder> {
    let made = ggml_sys::GgufFile::open(path)
        .map_err(|e| e.to_string())
        .and_then(|g| SumsBuilder::new(path, &g).map_err(|e| e.to_string()));
    match made {
        Ok(b) => Some(b),
        Err(why) => {
            progress.note(&format!("no checksum sidecar for {}: {why}", path.display()));
            None
        }
    }
}

/// Where the model's first file is found once in place.
fn place_of_first(store: &Store, planned: &Planned) -> PathBuf {
    match &planned.source {
        Source::Hub { repo, commit } => store.hub.snapshot_file(repo, commit, &planned.files[0].label),
        Source::Ollama { .. } => planned.files[0].dest.clone(),
    }
}

/// Makes the model findable: the hub's snapshot links and `main`, or Ollama's manifest.
fn put_in_place(store: &Store, planned: &Planned) -> Result<StoredModel, PullError> {
    let io = |path: PathBuf| move |source| PullError::Io { path, source };
    match (&planned.source, &planned.name) {
        (Source::Hub { repo, commit }, _) => {
            for f in &planned.files {
                store.hub.link(repo, commit, &f.label, &f.sha256).map_err(io(f.dest.clone()))?;
            }
            store.hub.set_main(repo, commit).map_err(io(store.hub.repo_dir(repo)))?;
        }
        (Source::Ollama { manifest }, ModelName::Ollama { namespace, model, tag }) => {
            store.ollama.write_manifest(namespace, model, tag, manifest).map_err(io(store.ollama.root.clone()))?;
        }
        (Source::Ollama { .. }, ModelName::Hub { .. }) => {}
    }
    store.find(&planned.name).ok_or_else(|| PullError::Io {
        path: planned.files[0].dest.clone(),
        source: std::io::Error::other("pulled, but not found in the store afterwards"),
    })
}
