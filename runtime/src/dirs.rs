//! Where sluice keeps its files.

use std::path::PathBuf;

/// Where sluice keeps its caches (generated models; a worker's tensor cache in `rpc/`):
/// `$SLUICE_CACHE_DIR`, else `$XDG_CACHE_HOME/sluice`, else `$HOME/.cache/sluice`, else a
/// `sluice-cache` directory under the system temp directory.
pub fn cache_dir() -> PathBuf {
    env_path("SLUICE_CACHE_DIR")
        .or_else(|| env_path("XDG_CACHE_HOME").map(|p| p.join("sluice")))
        .or_else(|| env_path("HOME").map(|p| p.join(".cache").join("sluice")))
        .unwrap_or_else(|| std::env::temp_dir().join("sluice-cache"))
}

/// The path environment variable `key` holds, when it is set and not empty.
pub fn env_path(key: &str) -> Option<PathBuf> {
    std::env::var_os(key).filter(|v| !v.is_empty()).map(PathBuf::from)
}
