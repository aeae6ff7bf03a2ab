//! `sluice serve` (the HTTP service) and `sluice unit` (its systemd drop-in).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::board::{self, BoardChoice};
use sluice::budget::Batch;
use sluice::launch::{Cache, Launch, Positions};
use sluice::serve::access::{Access, KeySources};
use sluice::serve::config::{self, ServeSettings, DEFAULT_SLOT_SAVE_MIB};
use sluice::serve::engine::EngineConfig;
use sluice::serve::http::HttpLimits;
use sluice::serve::{self, ServeConfig};
use sluice::stream::DensePolicy;
use sluice::systemd::unit::{self, UnitRequest, UnitRole};
use sluice_hal::root::SysRoot;

use super::args::{self, LossyArgs, RpcArgs, TuningArgs};

/// The HTTP address when neither `--listen` nor the settings file gives one.
const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 8080);
/// Generation requests that may wait, when neither `--queue` nor the settings file says.
const DEFAULT_QUEUE: usize = 8;

/// `sluice serve` arguments.
#[derive(Args)]
pub struct ServeArgs {
    /// The settings file (default: /etc/sluice/sluice.toml when it exists); these flags
    /// override its keys.
    #[arg(long, conflicts_with = "no_config")]
    config: Option<PathBuf>,
    /// Read no settings file, not even /etc/sluice/sluice.toml.
    #[arg(long)]
    no_config: bool,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30)]
    drain_secs: u64,
    /// Where the expert heat map and the saved slots are kept for warm restarts (default:
    /// $STATE_DIRECTORY, which systemd's StateDirectory= sets; without either, no warm restarts).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Seconds between saves of the heat map and the changed slots while serving (both are saved
    /// at shutdown too, and the slots when the server is idle).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    save_secs: u64,
    /// Accept a cache smaller than one token's routed experts.
    #[arg(long)]
    force_cache: bool,
    /// Where dense weights live.
    #[arg(long, value_enum, default_value_t = DensePolicy::Anon)]
    dense: DensePolicy,
    #[command(flatten)]
    lossy: LossyArgs,
    /// Largest request body in KiB (larger: 413).
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_body_kib: u64,
    /// Largest request head (request line and headers) in KiB (larger: 431).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_header_kib: u64,
    /// Connections open at once (also capped by the open-file limit); at the cap the least
    /// recently active idle connection is closed, and when none is idle the new one gets 503.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_connections: u64,
    /// Seconds a request head may take to arrive, and an idle keep-alive connection stays open.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    header_timeout_secs: u64,
    /// Seconds a request body may take to arrive, and a client may leave its response unread.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_secs: u64,
    /// Require this API key as `Authorization: Bearer KEY` (visible to local users in the
    /// process list: prefer SLUICE_API_KEY, --api-key-file, or a systemd credential named
    /// `api-key`, which is read from $CREDENTIALS_DIRECTORY, else from the state directory).
    #[arg(long, env = "SLUICE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(flatten)]
    settings: ServeSettings,
}

/// The settings file `serve` reads: `--config`, else the default one when it exists; none with
/// `--no-config`.
fn settings(a: &ServeArgs) -> Result<Option<(PathBuf, ServeSettings)>> {
    let path = match &a.config {
        Some(p) => p.clone(),
        None if a.no_config => return Ok(None),
        None => {
            let p = PathBuf::from(config::DEFAULT_PATH);
            if !p.exists() {
                return Ok(None);
            }
            p
        }
    };
    let file = ServeSettings::load(&path)?;
    log::info!("settings from {}", path.display());
    Ok(Some((path, file)))
}

/// The tuning flags with the settings file's KV cache types where no flag gives them.
fn tuning_with(tuning: &TuningArgs, set: &ServeSettings) -> TuningArgs {
    TuningArgs {
        cache_type_k: tuning.cache_type_k.or(set.cache_type_k),
        cache_type_v: tuning.cache_type_v.or(set.cache_type_v),
        ..tuning.clone()
    }
}

/// Runs `sluice serve`: the flags, over the settings file's keys, over the defaults. `choice` is
/// `--board` when given.
pub fn run_serve(a: &ServeArgs, choice: Option<&BoardChoice>) -> Result<()> {
    let (file_path, file) = match settings(a)? {
        Some((path, file)) => (Some(path), file),
        None => (None, ServeSettings::default()),
    };
    let set = a.settings.clone().over(file);
    let store = sluice::store::Store::new(set.hf_cache.clone(), set.ollama_models.clone());
    let (model, named) = model_of(&set, file_path.as_deref(), &store)?;
    let board_choice = match (choice, &set.board) {
        (Some(c), _) => c.clone(),
        (None, Some(b)) => b.parse().unwrap_or_else(|never| match never {}),
        (None, None) => BoardChoice::Auto,
    };
    let rpc = set.rpc.clone().unwrap_or_default();
    args::configure_link(&rpc, set.rpc_key_file.as_deref(), set.rpc_call_timeout)?;
    let cors_origins = set.cors_origins.clone().unwrap_or_default();

    sluice::metadata::check_model_file(&model)?;
    let board = args::board(&board_choice, Some(&model), &tuning_with(&a.tuning, &set))?;
    let state_dir = a.state_dir.clone().or_else(|| std::env::var_os("STATE_DIRECTORY").map(PathBuf::from));
    if let Some(dir) = &state_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("state directory {}", dir.display()))?;
    }
    let model_id = set.model_id.clone().or(named).unwrap_or_else(|| {
        let name = model.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        name.strip_suffix(".gguf").unwrap_or(&name).to_string()
    });
    let engine = EngineConfig {
        launch: Launch {
            model: model.clone(),
            board,
            positions: set.ctx.map_or(Positions::Planned, Positions::Fixed),
            slots: set.slots.unwrap_or(1),
            batch: Batch::Fixed(set.batch.unwrap_or(sluice::generate::DEFAULT_BATCH)),
            cache: Cache::from_mib(set.cache_mb),
            force_cache: a.force_cache,
            dense: a.dense,
            lossy: a.lossy.lossy(),
            rpc,
            kept_bytes: sluice::serve::stored::MAX_BYTES as u64,
        },
        state_dir: state_dir.clone(),
        save_every: Duration::from_secs(a.save_secs),
        reuse: set.reuse.unwrap_or_default(),
        slot_save_bytes: set.slot_save_mib.unwrap_or(DEFAULT_SLOT_SAVE_MIB).saturating_mul(1 << 20),
    };
    let keys = KeySources {
        key: a.api_key.clone(),
        file: set.api_key_file.clone(),
        named: set.api_keys_file.clone(),
        credentials_dir: std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from),
        state_dir,
    };
    let allowed_hosts = set.allowed_hosts.clone().unwrap_or_default();
    let access = Access::new(&keys, set.metrics_need_key == Some(true), &cors_origins, &allowed_hosts)?;
    let limits = HttpLimits {
        max_connections: a.max_connections as usize,
        header_bytes: a.max_header_kib as usize * 1024,
        body_bytes: a.max_body_kib as usize * 1024,
        header_timeout: Duration::from_secs(a.header_timeout_secs),
        idle_timeout: Duration::from_secs(a.idle_timeout_secs),
    };
    serve::serve(ServeConfig {
        engine,
        listen: set.listen.unwrap_or(DEFAULT_LISTEN),
        ollama_listen: set.ollama_listen,
        queue: set.queue.map_or(DEFAULT_QUEUE, |q| q as usize),
        drain: Duration::from_secs(a.drain_secs),
        model_id,
        limits,
        access,
        shelf: shelf_config(&set, store),
    })
    .with_context(|| format!("serving {}", model.display()))
}

/// The model file the settings name (a path, or a stored model's name), and the name it is
/// listed under when it was given by name.
fn model_of(
    set: &ServeSettings,
    file_path: Option<&Path>,
    store: &sluice::store::Store,
) -> Result<(PathBuf, Option<String>)> {
    let model = match (&set.model, file_path) {
        (Some(m), _) => m.clone(),
        (None, Some(path)) => set.require_model(path)?.to_path_buf(),
        (None, None) => anyhow::bail!(
            "no model: give --model FILE.gguf (or a stored model's name), or set model = \"/path/to/model.gguf\" in {} (or a file given with --config)",
            config::DEFAULT_PATH
        ),
    };
    let resolved = store.resolve(&model)?;
    let named = (resolved != model)
        .then(|| sluice::store::ModelName::parse(&model.to_string_lossy()).ok().and_then(|n| store.find(&n)))
        .flatten()
        .map(|m| sluice::serve::shelf::listed_name(&m));
    Ok((resolved, named))
}

/// What the server may do with the store: pull from the hosts the settings name (unless
/// `pull = false`), up to `max_model_mb`, and switch models (unless `switch_models = false`).
fn shelf_config(set: &ServeSettings, store: sluice::store::Store) -> sluice::serve::shelf::ShelfConfig {
    let mut pull = sluice::pull::PullSettings::default();
    if let Some(e) = &set.hf_endpoint {
        pull.hf_endpoint = e.clone();
    }
    if let Some(r) = &set.ollama_registry {
        pull.ollama_registry = r.clone();
    }
    pull.max_model_bytes = set.max_model_mb.map(|m| m.saturating_mul(1 << 20));
    sluice::serve::shelf::ShelfConfig {
        store,
        pull: (set.pull != Some(false)).then_some(pull),
        switch: set.switch_models != Some(false),
    }
}

/// `sluice unit` arguments.
#[derive(Args)]
pub struct UnitArgs {
    /// The model the service serves (absolute path on the board).
    #[arg(short, long, required_unless_present = "worker")]
    model: Option<PathBuf>,
    /// Address the service listens on (default for `serve`: 127.0.0.1:8080; a worker needs its
    /// address on the private link to the head).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Where the sluice binary is installed on the board.
    #[arg(long, default_value = "/usr/local/bin/sluice")]
    exe: PathBuf,
    /// A file on the board (absolute path, readable by root) holding the API key: passed to
    /// the service as the systemd credential `api-key` (LoadCredential=).
    #[arg(long, conflicts_with = "worker")]
    api_key_file: Option<PathBuf>,
    #[command(flatten)]
    rpc: RpcArgs,
    /// The drop-in of `sluice-worker.service` (an RPC worker board) instead of `sluice.service`.
    #[arg(long, requires = "head", conflicts_with_all = ["model", "rpc"])]
    worker: bool,
    /// With --worker: the head's IP address, the only one the worker admits (IPAddressAllow=).
    #[arg(long)]
    head: Option<IpAddr>,
}

/// Runs `sluice unit`: prints the drop-in for the chosen board.
pub fn run_unit(a: &UnitArgs, choice: &BoardChoice) -> Result<()> {
    let root = SysRoot::default();
    let identity = sluice_hal::board::BoardIdentity::probe(&root);
    let selected = board::select(choice, &identity)?;
    let (role, listen) = match (&a.model, a.head) {
        (_, Some(head)) if a.worker => {
            let Some(listen @ SocketAddr::V4(_)) = a.listen else {
                anyhow::bail!(
                    "--worker needs --listen IPV4:PORT: this board's address on the private link to the head"
                );
            };
            (UnitRole::Worker { head }, listen)
        }
        (Some(model), _) => {
            let endpoints = sluice::scaleout::parse_endpoints(&a.rpc.rpc)?;
            let rpc = endpoints
                .into_iter()
                .map(|e| {
                    let host = e.rsplit_once(':').map_or(e.as_str(), |(h, _)| h);
                    match host.parse::<IpAddr>() {
                        Ok(ip) => Ok((e.clone(), ip)),
                        Err(_) => Err(anyhow::anyhow!(
                            "--rpc {e}: the unit admits workers by IP address (IPAddressAllow=); give the worker's IP instead of {host}"
                        )),
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let listen = a.listen.unwrap_or(DEFAULT_LISTEN);
            (UnitRole::Serve { model, api_key_file: a.api_key_file.as_deref(), rpc }, listen)
        }
        _ => anyhow::bail!("give --model (the serve unit), or --worker with --head (a worker's unit)"),
    };
    let text =
        unit::drop_in(&UnitRequest { board: &selected, role, listen, exe: &a.exe, mem_total: identity.mem_total })?;
    out!("{text}");
    Ok(())
}
