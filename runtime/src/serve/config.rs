//! The settings file of `sluice serve` (`/etc/sluice/sluice.toml` in the Debian package): the
//! model, the board, the address, the context, the cache, the API key and the rest of what a
//! board owner sets once. Flags given on the command line override it. Unknown keys and values
//! of the wrong type are errors that name the file and the key, as with board profiles.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where `sluice serve` looks for its settings when `--config` is not given.
pub const DEFAULT_PATH: &str = "/etc/sluice/sluice.toml";

/// The settings a board owner sets once: each is a key of the settings file and (but `board`,
/// which is the global `--board`) a flag of `sluice serve` of the same name, declared here
/// once for both. A flag overrides its key ([`ServeSettings::over`]). Every one is optional (the
/// model must come from the flags or the file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct ServeSettings {
    /// The model: a .gguf file (for a split model, its first file), or the name of a stored
    /// model (`sluice models`). Required here or as `model` in the settings file.
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// The board profile: `auto`, a built-in id, or a profile file (on the command line, the
    /// global `--board`).
    #[arg(skip)]
    pub board: Option<String>,
    /// Address to serve HTTP on (default: 127.0.0.1:8080).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// A second address to serve the same API on, for clients that assume Ollama's port
    /// (127.0.0.1:11434, or 0.0.0.0:11434 for the network); off unless given.
    #[arg(long)]
    pub ollama_listen: Option<SocketAddr>,
    /// Context positions per request, prompt and completion together (default: 8192 where the
    /// board's plan keeps its KV cache within an eighth of the memory budget, else 4096 or 2048;
    /// never more than the model's own length).
    #[arg(long, value_parser = clap::value_parser!(u32).range(MIN_CTX as i64..))]
    pub ctx: Option<u32>,
    /// Slots: conversations whose prompt memory (KV cache) is kept between requests, each with
    /// `ctx` positions of its own; a request goes to the slot that holds the longest prefix of
    /// its prompt and computes only the rest (default: 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_SLOTS as i64))]
    pub slots: Option<u32>,
    /// The most prompt tokens one decode takes (default: 512). A prompt's memory is kept for a
    /// later request in whole batches (see the docs on slots): a smaller batch keeps more of a
    /// short conversation; a larger one reads the experts fewer times for a long prompt.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH as i64))]
    pub batch: Option<u32>,
    /// What a slot keeps of a later prompt: `exact` (whole prompt batches; the same text as from
    /// an empty slot) or `any` (any shared prefix, answers included, computing only what is new:
    /// LOSSY, an answer may differ in a token from the same prompt computed afresh; default:
    /// exact).
    #[arg(long, value_enum)]
    pub reuse: Option<crate::generate::Reuse>,
    /// The most disk, in MiB, the slots saved in the state directory may take (for restarts
    /// and conversations that left their slot; the oldest go first; 0: none are saved; default:
    /// 1024).
    #[arg(long)]
    pub slot_save_mib: Option<u64>,
    /// Expert cache size in MiB (default: what the memory budget leaves; 0: no cache).
    #[arg(long)]
    pub cache_mb: Option<u64>,
    /// Read the API key from this file.
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Named keys, one client each (a user, a service), a line `NAME KEY` each: a prompt's
    /// memory is reused for the key that wrote it alone (beside the one key above, if any).
    #[arg(long, value_name = "FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// The model name clients give (default: the file name without .gguf).
    #[arg(long)]
    pub model_id: Option<String>,
    /// Generation requests that may wait while one runs; more are answered 503 with Retry-After
    /// (default: 8).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub queue: Option<u64>,
    /// RPC workers (`sluice worker`) that hold the model's last layers resident, as
    /// HOST:PORT,... in layer order (the last one holds the output layer too); this board keeps
    /// the first layers and streams their experts. Use a private link only: the link is not
    /// encrypted.
    #[arg(long, value_name = "HOST:PORT,...")]
    pub rpc: Option<Vec<String>>,
    /// The pre-shared key file the workers were started with (`sluice worker --key-file`).
    #[arg(long, value_name = "FILE")]
    pub rpc_key_file: Option<PathBuf>,
    /// Seconds the server waits for any one answer of a worker before the worker counts as lost
    /// and the server degraded (default: 60).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub rpc_call_timeout: Option<u64>,
    /// With an API key, require it for /metrics too (/health stays open).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub metrics_need_key: Option<bool>,
    /// Allow browser requests from this origin (CORS); repeat for several, `*` for any.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Option<Vec<String>>,
    /// Answer requests whose Host names this host too (beside IP addresses, localhost, this
    /// machine's name and names under .local, .internal and .home.arpa); repeat for several,
    /// `*` for any (behind a reverse proxy that passes on its own name).
    #[arg(long = "allowed-host", value_name = "NAME")]
    pub allowed_hosts: Option<Vec<String>>,
    /// The Hugging Face hub cache that stored hub names are found and pulled in (default:
    /// $HF_HUB_CACHE, $HF_HOME/hub, $STATE_DIRECTORY/huggingface/hub for the service,
    /// ~/.cache/huggingface/hub).
    #[arg(long, value_name = "DIR")]
    pub hf_cache: Option<PathBuf>,
    /// The Ollama models folder that Ollama names are found and pulled in (default:
    /// $OLLAMA_MODELS, $STATE_DIRECTORY/ollama for the service, ~/.ollama/models).
    #[arg(long, value_name = "DIR")]
    pub ollama_models: Option<PathBuf>,
    /// The Hugging Face endpoint pulls fetch hub names from (default: $HF_ENDPOINT, else
    /// https://huggingface.co). A server fetches from the hosts named here only.
    #[arg(long, value_name = "URL")]
    pub hf_endpoint: Option<String>,
    /// The Ollama registry pulls fetch Ollama names from (default: https://registry.ollama.ai).
    #[arg(long, value_name = "URL")]
    pub ollama_registry: Option<String>,
    /// Whether `/api/pull` fetches models (default: true; false refuses every pull).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub pull: Option<bool>,
    /// The largest model, in MiB, `/api/pull` fetches (default: no bound beyond the free space).
    #[arg(long, value_name = "MIB")]
    pub max_model_mb: Option<u64>,
    /// Whether a request that names another stored model loads it in place of the current one
    /// (default: true; false serves the one model the server started with).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub switch_models: Option<bool>,
    /// The KV cache's type for keys (`--cache-type-k` sets it on the command line).
    #[arg(skip)]
    pub cache_type_k: Option<crate::generate::KvCacheType>,
    /// The KV cache's type for values (`--cache-type-v`).
    #[arg(skip)]
    pub cache_type_v: Option<crate::generate::KvCacheType>,
}

/// The fewest context positions `ctx` may give.
const MIN_CTX: u32 = 16;
/// The most slots `slots` may give.
pub const MAX_SLOTS: u32 = 64;
/// The largest prompt batch `batch` may give.
pub const MAX_BATCH: u32 = 8192;
/// The disk the saved slots may take when `slot_save_mib` is not given, MiB.
pub const DEFAULT_SLOT_SAVE_MIB: u64 = 1024;

/// Why the settings file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read the settings file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("{path}: not valid TOML: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message, with the line.
        message: String,
    },
    /// A key is unknown, or its value has the wrong type or is out of range.
    #[error("{path}: key `{key}`: {message}")]
    Key {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong and what would fix it.
        message: String,
    },
    /// No model is named.
    #[error("{path}: no `model` key; set model = \"/path/to/model.gguf\" there, or give --model")]
    NoModel {
        /// The file.
        path: PathBuf,
    },
}

/// The largest settings file read (a commented one is a few KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;

impl ServeSettings {
    /// Reads and checks the settings file at `path`.
    pub fn load(path: &Path) -> Result<ServeSettings, ConfigError> {
        let text = sluice_hal::file::read_regular_string(path, MAX_FILE_BYTES)
            .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        ServeSettings::parse(&text, path)
    }

    /// Parses and checks the text of the settings file `path`.
    pub fn parse(text: &str, path: &Path) -> Result<ServeSettings, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            message: crate::text::toml_error(text, &e),
        })?;
        let file: ServeSettings = serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let path_in = e.path().to_string();
            let message = e.into_inner().message().to_string();
            // serde names an unknown key in its message, and the keys it expected.
            let (key, message) = match unknown_key(&message) {
                Some((k, keys)) => (
                    crate::text::excerpt(&k, crate::text::MAX_QUOTED),
                    format!("unknown key; the keys are {keys} (see the commented file the package installs)"),
                ),
                None => (path_in, crate::text::excerpt(&message, crate::text::MAX_QUOTED)),
            };
            ConfigError::Key { path: path.to_path_buf(), key, message }
        })?;
        file.check(path)?;
        Ok(file)
    }

    fn check(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |key: &str, message: &str| {
            Err(ConfigError::Key { path: path.to_path_buf(), key: key.into(), message: message.into() })
        };
        if self.ctx.is_some_and(|c| c < MIN_CTX) {
            return bad(
                "ctx",
                "at least 16 positions; remove the key for what the board's plan affords (8192, 4096 or 2048)",
            );
        }
        if self.model.as_ref().is_some_and(|m| m.as_os_str().is_empty()) {
            return bad("model", "empty; give the model's path");
        }
        if self.board.as_ref().is_some_and(String::is_empty) {
            return bad("board", "empty; give auto, a built-in id (`sluice boards`) or a profile file");
        }
        if self.slots.is_some_and(|s| s == 0 || s > MAX_SLOTS) {
            return bad("slots", "1 to 64; remove the key for 1");
        }
        if self.batch.is_some_and(|b| b == 0 || b > MAX_BATCH) {
            return bad("batch", "1 to 8192 tokens; remove the key for 512");
        }
        if self.queue == Some(0) {
            return bad("queue", "0 would refuse every request while one runs; use 1 or more");
        }
        for (key, url) in [("hf_endpoint", &self.hf_endpoint), ("ollama_registry", &self.ollama_registry)] {
            if url.as_ref().is_some_and(|u| !u.starts_with("https://") && !u.starts_with("http://")) {
                return bad(key, "a URL starting with https:// (or http:// for a host on a private network)");
            }
        }
        if self.rpc_call_timeout.is_some_and(|t| t == 0 || t > 3600) {
            return bad("rpc_call_timeout", "1 to 3600 seconds; remove the key for 60");
        }
        Ok(())
    }

    /// The model, or the error that names this file (`path`) and the key to set.
    pub fn require_model(&self, path: &Path) -> Result<&Path, ConfigError> {
        self.model.as_deref().ok_or_else(|| ConfigError::NoModel { path: path.to_path_buf() })
    }

    /// These settings (the flags), each over its key in `file` when given.
    pub fn over(self, file: ServeSettings) -> ServeSettings {
        // Every field named: a field added to the struct must be merged here too.
        ServeSettings {
            model: self.model.or(file.model),
            board: self.board.or(file.board),
            listen: self.listen.or(file.listen),
            ollama_listen: self.ollama_listen.or(file.ollama_listen),
            ctx: self.ctx.or(file.ctx),
            slots: self.slots.or(file.slots),
            batch: self.batch.or(file.batch),
            reuse: self.reuse.or(file.reuse),
            slot_save_mib: self.slot_save_mib.or(file.slot_save_mib),
            cache_mb: self.cache_mb.or(file.cache_mb),
            api_key_file: self.api_key_file.or(file.api_key_file),
            api_keys_file: self.api_keys_file.or(file.api_keys_file),
            model_id: self.model_id.or(file.model_id),
            queue: self.queue.or(file.queue),
            rpc: self.rpc.or(file.rpc),
            rpc_key_file: self.rpc_key_file.or(file.rpc_key_file),
            rpc_call_timeout: self.rpc_call_timeout.or(file.rpc_call_timeout),
            metrics_need_key: self.metrics_need_key.or(file.metrics_need_key),
            cors_origins: self.cors_origins.or(file.cors_origins),
            allowed_hosts: self.allowed_hosts.or(file.allowed_hosts),
            hf_cache: self.hf_cache.or(file.hf_cache),
            ollama_models: self.ollama_models.or(file.ollama_models),
            hf_endpoint: self.hf_endpoint.or(file.hf_endpoint),
            ollama_registry: self.ollama_registry.or(file.ollama_registry),
            pull: self.pull.or(file.pull),
            max_model_mb: self.max_model_mb.or(file.max_model_mb),
            switch_models: self.switch_models.or(file.switch_models),
            cache_type_k: self.cache_type_k.or(file.cache_type_k),
            cache_type_v: self.cache_type_v.or(file.cache_type_v),
        }
    }
}

/// The key serde's message (`unknown field `x`, expected one of `a`, `b``) says is unknown,
/// and the keys it expected, as a list.
fn unknown_key(message: &str) -> Option<(String, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest.split_once("expected one of ").map_or(rest, |(_, e)| e);
    Some((key.to_string(), expected.replace('`', "")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> ServeSettings {
        ServeSettings {
            model: Some("/srv/models/model.gguf".into()),
            board: Some("rpi5-8gb".into()),
            listen: Some("0.0.0.0:8080".parse().unwrap()),
            ollama_listen: Some("0.0.0.0:11434".parse().unwrap()),
            ctx: Some(2048),
            slots: Some(2),
            batch: Some(256),
            reuse: Some(crate::generate::Reuse::Any),
            slot_save_mib: Some(256),
            cache_mb: Some(512),
            api_key_file: Some("/etc/sluice/api-key".into()),
            api_keys_file: Some("/etc/sluice/api-keys".into()),
            model_id: Some("qwen3".into()),
            queue: Some(4),
            rpc: Some(vec!["10.0.0.2:50052".into(), "10.0.0.3:50052".into()]),
            rpc_key_file: Some("/etc/sluice/rpc.key".into()),
            rpc_call_timeout: Some(120),
            metrics_need_key: Some(true),
            cors_origins: Some(vec!["https://example.org".into()]),
            allowed_hosts: Some(vec!["sluice.example.org".into()]),
            hf_cache: Some("/var/lib/sluice/huggingface/hub".into()),
            ollama_models: Some("/usr/share/ollama/.ollama/models".into()),
            hf_endpoint: Some("https://huggingface.co".into()),
            ollama_registry: Some("https://registry.ollama.ai".into()),
            pull: Some(false),
            max_model_mb: Some(20_000),
            switch_models: Some(false),
            cache_type_k: Some(crate::generate::KvCacheType::Q8_0),
            cache_type_v: Some(crate::generate::KvCacheType::Q8_0),
        }
    }

    fn parse(text: &str) -> Result<ServeSettings, ConfigError> {
        ServeSettings::parse(text, Path::new("/etc/sluice/sluice.toml"))
    }

    /// The keys, as the message about an unknown key lists them.
    fn keys() -> Vec<String> {
        let e = parse("zzz = 1").unwrap_err().to_string();
        let list = e.split_once("the keys are ").unwrap().1.split_once(" (see").unwrap().0;
        list.split(", ").map(String::from).collect()
    }

    #[test]
    fn every_key_round_trips() {
        let f = full();
        let text = toml::to_string(&f).unwrap();
        assert_eq!(keys().len(), 29, "{:?}", keys());
        for key in keys() {
            assert!(text.lines().any(|l| l.starts_with(&format!("{key} = "))), "{key} missing from:\n{text}");
        }
        assert_eq!(parse(&text).unwrap(), f);
        assert_eq!(toml::to_string(&ServeSettings::default()).unwrap(), "", "absent keys are left out");
        assert_eq!(parse("").unwrap(), ServeSettings::default());
    }

    #[test]
    fn the_shipped_file_parses_and_names_no_model() {
        let text = include_str!("../../../packaging/sluice.toml");
        let f = parse(text).unwrap();
        assert_eq!(f.model, None, "the package enables nothing until a model is set");
        let e = f.require_model(Path::new("/etc/sluice/sluice.toml")).unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: no `model` key"), "{e}");
        // Each commented key, uncommented, is one the file takes.
        for line in text.lines().filter_map(|l| l.strip_prefix("#")) {
            let Some((key, _)) = line.trim().split_once(" = ") else { continue };
            assert!(keys().iter().any(|k| k == key), "commented key {key} is not a key");
            parse(line.trim()).unwrap_or_else(|e| panic!("{line}: {e}"));
        }
    }

    #[test]
    fn a_flag_overrides_its_key_and_a_key_fills_a_missing_flag() {
        let flags = ServeSettings { ctx: Some(512), rpc: Some(vec!["a:1".into()]), ..ServeSettings::default() };
        let merged = flags.over(full());
        assert_eq!((merged.ctx, merged.rpc), (Some(512), Some(vec!["a:1".to_string()])));
        assert_eq!(ServeSettings { ctx: full().ctx, rpc: full().rpc, ..merged }, full());
        assert_eq!(ServeSettings::default().over(ServeSettings::default()), ServeSettings::default());
    }

    #[test]
    fn a_bad_key_a_wrong_type_and_a_bad_value_name_the_file_and_key() {
        let e = parse("model = \"/m.gguf\"\nmodle = \"/m.gguf\"\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `modle`: unknown key; the keys are model,"), "{e}");
        let e = parse("model = \"/m.gguf\"\nctx = \"big\"\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `ctx`: invalid type: string \"big\""), "{e}");
        let e = parse("listen = \"localhost\"\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `listen`: invalid socket address"), "{e}");
        let e = parse("rpc = [\"a:1\", 2]\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `rpc[1]`: invalid type: integer"), "{e}");
        let e = parse("slots = 0\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `slots`: 1 to 64"), "{e}");
        let e = parse("slots = 65\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `slots`: 1 to 64"), "{e}");
        let e = parse("batch = 0\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `batch`: 1 to 8192"), "{e}");
        let e = parse("slot_save_mib = -1\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `slot_save_mib`:"), "{e}");
        let e = parse("cache_type_v = \"q9_0\"\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `cache_type_v`: unknown variant `q9_0`"), "{e}");
        let e = parse("ctx = 8\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `ctx`: at least 16"), "{e}");
        let e = parse("model = \"/m.gguf\"\nctx = \n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: not valid TOML: line 2 (`ctx`):"), "{e}");
    }
}
