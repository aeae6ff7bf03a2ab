//! Scale-out: several boards serve one model over ggml's RPC backend.
//!
//! A worker board runs `sluice worker` ([`worker`]): ggml's RPC server over its CPU, pinned to
//! its profile's compute cores, refusing buffers beyond its memory budget. The head
//! (`--rpc HOST:PORT,...` on `run`, `serve`, `plan`) connects to the workers ([`connect`]),
//! asks each for its free memory, and [`split::plan_split`] gives them whole layers at the end
//! of the model, resident there (dense weights and experts); the head keeps the first layers and
//! streams their experts under its own budget.

pub mod link;
pub mod split;
pub mod worker;

use ggml_sys::RpcDevice;

use crate::units::mib;

pub use split::{plan_split, Share, Split};

/// Why scale-out cannot go ahead.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// An endpoint of `--rpc` is malformed.
    #[error("--rpc {given:?}: {why}; give HOST:PORT[,HOST:PORT...], e.g. --rpc 192.168.1.21:50052,192.168.1.22:50052")]
    Endpoint {
        /// The endpoint as given.
        given: String,
        /// What is wrong with it.
        why: String,
    },
    /// A worker cannot be used.
    #[error(transparent)]
    Worker(#[from] ggml_sys::Error),
    /// The last worker cannot even hold the output layer beside its compute buffers.
    #[error("the RPC worker at {endpoint} has {free_mib:.1} MiB free, less than the {need_mib:.1} MiB of the output layer and its compute buffers it would hold as the last worker; list a worker with more memory last in --rpc, or raise its budget (its board profile's memory.budget_mib)")]
    NoRoomForOutput {
        /// The last worker.
        endpoint: String,
        /// What it reports free.
        free_mib: f64,
        /// What it would need.
        need_mib: f64,
    },
    /// The model could not be sized.
    #[error(transparent)]
    Budget(#[from] crate::budget::BudgetError),
    /// The head's profile offloads layers to its GPU, which a split does not combine with.
    #[error("--rpc with the cuda compute service: the workers take the model's last layers, which the GPU offload would take too; use a cpu profile on the head (compute.service = \"cpu\"), or no --rpc")]
    WithGpu,
}

/// A worker this head is connected to, with the memory it reported.
#[derive(Debug, Clone)]
pub struct Worker {
    /// Its RPC device.
    pub device: RpcDevice,
    /// Bytes it can still allocate (a sluice worker: its budget less what it holds).
    pub free: u64,
    /// Its memory (a sluice worker: its budget).
    pub total: u64,
}

/// Splits and checks `--rpc`'s list: `HOST:PORT` entries with a port in 1..=65535, each once.
pub fn parse_endpoints(list: &[String]) -> Result<Vec<String>, ScaleError> {
    let mut out: Vec<String> = Vec::new();
    for given in list.iter().flat_map(|s| s.split(',')).map(str::trim) {
        let bad = |why: &str| ScaleError::Endpoint { given: given.to_string(), why: why.to_string() };
        let (host, port) = given.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
        if host.is_empty() || host.contains(':') {
            return Err(bad("the host must be an IPv4 address or a name (ggml's RPC client speaks IPv4)"));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err(bad("the port must be a number from 1 to 65535")),
        }
        if out.iter().any(|e| e == given) {
            return Err(bad("listed twice"));
        }
        out.push(given.to_string());
    }
    if out.len() > ggml_sys::MAX_RPC_SERVERS {
        return Err(ScaleError::Endpoint {
            given: list.join(","),
            why: format!("at most {} workers", ggml_sys::MAX_RPC_SERVERS),
        });
    }
    Ok(out)
}

/// Connects to every endpoint and asks each for its memory.
pub fn connect(endpoints: &[String]) -> Result<Vec<Worker>, ScaleError> {
    endpoints
        .iter()
        .map(|e| {
            let device = RpcDevice::connect(e).map_err(|err| match err {
                // A worker with a key speaks first; a head without one cannot tell that from a
                // worker that is not there, so it asks.
                ggml_sys::Error::RpcConnect { .. } if link::asks_for_key(e) => {
                    ScaleError::from(ggml_sys::Error::RpcRefused {
                        endpoint: e.clone(),
                        reason: "the worker asks for a key and this head has none: give the head the worker's key file with --rpc-key-file".into(),
                    })
                }
                err => err.into(),
            })?;
            let (free, total) = device.memory()?;
            log::info!("RPC worker {e}: {:.1} MiB free of {:.1} MiB", mib(free), mib(total));
            Ok(Worker { device, free, total })
        })
        .collect()
}

/// Scale-out for a run of context `shape` over `model`, when `endpoints` (`--rpc`) lists
/// workers: connects to them, splits the model, and narrows `index` to this board's layers; the
/// caller loads with [`Split::rpc`]. A head whose compute service offloads layers to its GPU
/// (`gpu`) is refused before any worker is asked. Without workers: no split, `index` unchanged.
pub fn prepare(
    endpoints: &[String],
    model: &std::path::Path,
    index: crate::stream::ExpertIndex,
    shape: crate::generate::ContextShape,
    gpu: bool,
) -> Result<(Option<Split>, crate::stream::ExpertIndex), ScaleError> {
    let endpoints = parse_endpoints(endpoints)?;
    if endpoints.is_empty() {
        return Ok((None, index));
    }
    if gpu {
        return Err(ScaleError::WithGpu);
    }
    let workers = connect(&endpoints)?;
    let split = plan_split(model, &index, shape, &workers)?;
    let index = index.keep_layers_below(split.first_remote);
    Ok((Some(split), index))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Vec<String>, String> {
        parse_endpoints(&[s.to_string()]).map_err(|e| e.to_string())
    }

    #[test]
    fn endpoints_are_host_port_pairs_each_once() {
        assert_eq!(parse("10.0.0.2:50052,pi2.lan:1").unwrap(), ["10.0.0.2:50052", "pi2.lan:1"]);
        assert!(parse("10.0.0.2").unwrap_err().contains("no :PORT"));
        assert!(parse("10.0.0.2:0").unwrap_err().contains("from 1 to 65535"));
        assert!(parse("10.0.0.2:x").unwrap_err().contains("from 1 to 65535"));
        assert!(parse("[::1]:5").unwrap_err().contains("IPv4"));
        assert!(parse(":5").unwrap_err().contains("IPv4"));
        assert!(parse("a:1,a:1").unwrap_err().contains("listed twice"));
    }
}
