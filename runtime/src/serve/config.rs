//! The settings file of `sluice serve` (`/etc/sluice/sluice.toml` in the Debian package): the
//! model, the board, the address, the context, the cache, the API key and the rest of what a
//! board owner sets once. Flags given on the command line override it. Unknown keys and values
//! of the wrong type are errors that name the file and the key, as with board profiles.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where `sluice serve` looks for its settings when `--config` is not given.
pub const DEFAULT_PATH: &str = "/etc/sluice/sluice.toml";

/// The keys of the settings file; every one is optional (the model must come from here or from
/// `--model`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFile {
    /// The model: a .gguf file (for a split model, its first file).
    pub model: Option<PathBuf>,
    /// The board profile: `auto`, a built-in id, or a profile file.
    pub board: Option<String>,
    /// The HTTP address.
    pub listen: Option<SocketAddr>,
    /// Context positions per request.
    pub ctx: Option<u32>,
    /// Expert cache size in MiB (0: no cache; absent: what the budget leaves).
    pub cache_mb: Option<u64>,
    /// A file holding the API key.
    pub api_key_file: Option<PathBuf>,
    /// The model name clients give.
    pub model_id: Option<String>,
    /// Generation requests that may wait while one runs.
    pub queue: Option<usize>,
    /// RPC workers, `host:port` in layer order.
    pub rpc: Option<Vec<String>>,
    /// The pre-shared key file the workers were started with.
    pub rpc_key_file: Option<PathBuf>,
    /// With an API key, require it for `/metrics` too.
    pub metrics_need_key: Option<bool>,
    /// Browser origins allowed by CORS.
    pub cors_origins: Option<Vec<String>>,
}

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

impl ServeFile {
    /// Reads and checks the settings file at `path`.
    pub fn load(path: &Path) -> Result<ServeFile, ConfigError> {
        let text = sluice_hal::file::read_regular_string(path, MAX_FILE_BYTES)
            .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        ServeFile::parse(&text, path)
    }

    /// Parses and checks the text of the settings file `path`.
    pub fn parse(text: &str, path: &Path) -> Result<ServeFile, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            message: crate::text::toml_error(text, &e),
        })?;
        let file: ServeFile = serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let path_in = e.path().to_string();
            let message = crate::text::excerpt(e.into_inner().message(), crate::text::MAX_QUOTED);
            // serde names an unknown key in its message, at the table that holds it.
            let unknown = message.strip_prefix("unknown field `").and_then(|r| r.split('`').next());
            let (key, message) = match unknown {
                Some(k) => (
                    k.to_string(),
                    format!(
                        "unknown key; the keys are {} (see the commented file the package installs)",
                        KEYS.join(", ")
                    ),
                ),
                None => (path_in, message),
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
        if self.ctx.is_some_and(|c| c < 16) {
            return bad("ctx", "at least 16 positions; remove the key for 4096 (or the model's length if shorter)");
        }
        if self.model.as_ref().is_some_and(|m| m.as_os_str().is_empty()) {
            return bad("model", "empty; give the model's path");
        }
        if self.board.as_ref().is_some_and(String::is_empty) {
            return bad("board", "empty; give auto, a built-in id (`sluice boards`) or a profile file");
        }
        if self.queue == Some(0) {
            return bad("queue", "0 would refuse every request while one runs; use 1 or more");
        }
        Ok(())
    }

    /// The model, or the error that names this file (`path`) and the key to set.
    pub fn require_model(&self, path: &Path) -> Result<&Path, ConfigError> {
        self.model.as_deref().ok_or_else(|| ConfigError::NoModel { path: path.to_path_buf() })
    }
}

/// The keys, in the order the struct declares them.
const KEYS: [&str; 12] = [
    "model",
    "board",
    "listen",
    "ctx",
    "cache_mb",
    "api_key_file",
    "model_id",
    "queue",
    "rpc",
    "rpc_key_file",
    "metrics_need_key",
    "cors_origins",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> ServeFile {
        ServeFile {
            model: Some("/srv/models/model.gguf".into()),
            board: Some("rpi5-8gb".into()),
            listen: Some("0.0.0.0:8080".parse().unwrap()),
            ctx: Some(2048),
            cache_mb: Some(512),
            api_key_file: Some("/etc/sluice/api-key".into()),
            model_id: Some("qwen3".into()),
            queue: Some(4),
            rpc: Some(vec!["10.0.0.2:50052".into(), "10.0.0.3:50052".into()]),
            rpc_key_file: Some("/etc/sluice/rpc.key".into()),
            metrics_need_key: Some(true),
            cors_origins: Some(vec!["https://example.org".into()]),
        }
    }

    fn parse(text: &str) -> Result<ServeFile, ConfigError> {
        ServeFile::parse(text, Path::new("/etc/sluice/sluice.toml"))
    }

    #[test]
    fn every_key_round_trips() {
        let f = full();
        let text = toml::to_string(&f).unwrap();
        for key in KEYS {
            assert!(text.lines().any(|l| l.starts_with(&format!("{key} = "))), "{key} missing from:\n{text}");
        }
        assert_eq!(parse(&text).unwrap(), f);
        assert_eq!(toml::to_string(&ServeFile::default()).unwrap(), "", "absent keys are left out");
        assert_eq!(parse("").unwrap(), ServeFile::default());
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
            assert!(KEYS.contains(&key), "commented key {key} is not a key");
            parse(line.trim()).unwrap_or_else(|e| panic!("{line}: {e}"));
        }
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
        let e = parse("ctx = 8\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: key `ctx`: at least 16"), "{e}");
        let e = parse("model = \"/m.gguf\"\nctx = \n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/sluice/sluice.toml: not valid TOML: line 2 (`ctx`):"), "{e}");
    }
}
