//! Argument groups shared by several commands, and turning them (with the board profile) into
//! engine configurations.

use std::path::{Path, PathBuf};

use std::ffi::OsString;

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use serde_json::Value;

use sluice::board::{self, BoardChoice, Overlap, Overrides, ResolvedBoard};
use sluice::budget::Batch;
use sluice::launch::{Cache, Launch, Positions};
use sluice::stream::DensePolicy;
use sluice_hal::root::SysRoot;

/// Values that override the board profile.
#[derive(Args, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TuningArgs {
    /// Compute threads (default: one per compute core of the board profile).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
    /// Parallel expert readers (default: the profile's, else chosen from the storage medium).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub io_lanes: Option<u32>,
    /// Largest single read in KiB (default: the profile's, else the storage device's maximum
    /// request size, queue/max_sectors_kb).
    #[arg(long, value_parser = clap::value_parser!(u64).range(4..=65536))]
    pub read_kib: Option<u64>,
    /// Read experts through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub no_direct_io: bool,
    /// Check every expert and dense read against the checksums `sluice verify --model MODEL` wrote
    /// beside the model (default: the profile's storage.verify): damaged bytes from failing
    /// storage are an error naming the expert, never wrong tokens. With `sluice bench
    /// --budget-mb`: adds verified rows.
    #[arg(long)]
    pub verify: bool,
    /// Overlap expert reads with expert compute in every decode (default: the profile's, else
    /// auto).
    #[arg(long, conflicts_with_all = ["no_overlap", "overlap_prompt", "overlap_auto"])]
    pub overlap: bool,
    /// Overlap expert reads with expert compute in prompt batches only; single-token decodes
    /// stream serially.
    #[arg(long, conflicts_with_all = ["no_overlap", "overlap_auto"])]
    pub overlap_prompt: bool,
    /// Overlap prompt batches, and single-token decodes while no other process keeps the run's
    /// cores busy (serially while one does).
    #[arg(long, conflicts_with = "no_overlap")]
    pub overlap_auto: bool,
    /// Stream serially: read a layer's experts, then compute it.
    #[arg(long)]
    pub no_overlap: bool,
    /// Draft tokens to verify in one batch: off, or ngram (tokens that followed the same words
    /// earlier in the text; greedy output is unchanged). Default: the profile's, else off.
    #[arg(long, value_enum)]
    pub draft: Option<sluice::board::Draft>,
    /// How the expert cache evicts: lru, or frequency (the most often routed stay, with
    /// ageing). Default: the profile's memory.cache_policy, else the runtime's default.
    #[arg(long, value_enum)]
    pub cache_policy: Option<sluice::stream::CachePolicy>,
    /// Read experts into fresh pages that each eviction gives back, instead of a pool of slots
    /// committed at open (default: the profile's memory.expert_slots, else on).
    #[arg(long)]
    pub no_expert_slots: bool,
    /// Guess each next layer's experts from this layer's router input and start their reads
    /// while this layer computes, in single-token decodes (default: the profile's
    /// storage.lookahead, else off: on a board model's shape it lost at every storage speed).
    #[arg(long, conflicts_with = "no_lookahead")]
    pub lookahead: bool,
    /// Read each layer's experts only once its router has chosen them.
    #[arg(long)]
    pub no_lookahead: bool,
    /// Pace expert and dense reads to a slower device of this many MB/s: each read waits until
    /// such a device, serving reads one after another, would have served it. For measuring a
    /// board's storage on faster storage; unlike `bench --storage-mbps` (a cgroup throttle),
    /// time spent computing earns no burst of faster reads after it.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub pace_mbps: Option<u32>,
    /// The KV cache's type for keys, as llama.cpp names them (default: the profile's
    /// memory.cache_type_k, else f16). q8_0 takes about half of f16's memory, which the expert
    /// cache gets; LOSSY: attention then computes with rounded keys (`sluice perplexity
    /// --cache-type-k q8_0` measures what it costs a model).
    #[arg(long, value_enum, value_name = "TYPE")]
    pub cache_type_k: Option<sluice::generate::KvCacheType>,
    /// The KV cache's type for values (default: the profile's memory.cache_type_v, else f16); a
    /// quantized one turns on llama.cpp's flash attention. LOSSY, as --cache-type-k.
    #[arg(long, value_enum, value_name = "TYPE")]
    pub cache_type_v: Option<sluice::generate::KvCacheType>,
}

impl TuningArgs {
    /// The overrides these arguments make.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            threads: self.threads,
            io_lanes: self.io_lanes,
            read_kib: self.read_kib,
            no_direct_io: self.no_direct_io,
            verify: self.verify,
            overlap: if self.overlap {
                Some(Overlap::On)
            } else if self.overlap_prompt {
                Some(Overlap::Prompt)
            } else if self.overlap_auto {
                Some(Overlap::Auto)
            } else if self.no_overlap {
                Some(Overlap::Off)
            } else {
                None
            },
            draft: self.draft,
            cache_policy: self.cache_policy,
            no_expert_slots: self.no_expert_slots,
            lookahead: if self.lookahead {
                Some(true)
            } else if self.no_lookahead {
                Some(false)
            } else {
                None
            },
            pace_mbps: self.pace_mbps,
            cache_type_k: self.cache_type_k,
            cache_type_v: self.cache_type_v,
        }
    }
}

/// Probes this machine, chooses the profile `choice` names, and applies `tuning`. `model` sizes
/// the reads to the storage it lives on.
pub fn board(choice: &BoardChoice, model: Option<&Path>, tuning: &TuningArgs) -> Result<ResolvedBoard> {
    let (_, resolved) = board::board_for(&SysRoot::default(), choice, model, &tuning.overrides())?;
    Ok(resolved)
}

/// Opt-in lossy modes: the output then differs from the model's exact output. Off unless given.
#[derive(Args, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LossyArgs {
    /// LOSSY: route each token to K experts instead of the model's count (fewer expert reads and
    /// products per token; the run summary, /metrics and `sluice bench` show the cost). On the
    /// trained KJV model (4 of 32 experts) 3 raise its held-out perplexity 1.009x (top-1 agreement
    /// 92.8%), 2 1.046x (86.0%), 1 1.212x (72.4%): `sluice perplexity --experts-used K` measures
    /// a model's own.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    pub experts_used: Option<u32>,
    /// LOSSY: when a token's chosen expert is not in the expert cache, run a cached expert the
    /// router ranked at most N places after the token's chosen ones instead. On the trained KJV
    /// model with a cache of a fifth of its experts, N = 1 raises the held-out perplexity 1.004x
    /// (top-1 agreement 96.2%), N = 4 1.192x (84.1%): `sluice perplexity --substitute N`
    /// measures a model's own.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub substitute: Option<u32>,
}

impl LossyArgs {
    /// The settings these arguments make.
    pub fn lossy(&self) -> sluice::lossy::Lossy {
        sluice::lossy::Lossy { experts_used: self.experts_used, substitute: self.substitute }
    }
}

/// The file name of `path` (empty for none), for reports and traces.
pub fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// Recorded routes forced on the model (`run`, `bench`): a measuring tool, never the model's
/// own text.
#[derive(Args, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RoutesArgs {
    /// MEASURING, LOSSY: replace every MoE layer's choice of experts, for every token the run
    /// computes, with the routes recorded in FILE, so the reads, the expert cache, overlap and
    /// the ledger run as they would on the model that made them (a model of the same shape:
    /// layers, experts, experts per token). FILE is read as `sluice replay --trace` reads it: a
    /// `sluice run --record-routes` file, sluice's own trace of single-token decodes,
    /// BigMoeOnEdge's *.route.csv, speculative-moe JSON lines or a folder of moe-beyond CSVs.
    /// The file's tokens go to the run's in order, the prompt's first. The text generated is
    /// not the model's own: this measures speed on a real model's routing (a synthetic model's
    /// router is random); `serve` has no such option.
    #[arg(long, value_name = "FILE")]
    pub routes: Option<PathBuf>,
    /// The format of --routes (default: told from the contents).
    #[arg(long, value_enum, value_name = "FORMAT", requires = "routes")]
    pub routes_format: Option<sluice::replay::formats::Format>,
    /// When the run needs more tokens than --routes has: stop (generate only as many as the
    /// routes have after the prompt; the default) or wrap (start them again).
    #[arg(long, value_enum, requires = "routes")]
    pub routes_end: Option<sluice::stream::RoutesEnd>,
}

impl RoutesArgs {
    /// The routes to force, read from `--routes`.
    pub fn load(&self) -> Result<Option<sluice::stream::routes::ForcedRoutes>> {
        let Some(path) = &self.routes else { return Ok(None) };
        let routes = sluice::replay::formats::read_tokens(path, self.routes_format)?;
        log::info!(
            "--routes {}: {} tokens of {} layers recorded from {}",
            path.display(),
            routes.tokens.len(),
            routes.n_layer,
            if routes.model.is_empty() { "an unnamed model" } else { &routes.model }
        );
        Ok(Some(sluice::stream::routes::ForcedRoutes {
            path: path.clone(),
            routes: std::sync::Arc::new(routes),
            end: self.routes_end.unwrap_or_default(),
        }))
    }
}

/// How a streamed run is configured beyond the board.
#[derive(Args)]
pub struct StreamArgs {
    /// Load every weight into memory with llama.cpp's own loader, read rather than mapped (a
    /// failing read is then an error naming the file), and do not stream: the reference for
    /// comparison, which needs the whole model to fit in memory. The streaming flags do not
    /// apply to it and are refused beside it.
    #[arg(long, conflicts_with_all = ["cache_mb", "force_cache", "dense", "csv", "progress", "experts_used", "substitute", "rpc", "verify"])]
    pub resident: bool,
    /// Expert cache budget in MiB; 0 reads every routed expert every time. Default: what the
    /// board's memory budget leaves after the rest of the ledger (`sluice plan`), at most all the
    /// experts.
    #[arg(long)]
    pub cache_mb: Option<u64>,
    /// Accept a cache budget below one token's routed demand.
    #[arg(long)]
    pub force_cache: bool,
    /// Where the dense (always-needed) weights live (the cuda service always uses mmap).
    #[arg(long, value_enum, default_value_t = DensePolicy::Anon)]
    pub dense: DensePolicy,
    /// The most prompt tokens one decode takes, or `auto`: the largest of 512, 1024 and 2048
    /// (at most the context) whose plan fits the budget and keeps enough of batch 512's expert
    /// cache (half on SD and eMMC storage, all of it elsewhere). A prompt passes the routed
    /// experts through once per batch. `--resident` takes the streamed run's choice.
    #[arg(long, default_value = "auto", value_parser = Batch::parse)]
    pub batch: Batch,
    /// Write per-token telemetry to this CSV file.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Show a live status line while generating.
    #[arg(long)]
    pub progress: bool,
    #[command(flatten)]
    pub lossy: LossyArgs,
}

impl StreamArgs {
    /// The streamed run of `model` on `board` these arguments ask for, over the RPC workers
    /// `rpc` lists.
    pub fn launch(&self, model: &Path, positions: Positions, board: &ResolvedBoard, rpc: &[String]) -> Launch {
        Launch {
            model: model.to_path_buf(),
            board: board.clone(),
            positions,
            slots: 1,
            batch: self.batch,
            cache: Cache::from_mib(self.cache_mb),
            force_cache: self.force_cache,
            dense: self.dense,
            lossy: self.lossy.lossy(),
            rpc: rpc.to_vec(),
            kept_bytes: 0,
        }
    }
}

/// Several boards serving one model.
#[derive(Args, Clone, Default)]
pub struct RpcArgs {
    /// RPC workers (`sluice worker`) that hold the model's last layers resident, as
    /// HOST:PORT,... in layer order (the last one holds the output layer too); this board keeps
    /// the first layers and streams their experts. Use a private link only: the link is not
    /// encrypted.
    #[arg(long, value_name = "HOST:PORT,...")]
    pub rpc: Vec<String>,
    /// The pre-shared key file the workers were started with (`sluice worker --key-file`).
    #[arg(long, value_name = "FILE")]
    pub rpc_key_file: Option<std::path::PathBuf>,
    /// Seconds the head waits for any one answer of a worker (a layer's share of a prompt batch
    /// on a slow board included) before the worker counts as lost (default: 60).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub rpc_call_timeout: Option<u64>,
}

impl RpcArgs {
    /// Sets up this process's link to the workers (time bounds, and the key from
    /// `--rpc-key-file`); a no-op without workers.
    pub fn configure_link(&self) -> anyhow::Result<()> {
        configure_link(&self.rpc, self.rpc_key_file.as_deref(), self.rpc_call_timeout)
    }
}

/// Sets up this process's link to the workers at `endpoints` (time bounds, `call_timeout_s` for
/// one answer when given, and the key from `key_file`); a no-op without workers.
pub fn configure_link(
    endpoints: &[String],
    key_file: Option<&Path>,
    call_timeout_s: Option<u64>,
) -> anyhow::Result<()> {
    if endpoints.is_empty() {
        return Ok(());
    }
    let key = key_file.map(sluice::scaleout::link::LinkKey::from_file).transpose()?;
    let call_timeout = call_timeout_s.map_or(sluice::scaleout::link::CALL_TIMEOUT, std::time::Duration::from_secs);
    sluice::scaleout::link::configure_head(key, call_timeout);
    Ok(())
}

/// An argument group's fields as the flags that set them, to pass the group on to a child
/// process as given: `io_lanes: Some(2)` gives `--io-lanes 2`, `true` the bare flag, a list one
/// flag per item; unset and false fields give none. The group's flags must be its fields' names
/// (clap's default), which the tests check for each group passed on.
pub fn flags_of<T: Serialize>(group: &T) -> Vec<OsString> {
    let Ok(Value::Object(fields)) = serde_json::to_value(group) else { return Vec::new() };
    let mut out = Vec::new();
    for (name, value) in fields {
        let flag = OsString::from(format!("--{}", name.replace('_', "-")));
        let items = match value {
            Value::Array(items) => items,
            one => vec![one],
        };
        for item in items {
            match item {
                Value::Bool(true) => out.push(flag.clone()),
                Value::String(s) => out.extend([flag.clone(), s.into()]),
                Value::Number(n) => out.extend([flag.clone(), n.to_string().into()]),
                Value::Bool(false) | Value::Null | Value::Array(_) | Value::Object(_) => {}
            }
        }
    }
    out
}

/// A `--model` value: a file's path, or the name of a stored model (`sluice models`: as
/// `sluice pull` took it), which becomes its file's path; a name not stored is an error that says
/// to pull it.
pub fn model(value: &str) -> Result<PathBuf, String> {
    sluice::store::Store::new(None, None).resolve(Path::new(value)).map_err(|e| e.to_string())
}

/// Where the model store is (`pull`, `models`, `plan`).
#[derive(Args, Clone, Debug, Default)]
pub struct StoreArgs {
    /// The Hugging Face hub cache that hub names are kept in (default: $HF_HUB_CACHE,
    /// $HF_HOME/hub, the service's state directory, ~/.cache/huggingface/hub: shared with
    /// huggingface-cli and llama-server -hf).
    #[arg(long, value_name = "DIR")]
    pub hf_cache: Option<PathBuf>,
    /// The Ollama models folder that Ollama names are pulled into (default: $OLLAMA_MODELS, the
    /// service's state directory, ~/.ollama/models where Ollama is installed, else sluice's cache).
    #[arg(long, value_name = "DIR")]
    pub ollama_models: Option<PathBuf>,
}

impl StoreArgs {
    /// The store these folders make.
    pub fn store(&self) -> sluice::store::Store {
        sluice::store::Store::new(self.hf_cache.clone(), self.ollama_models.clone())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use sluice::board::Draft;

    #[derive(Parser, Debug)]
    struct Child {
        #[command(flatten)]
        tuning: TuningArgs,
        #[command(flatten)]
        lossy: LossyArgs,
    }

    fn passed_on(tuning: &TuningArgs, lossy: &LossyArgs) -> Child {
        let mut args = vec![OsString::from("child")];
        args.extend(flags_of(tuning));
        args.extend(flags_of(lossy));
        Child::try_parse_from(args).unwrap()
    }

    #[test]
    fn the_tuning_and_lossy_flags_reach_a_child_as_given() {
        let tuning = TuningArgs {
            threads: Some(3),
            io_lanes: Some(2),
            read_kib: Some(512),
            no_direct_io: true,
            verify: true,
            overlap: false,
            overlap_prompt: true,
            overlap_auto: false,
            no_overlap: false,
            draft: Some(Draft::Ngram),
            cache_policy: Some(sluice::stream::CachePolicy::Frequency),
            no_expert_slots: true,
            lookahead: true,
            no_lookahead: false,
            pace_mbps: Some(400),
            cache_type_k: Some(sluice::generate::KvCacheType::Q8_0),
            cache_type_v: Some(sluice::generate::KvCacheType::Q4_0),
        };
        let lossy = LossyArgs { experts_used: Some(2), substitute: Some(4) };
        let child = passed_on(&tuning, &lossy);
        assert_eq!((child.tuning, child.lossy), (tuning, lossy));
        for overlap in [
            TuningArgs { overlap: true, ..TuningArgs::default() },
            TuningArgs { no_overlap: true, draft: Some(Draft::Off), ..TuningArgs::default() },
            TuningArgs::default(),
        ] {
            assert_eq!(passed_on(&overlap, &LossyArgs::default()).tuning, overlap);
        }
    }
}
