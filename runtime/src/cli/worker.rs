//! `sluice worker`: lend this board's memory and cores to a head over ggml's RPC backend.

use std::net::SocketAddrV4;
use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::board::BoardChoice;
use sluice::scaleout::link::LinkKey;
use sluice::scaleout::worker::{self, WorkerConfig};

use super::args::{self, TuningArgs};

/// `sluice worker` arguments.
#[derive(Args)]
pub struct WorkerArgs {
    /// This board's IPv4 address and port on the private link to the head: never a public
    /// interface (systemd's unit admits only the head).
    #[arg(long, value_name = "IPV4:PORT")]
    listen: SocketAddrV4,
    /// The heads' IP addresses that may connect (others are closed at once); default: any.
    #[arg(long, value_name = "IP,...", value_delimiter = ',')]
    allow: Vec<std::net::IpAddr>,
    /// A file holding a pre-shared key (at least 16 bytes) the head must prove before any
    /// command, and the worker proves back; give the head the same file with --rpc-key-file.
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    /// The most the tensor cache keeps on disk, in MiB (the oldest files go first).
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    cache_max_mib: u64,
    /// ggml's tensor cache: weights the head sent before are read from here after a restart
    /// instead of the network (default: $CACHE_DIRECTORY, which systemd's CacheDirectory= sets,
    /// else rpc in sluice's cache directory: $SLUICE_CACHE_DIR, else ~/.cache/sluice).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// No tensor cache: every load sends the weights over the network.
    #[arg(long, conflicts_with = "cache_dir")]
    no_cache: bool,
    /// Compute threads (default: one per compute core of the board profile).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,
    /// A cgroup directory to join first (`sluice bench --rpc` gives each worker the memory of
    /// a board this way).
    #[arg(long, hide = true)]
    join_cgroup: Option<PathBuf>,
}

/// Runs `sluice worker` until it is stopped.
pub fn run_worker(a: &WorkerArgs, choice: &BoardChoice) -> Result<()> {
    if let Some(dir) = &a.join_cgroup {
        sluice_hal::cgroup::join(dir).with_context(|| format!("joining {}", dir.display()))?;
    }
    let board = args::board(choice, None, &TuningArgs { threads: a.threads, ..Default::default() })?;
    let cache_dir = if a.no_cache { None } else { Some(a.cache_dir.clone().unwrap_or_else(worker::default_cache_dir)) };
    let key = a.key_file.as_deref().map(LinkKey::from_file).transpose()?;
    let cfg = WorkerConfig {
        listen: a.listen,
        cache_dir,
        threads: board.threads(),
        budget: board.budget.clone(),
        allow: a.allow.clone(),
        key,
        cache_max_bytes: a.cache_max_mib << 20,
    };
    match worker::run(&cfg).with_context(|| format!("sluice worker at {}", a.listen))? {}
}
