//! Where sluice keeps its files.

use std::path::PathBuf;

/// Where sluice keeps its caches (generated models; a worker's tensor cache in `rpc/`):
/// `$SLUICE_CACHE_DIR`, else `$XDG_CACHE_HOME/sluice`, else `$HOME/.cache/sluice`, else a
/// `sluice-cache` directory under the system temp directory.
pub fn cache_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("SLUICE_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("sluice")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("sluice")))
        .unwrap_or_else(|| std::env::temp_dir().join("sluice-cache"))
}
