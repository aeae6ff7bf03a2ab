//! `sluice worker`: a board that lends its memory and cores to a head over ggml's RPC backend.
//! ggml's RPC server runs over this board's CPU with the profile's compute cores and threads,
//! refuses any buffer beyond the memory budget (and reports the budget as its memory, so the
//! head plans within it), and keeps the weights it was sent in a tensor cache on disk, so a
//! restarted worker takes them from there instead of the network (within a byte bound, each
//! file checked against its hash). Every command is checked before use (vendor patch 0009), and
//! who may connect is [`Admission`]'s: the `--allow` list and the pre-shared key.

use std::io::Write as _;
use std::net::SocketAddrV4;
use std::path::PathBuf;

use super::link::{Admission, LinkKey};
use crate::board::resolve::Sourced;
use crate::budget::OVERHEAD_BYTES;
use crate::systemd::notify;
use crate::units::mib;
use sluice_hal::usage::Usage;

/// How a worker serves.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The IPv4 address and port to listen on.
    pub listen: SocketAddrV4,
    /// ggml's tensor cache (weights the head sent before); `None`: none.
    pub cache_dir: Option<PathBuf>,
    /// Compute threads and the cores they run on.
    pub threads: ggml_sys::Threads,
    /// The memory budget.
    pub budget: Sourced<u64>,
    /// The heads' addresses that may connect (empty: any).
    pub allow: Vec<std::net::IpAddr>,
    /// The key a head must prove (`None`: none).
    pub key: Option<LinkKey>,
    /// Bytes the tensor cache may hold on disk.
    pub cache_max_bytes: u64,
}

/// Buffers one head may hold at once (a model's weights, KV cache and compute buffers take a
/// few dozen).
const MAX_BUFFERS: usize = 1024;

/// Why a worker cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The budget leaves nothing to lend.
    #[error("the memory budget of {budget_mib:.1} MiB ({from}) leaves nothing to lend beside this process's {own_mib:.1} MiB; raise memory.budget_mib in the board profile")]
    NoRoom {
        /// The budget.
        budget_mib: f64,
        /// Where it comes from.
        from: String,
        /// What the process holds itself.
        own_mib: f64,
    },
    /// The tensor cache directory cannot be used.
    #[error("--cache-dir {path}: {source}")]
    CacheDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The compute cores cannot be pinned.
    #[error("cannot pin the worker to its compute cores: {0}")]
    Pin(#[from] sluice_hal::cpu::CpuError),
    /// ggml's RPC server could not start.
    #[error(transparent)]
    Serve(#[from] ggml_sys::Error),
}

/// What this process holds itself: its resident memory and llama.cpp's structures.
fn own_memory() -> u64 {
    let u = Usage::sample();
    u.rss() + OVERHEAD_BYTES
}

/// The tensor cache directory when `--cache-dir` is not given: systemd's `$CACHE_DIRECTORY`
/// (`CacheDirectory=`), else `rpc` in sluice's cache directory ([`crate::dirs::cache_dir`]).
pub fn default_cache_dir() -> PathBuf {
    match std::env::var_os("CACHE_DIRECTORY") {
        // systemd lists several directories separated by ':' when the unit names several.
        Some(d) => PathBuf::from(d.to_string_lossy().split(':').next().unwrap_or_default()),
        None => crate::dirs::cache_dir().join("rpc"),
    }
}

/// Serves until the process is stopped. Returns only on an error.
pub fn run(cfg: &WorkerConfig) -> Result<std::convert::Infallible, WorkerError> {
    if let Some(dir) = &cfg.cache_dir {
        std::fs::create_dir_all(dir).map_err(|source| WorkerError::CacheDir { path: dir.clone(), source })?;
    }
    // The RPC server's compute threads are created by this thread and inherit its affinity.
    sluice_hal::cpu::pin_current_thread(&cfg.threads.cpus)?;
    // What it lends: the budget less what it holds itself.
    let own = own_memory();
    let lend = cfg.budget.value.saturating_sub(own);
    if lend == 0 {
        return Err(WorkerError::NoRoom {
            budget_mib: mib(cfg.budget.value),
            from: cfg.budget.source.clone(),
            own_mib: mib(own),
        });
    }
    if cfg.key.is_none() && cfg.allow.is_empty() {
        log::warn!(
            "no --key-file and no --allow: anyone who reaches {} can use this board; give the head's address with --allow and a key with --key-file",
            cfg.listen
        );
    }
    if cfg.listen.ip().is_unspecified() {
        log::warn!("listening on every interface ({}): listen on the private link's address instead.", cfg.listen);
    }
    let status = format!(
        "serving RPC at {}: lending {:.1} MiB of the {:.1} MiB budget ({}), {} threads on cores {}, tensor cache {}, heads {}{}",
        cfg.listen,
        mib(lend),
        mib(cfg.budget.value),
        cfg.budget.source,
        cfg.threads.count,
        sluice_hal::cpulist::format(&cfg.threads.cpus),
        cfg.cache_dir.as_ref().map_or("off".to_string(), |d| d.display().to_string()),
        if cfg.allow.is_empty() {
            "from anywhere".to_string()
        } else {
            cfg.allow.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        },
        if cfg.key.is_some() { " with the key" } else { "" }
    );
    let admission = Admission { allow: cfg.allow.clone(), key: cfg.key.clone() };
    let opts = ggml_sys::RpcServeOptions {
        max_alloc: lend,
        max_buffers: MAX_BUFFERS,
        cache_max_bytes: cfg.cache_max_bytes,
        // a graph's bookkeeping is part of the worker's own overhead, not of what it lends
        max_graph: OVERHEAD_BYTES,
        on_accept: Box::new(move |stream| admission.admit(stream)),
        on_listening: Box::new(|| {
            log::info!("{status}");
            // (never a panic: a worker started with a full or closed standard error still serves)
            let _ = writeln!(std::io::stderr(), "sluice worker: {status}");
            notify::ready(&status);
        }),
    };
    ggml_sys::rpc_serve(&cfg.listen.to_string(), cfg.cache_dir.as_deref(), cfg.threads.count as usize, opts)
        .map_err(WorkerError::Serve)
}
