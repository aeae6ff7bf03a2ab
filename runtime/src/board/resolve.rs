//! A profile applied to the probed machine and the command line: the concrete cores, read size,
//! lanes, budget and compute service a run uses, each with where it came from.

use crate::generate::{KvCacheType, KvTypes};
use sluice_hal::cpulist;
use sluice_hal::probe::HardwareProbe;
use sluice_hal::storage::Medium;

use ggml_sys::SchedPriority;

use super::caps::BuildCaps;
use super::profile::{BoardProfile, Draft, Overlap};
use super::select::SelectedBoard;
use super::service::compute_service;
pub use super::service::ComputeService;
use super::BoardError;
use crate::stream::CachePolicy;

/// The expert cache's policy where neither the profile nor the command line names one.
const DEFAULT_CACHE_POLICY: CachePolicy = CachePolicy::DEFAULT;
/// Why.
const DEFAULT_CACHE_POLICY_WHY: &str =
    "default: adaptive, nearer Belady's MIN than frequency and lru in replays of trained models' routes (docs/benchmarks.md)";

/// Command-line values that override the profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--threads`.
    pub threads: Option<u32>,
    /// `--io-lanes`.
    pub io_lanes: Option<u32>,
    /// `--read-kib`.
    pub read_kib: Option<u64>,
    /// `--no-direct-io`.
    pub no_direct_io: bool,
    /// `--verify`.
    pub verify: bool,
    /// `--overlap`, `--overlap-prompt`, `--overlap-auto` or `--no-overlap`.
    pub overlap: Option<Overlap>,
    /// `--draft`.
    pub draft: Option<Draft>,
    /// `--cache-policy`.
    pub cache_policy: Option<CachePolicy>,
    /// `--no-expert-slots`.
    pub no_expert_slots: bool,
    /// `--lookahead` or `--no-lookahead`.
    pub lookahead: Option<bool>,
    /// `--pace-mbps`.
    pub pace_mbps: Option<u32>,
    /// `--cache-type-k`.
    pub cache_type_k: Option<KvCacheType>,
    /// `--cache-type-v`.
    pub cache_type_v: Option<KvCacheType>,
}

/// A value and where it came from (`profile storage.lanes`, `--io-lanes`, `probe`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    /// The value.
    pub value: T,
    /// Its source, for reports.
    pub source: String,
}

fn sourced<T>(value: T, source: impl Into<String>) -> Sourced<T> {
    Sourced { value, source: source.into() }
}

/// The resolved board.
#[derive(Debug, Clone)]
pub struct ResolvedBoard {
    /// The profile chosen, and why.
    pub selected: SelectedBoard,
    /// CPUs the compute threads run on.
    pub compute_cores: Vec<usize>,
    /// CPUs the I/O lanes run on.
    pub io_cores: Vec<usize>,
    /// Compute threads.
    pub threads: Sourced<u32>,
    /// Compute thread priority.
    pub priority: SchedPriority,
    /// Busy-poll level, 0 to 100.
    pub poll: u32,
    /// One core per compute thread.
    pub strict_cpu: bool,
    /// The storage the model is on, as probed (`other` where no block device was found).
    pub medium: Medium,
    /// Largest single expert read, bytes.
    pub read_bytes: Sourced<u64>,
    /// Parallel expert readers.
    pub lanes: Sourced<u32>,
    /// Read experts with `O_DIRECT`.
    pub direct_io: bool,
    /// Check every read against the model's checksum sidecar.
    pub verify: bool,
    /// When expert reads overlap expert compute.
    pub overlap: Sourced<Overlap>,
    /// Draft tokens per decode.
    pub draft: Sourced<Draft>,
    /// How the expert cache evicts.
    pub cache_policy: Sourced<CachePolicy>,
    /// Expert reads land in a pool of pages committed at open.
    pub expert_slots: bool,
    /// Single-token decodes start the reads of the next layer's guessed experts early.
    pub lookahead: bool,
    /// Expert and dense reads paced to a slower device of this many MB/s (`--pace-mbps`; never
    /// from a profile: a board reads at its own storage's speed).
    pub pace_mbps: Option<u32>,
    /// The KV cache's element types (`--cache-type-k/-v`, else the profile's, else f16).
    pub kv: KvTypes,
    /// The most sluice may hold, bytes.
    pub budget: Sourced<u64>,
    /// The compute service.
    pub compute: ComputeService,
    /// How extension work reaches it: the ggml-ext service the compute service runs through.
    pub compute_via: String,
    /// Things the user should know (offline cores, a fallback taken, a medium mismatch).
    pub notes: Vec<String>,
}

/// Lanes for a medium when the profile names none, and the most the medium rewards.
fn lanes_for(medium: Medium) -> (u32, u32) {
    match medium {
        Medium::Sd => (1, 2),
        Medium::Emmc => (2, 2),
        Medium::Nvme => (4, 16),
        Medium::Virtio => (2, 8),
        Medium::Other => (2, 8),
    }
}

/// Applies `selected` to the probed machine. `allowed` is the process's CPU affinity (cores
/// outside it cannot be used; `None` for fake trees); `caps` says what this build can do.
pub fn resolve(
    selected: SelectedBoard,
    probe: &HardwareProbe,
    overrides: &Overrides,
    allowed: Option<&[usize]>,
    caps: BuildCaps,
) -> Result<ResolvedBoard, BoardError> {
    let p = &selected.profile;
    let origin = selected.origin.as_str();
    let mut notes = Vec::new();
    let usable: Vec<usize> =
        probe.cpu.online.iter().copied().filter(|c| allowed.is_none_or(|a| a.contains(c))).collect();
    let cpus = Cpus { probe, origin, usable: &usable };
    let (compute_cores, io_cores) = cpus.core_sets(p, &mut notes)?;
    let threads = thread_count(overrides.threads, &usable, &compute_cores, &mut notes);
    let (read_bytes, lanes) = reads(p, probe, overrides, &mut notes);
    let budget = memory_budget(p, probe, origin)?;
    let overlap = overlap(p, overrides, caps, origin)?;
    let (compute_cores, threads) =
        cores_for_overlap(&overlap, overrides, compute_cores, &io_cores, threads, &mut notes);
    let draft = match (overrides.draft, p.compute.draft) {
        (Some(d), _) => sourced(d, "--draft"),
        (None, Some(d)) => sourced(d, "profile compute.draft"),
        (None, None) => sourced(Draft::Off, "default: off, measured slower streamed (docs/benchmarks.md)"),
    };
    let cache_policy = match (overrides.cache_policy, p.memory.cache_policy) {
        (Some(c), _) => sourced(c, "--cache-policy"),
        (None, Some(c)) => sourced(c, "profile memory.cache_policy"),
        (None, None) => sourced(DEFAULT_CACHE_POLICY, DEFAULT_CACHE_POLICY_WHY),
    };
    let (compute, compute_via) = compute_service(p, caps, origin, &mut notes)?;
    let medium = probe.storage.as_ref().map_or(Medium::Other, |s| s.medium);
    Ok(ResolvedBoard {
        compute_via,
        compute_cores,
        io_cores,
        threads,
        priority: p.cpu.priority,
        poll: p.cpu.poll,
        strict_cpu: p.cpu.strict_cpu,
        medium,
        read_bytes,
        lanes,
        direct_io: p.storage.direct_io && !overrides.no_direct_io,
        verify: p.storage.verify || overrides.verify,
        overlap,
        draft,
        cache_policy,
        expert_slots: p.memory.expert_slots && !overrides.no_expert_slots,
        lookahead: overrides.lookahead.or(p.storage.lookahead).unwrap_or(false),
        pace_mbps: overrides.pace_mbps,
        kv: KvTypes {
            k: overrides.cache_type_k.or(p.memory.cache_type_k).unwrap_or_default(),
            v: overrides.cache_type_v.or(p.memory.cache_type_v).unwrap_or_default(),
        },
        budget,
        compute,
        notes,
        selected,
    })
}

/// The CPUs a profile's core lists may name: those this process may use.
struct Cpus<'a> {
    probe: &'a HardwareProbe,
    origin: &'a str,
    usable: &'a [usize],
}

impl Cpus<'_> {
    /// The compute cores and the I/O lanes' cores: the profile's lists (all usable CPUs when
    /// it gives none; the I/O lanes share the compute cores when it names no I/O cores, or the
    /// last compute core when none of its I/O cores is usable).
    fn core_sets(&self, p: &BoardProfile, notes: &mut Vec<String>) -> Result<(Vec<usize>, Vec<usize>), BoardError> {
        let compute_cores = self.cores("cpu.compute_cores", &p.cpu.compute_cores, notes)?;
        let Some(&last) = compute_cores.last() else {
            return Err(BoardError::NoUsableCore {
                origin: self.origin.to_string(),
                field: "cpu.compute_cores".into(),
                usable: cpulist::format(self.usable),
            });
        };
        let mut io_cores = match &p.cpu.io_cores {
            Some(_) => self.cores("cpu.io_cores", &p.cpu.io_cores, notes)?,
            None => compute_cores.clone(),
        };
        if io_cores.is_empty() {
            notes.push(format!("cpu.io_cores: none usable; the I/O lanes share compute core {last}"));
            io_cores = vec![last];
        }
        Ok((compute_cores, io_cores))
    }

    /// The usable CPUs of `list` (profile field `field`): a CPU the machine cannot have is an
    /// error, one offline or outside the affinity a note.
    fn cores(&self, field: &str, list: &Option<Vec<usize>>, notes: &mut Vec<String>) -> Result<Vec<usize>, BoardError> {
        let Some(list) = list else { return Ok(self.usable.to_vec()) };
        if let Some(&core) = list.iter().find(|c| !self.probe.cpu.possible.contains(c)) {
            return Err(BoardError::NoSuchCore {
                origin: self.origin.to_string(),
                field: field.into(),
                core,
                possible: cpulist::format(&self.probe.cpu.possible),
            });
        }
        let (kept, dropped): (Vec<usize>, Vec<usize>) = list.iter().partition(|c| self.usable.contains(c));
        if !dropped.is_empty() {
            notes.push(format!(
                "{field}: CPU {} offline or outside this process's affinity (power mode, taskset or CPUAffinity); using {}",
                cpulist::format(&dropped),
                if kept.is_empty() { "none of the listed".to_string() } else { cpulist::format(&kept) }
            ));
        }
        Ok(kept)
    }
}

/// Compute threads: `--threads` (at most the usable CPUs), else one per compute core.
fn thread_count(
    asked: Option<u32>,
    usable: &[usize],
    compute_cores: &[usize],
    notes: &mut Vec<String>,
) -> Sourced<u32> {
    match asked {
        Some(t) if t as usize > usable.len() => {
            notes.push(format!(
                "--threads {t}: more than the {} CPUs this process may use ({}); using {} (ggml's threads meet at a barrier after every node, so threads beyond the CPUs hold the others up)",
                usable.len(),
                cpulist::format(usable),
                usable.len()
            ));
            sourced(usable.len() as u32, "--threads, capped to the usable CPUs")
        }
        Some(t) => sourced(t, "--threads"),
        None => sourced(compute_cores.len() as u32, "one per compute core"),
    }
}

/// The read size (a multiple of the device's direct-I/O alignment) and the lanes, from the
/// flags, the profile or the storage the model is on.
fn reads(
    p: &BoardProfile,
    probe: &HardwareProbe,
    overrides: &Overrides,
    notes: &mut Vec<String>,
) -> (Sourced<u64>, Sourced<u32>) {
    let storage = probe.storage.as_ref();
    let medium = storage.map_or(Medium::Other, |s| s.medium);
    if let Some(expected) = p.storage.medium {
        if expected != medium {
            notes.push(format!(
                "storage.medium: the profile expects {} but the model is on {}",
                expected.name(),
                medium.name()
            ));
        }
    }
    let align = storage.map_or(4096, |s| s.direct_alignment()).max(4096);
    let read_bytes = match (overrides.read_kib, p.storage.read_kib, storage.and_then(|s| s.max_request)) {
        (Some(kib), _, _) => sourced(kib << 10, "--read-kib"),
        (None, Some(kib), _) => sourced(kib << 10, "profile storage.read_kib"),
        (None, None, Some(bytes)) => sourced(bytes, "device queue/max_sectors_kb"),
        (None, None, None) => sourced(512 << 10, "default (no block device found)"),
    };
    let read_bytes = Sourced { value: (read_bytes.value / align).max(1) * align, ..read_bytes };
    let (medium_lanes, medium_max) = lanes_for(medium);
    let lanes = match (overrides.io_lanes, p.storage.lanes) {
        (Some(l), _) => sourced(l, "--io-lanes"),
        (None, Some(l)) if l > medium_max => {
            notes.push(format!(
                "storage.lanes = {l} is more than {} storage rewards; using {medium_max}",
                medium.name()
            ));
            sourced(medium_max, format!("profile storage.lanes, clamped for {}", medium.name()))
        }
        (None, Some(l)) => sourced(l, "profile storage.lanes"),
        (None, None) => sourced(medium_lanes, format!("chosen for {} storage", medium.name())),
    };
    (read_bytes, lanes)
}

/// The most sluice may hold: the profile's budget (at most the RAM) or the RAM less the
/// reserve, lowered to the memory cgroup's limit and to what is available.
fn memory_budget(p: &BoardProfile, probe: &HardwareProbe, origin: &str) -> Result<Sourced<u64>, BoardError> {
    let mib = |b: u64| b >> 20;
    let total = probe.memory.total.ok_or_else(|| BoardError::NoMemInfo { root: probe.root.dir().into() })?;
    let reserve = p.memory.reserve_mib << 20;
    let mut budget = match p.memory.budget_mib {
        Some(b) if b << 20 > total => {
            return Err(BoardError::BudgetOverRam { origin: origin.to_string(), budget_mib: b, ram_mib: mib(total) });
        }
        Some(b) => sourced(b << 20, "profile memory.budget_mib"),
        None => sourced(
            total.saturating_sub(reserve),
            format!("MemTotal {} MiB − memory.reserve_mib {}", mib(total), p.memory.reserve_mib),
        ),
    };
    if let Some(cgroup) = probe.memory.cgroup.as_ref() {
        if let Some(limit) = cgroup.limit.filter(|&l| l < budget.value) {
            budget = sourced(limit, format!("memory cgroup limit ({:?})", cgroup.version));
        }
    }
    if let Some(avail) = probe.memory.available {
        if avail < budget.value {
            budget = sourced(avail, "MemAvailable");
        }
    }
    Ok(budget)
}

/// When expert reads overlap expert compute: the flags, the profile, else prompt batches and
/// decodes while the cores are otherwise idle (serial without the CPU extension service, which
/// overlap needs).
fn overlap(
    p: &BoardProfile,
    overrides: &Overrides,
    caps: BuildCaps,
    origin: &str,
) -> Result<Sourced<Overlap>, BoardError> {
    let overlap = match (overrides.overlap, p.storage.overlap) {
        (Some(v), _) => sourced(
            v,
            match v {
                Overlap::Off => "--no-overlap",
                Overlap::Prompt => "--overlap-prompt",
                Overlap::Auto => "--overlap-auto",
                Overlap::On => "--overlap",
            },
        ),
        (None, Some(v)) => sourced(v, "profile storage.overlap"),
        (None, None) if caps.cpu_parallel => sourced(
            Overlap::Auto,
            "default: prompt batches, and decodes while no other process keeps the cores busy (docs/benchmarks.md)",
        ),
        (None, None) => sourced(Overlap::Off, "default without ggml_ext_cpu_parallel_v1: serial"),
    };
    if overlap.value != Overlap::Off && !caps.cpu_parallel {
        return Err(BoardError::NoOverlap { origin: origin.to_string(), asked_by: overlap.source });
    }
    Ok(overlap)
}

/// Overlapped decodes: the lanes read while the compute threads run, so no core does both
/// (unless `--threads` says otherwise). Prompt-only overlap keeps every compute core (the lanes
/// mostly sleep in the kernel).
fn cores_for_overlap(
    overlap: &Sourced<Overlap>,
    overrides: &Overrides,
    compute_cores: Vec<usize>,
    io_cores: &[usize],
    threads: Sourced<u32>,
    notes: &mut Vec<String>,
) -> (Vec<usize>, Sourced<u32>) {
    if overlap.value != Overlap::On || overrides.threads.is_some() {
        return (compute_cores, threads);
    }
    let own: Vec<usize> = compute_cores.iter().copied().filter(|c| !io_cores.contains(c)).collect();
    if own.is_empty() || own.len() == compute_cores.len() {
        return (compute_cores, threads);
    }
    notes.push(format!(
        "overlap: the I/O lanes' cores {} compute no more (compute on {})",
        cpulist::format(io_cores),
        cpulist::format(&own)
    ));
    let threads = sourced(own.len() as u32, "one per compute core not reading (overlap)");
    (own, threads)
}

impl ResolvedBoard {
    /// The most tokens a decode drafts (`None`: drafting is off).
    pub fn draft_max(&self) -> Option<usize> {
        (self.draft.value == Draft::Ngram).then_some(crate::generate::NGRAM_DRAFT_MAX)
    }

    /// The compute threads as ggml's thread pool should run them.
    pub fn threads(&self) -> ggml_sys::Threads {
        ggml_sys::Threads {
            count: self.threads.value,
            cpus: self.compute_cores.clone(),
            strict_cpu: self.strict_cpu,
            priority: self.priority,
            poll: self.poll,
        }
    }

    /// The I/O lanes as the streaming engine should run them.
    pub fn lanes(&self) -> crate::stream::LaneConfig {
        crate::stream::LaneConfig {
            lanes: self.lanes.value as usize,
            direct: self.direct_io,
            max_request: self.read_bytes.value as usize,
            cpus: self.io_cores.clone(),
            bound: crate::stream::READ_BOUND,
            fault: None,
            pace: self.pace_mbps.map(|mbps| u64::from(mbps) * 1_000_000),
        }
    }
}
