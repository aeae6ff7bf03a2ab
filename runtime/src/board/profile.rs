//! The board profile file (`boards/<id>.toml`): its schema, strict parsing, and the checks that
//! need no hardware. Every field is documented with its unit in `boards/README.md`.

use ggml_sys::SchedPriority;
use serde::{Deserialize, Serialize};
use sluice_hal::storage::Medium;

use super::BoardError;

/// A parsed board profile.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BoardProfile {
    /// Human-readable board name.
    pub name: String,
    /// How `--board auto` recognizes the board.
    #[serde(default)]
    pub identity: Identity,
    /// Where compute and I/O threads run.
    #[serde(default)]
    pub cpu: CpuSection,
    /// How experts are read.
    #[serde(default)]
    pub storage: StorageSection,
    /// How much memory sluice may hold.
    #[serde(default)]
    pub memory: MemorySection,
    /// Which compute service runs the graph.
    #[serde(default)]
    pub compute: ComputeSection,
    /// How the binary for this board is built.
    #[serde(default)]
    pub build: BuildSection,
}

/// `[identity]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Device-tree `compatible` entries; the board matches when any one is present. Empty: the
    /// profile is never chosen automatically.
    #[serde(default)]
    pub compatible: Vec<String>,
    /// Nominal RAM in GiB; matches when `MemTotal` is above half of it and at most all of it.
    pub ram_gib: Option<u32>,
}

/// `cpu.priority`: one of [`SchedPriority::NAMES`].
fn priority<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SchedPriority, D::Error> {
    let name = String::deserialize(d)?;
    SchedPriority::from_name(&name).ok_or_else(|| serde::de::Error::unknown_variant(&name, &SchedPriority::NAMES))
}

/// `[cpu]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CpuSection {
    /// CPUs the compute threads run on. Absent: every online CPU.
    pub compute_cores: Option<Vec<usize>>,
    /// CPUs the I/O lanes run on. Absent: the compute cores.
    pub io_cores: Option<Vec<usize>>,
    /// Compute thread priority.
    #[serde(default, deserialize_with = "priority")]
    pub priority: SchedPriority,
    /// Busy-poll level of idle compute threads, 0 to 100 (at most 70 µs a level: vendor patch 0015).
    #[serde(default = "default_poll")]
    pub poll: u32,
    /// One core per compute thread.
    #[serde(default)]
    pub strict_cpu: bool,
}

fn default_poll() -> u32 {
    5
}

impl Default for CpuSection {
    fn default() -> Self {
        CpuSection {
            compute_cores: None,
            io_cores: None,
            priority: SchedPriority::Normal,
            poll: default_poll(),
            strict_cpu: false,
        }
    }
}

/// `storage.medium`: one of [`Medium::NAMES`].
fn medium<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Medium>, D::Error> {
    let name = String::deserialize(d)?;
    Medium::from_name(&name).map(Some).ok_or_else(|| serde::de::Error::unknown_variant(&name, &Medium::NAMES))
}

/// `[storage]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StorageSection {
    /// The medium the model is expected on (a different probed medium is logged).
    #[serde(default, deserialize_with = "medium")]
    pub medium: Option<Medium>,
    /// Largest single expert read in KiB. Absent: the device's `max_sectors_kb`.
    pub read_kib: Option<u64>,
    /// Parallel expert readers. Absent: chosen from the probed medium.
    pub lanes: Option<u32>,
    /// Read experts with `O_DIRECT`.
    #[serde(default = "yes")]
    pub direct_io: bool,
    /// Overlap expert reads with expert compute (the streamed-experts kernel computes each
    /// expert once its slices have landed): `false`/"off", "prompt" (prompt batches only), "auto"
    /// (prompt batches, and decodes while no other process keeps the cores busy) or `true`/"on".
    /// Absent: "auto" where the build has the CPU extension service, else off.
    #[serde(default, deserialize_with = "overlap")]
    pub overlap: Option<Overlap>,
    /// Check every expert and dense read against the model's checksum sidecar (`sluice
    /// verify`): for media that rot, such as SD cards.
    #[serde(default)]
    pub verify: bool,
    /// In single-token decodes, guess the next layer's experts (its router applied to this
    /// layer's router input) and read those not resident while this layer computes; a wrong
    /// guess costs a read, never a different token. Absent: on where the model's storage is
    /// NVMe (where a read's latency, not its bytes, is what a decode waits for).
    #[serde(default)]
    pub lookahead: Option<bool>,
}

/// `storage.overlap`: when expert reads overlap expert compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Never: each layer's experts are read, then computed.
    Off,
    /// Prompt batches only (a prompt routes most experts; each is computed as it lands), while
    /// single-token decodes read serially; the I/O cores keep computing.
    Prompt,
    /// Prompt batches, and single-token decodes while other processes leave the compute and I/O
    /// cores idle ([`crate::stream::engine::idle::IdleCores`]); serial decodes while they do not. The
    /// I/O cores keep computing.
    Auto,
    /// Every decode; the I/O cores compute no more.
    On,
}

impl Overlap {
    /// Its name in profiles and reports.
    pub fn name(self) -> &'static str {
        match self {
            Overlap::Off => "off",
            Overlap::Prompt => "prompt",
            Overlap::Auto => "auto",
            Overlap::On => "on",
        }
    }
}

/// `storage.overlap` as a boolean (`true` is "on") or a name.
fn overlap<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Overlap>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Flag(bool),
        Name(String),
    }
    Ok(Some(match Given::deserialize(d)? {
        Given::Flag(true) => Overlap::On,
        Given::Flag(false) => Overlap::Off,
        Given::Name(n) => [Overlap::Off, Overlap::Prompt, Overlap::Auto, Overlap::On]
            .into_iter()
            .find(|o| o.name() == n)
            .ok_or_else(|| serde::de::Error::unknown_variant(&n, &["off", "prompt", "auto", "on", "true", "false"]))?,
    }))
}

fn yes() -> bool {
    true
}

impl Default for StorageSection {
    fn default() -> Self {
        StorageSection {
            medium: None,
            read_kib: None,
            lanes: None,
            direct_io: true,
            overlap: None,
            verify: false,
            lookahead: None,
        }
    }
}

/// `[memory]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    /// The most sluice may hold, MiB. Absent: `MemTotal` minus `reserve_mib`.
    pub budget_mib: Option<u64>,
    /// Memory left to the OS and other services, MiB.
    #[serde(default = "default_reserve")]
    pub reserve_mib: u64,
    /// How the expert cache evicts: "lru" or "frequency". Absent: the runtime's default.
    pub cache_policy: Option<crate::stream::CachePolicy>,
    /// Land expert reads in a pool of pages committed at open (default) instead of fresh pages
    /// faulted in by every read and given back by every eviction.
    #[serde(default = "default_expert_slots")]
    pub expert_slots: bool,
    /// The KV cache's type for keys ("f16", "q8_0", "q4_0", ...; llama.cpp's names). Absent: f16.
    pub cache_type_k: Option<crate::generate::KvCacheType>,
    /// The KV cache's type for values. Absent: f16.
    pub cache_type_v: Option<crate::generate::KvCacheType>,
}

fn default_expert_slots() -> bool {
    true
}

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection {
            budget_mib: None,
            reserve_mib: default_reserve(),
            cache_policy: None,
            expert_slots: default_expert_slots(),
            cache_type_k: None,
            cache_type_v: None,
        }
    }
}

/// The most MiB a profile's memory fields may give (16 TiB): sizes stay far from wrapping when
/// they are turned into bytes.
const MAX_MEMORY_MIB: u64 = 1 << 24;

fn default_reserve() -> u64 {
    512
}

/// Service names of `compute.service`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ServiceName {
    /// ggml's CPU thread pool.
    #[default]
    Cpu,
    /// CUDA: dense layers on the GPU, experts streamed into CPU memory.
    Cuda,
}

/// `compute.draft`: how decodes draft tokens to verify in one batch.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Draft {
    /// One token per decode.
    #[default]
    Off,
    /// Tokens that followed the same n-gram earlier in the context (llama.cpp's lookup
    /// decoding), verified in one batch; greedy output is unchanged.
    Ngram,
}

/// `[compute]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ComputeSection {
    /// The service.
    #[serde(default)]
    pub service: ServiceName,
    /// Layers offloaded to the GPU (`cuda` only).
    #[serde(default)]
    pub n_gpu_layers: u32,
    /// With `service = "cuda"`: run on the CPU service instead of failing when the build or the
    /// board has no CUDA.
    #[serde(default)]
    pub cpu_fallback: bool,
    /// Draft tokens per decode (`"off"`, `"ngram"`); absent: off.
    pub draft: Option<Draft>,
}

/// `[build]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BuildSection {
    /// `GGML_CPU_ARM_ARCH` for cross builds for this board.
    pub ggml_cpu_arm_arch: Option<String>,
}

impl BoardProfile {
    /// Parses and checks a profile's text; `origin` (a path or `built-in <id>`) names it in
    /// errors.
    pub fn parse(text: &str, origin: &str) -> Result<BoardProfile, BoardError> {
        let profile: BoardProfile = toml::from_str(text)
            .map_err(|e| BoardError::Parse { origin: origin.into(), message: crate::text::toml_error(text, &e) })?;
        profile.check(origin)?;
        Ok(profile)
    }

    fn check(&self, origin: &str) -> Result<(), BoardError> {
        let bad = |field: &str, fix: &str| {
            Err(BoardError::Field { origin: origin.into(), field: field.into(), fix: fix.into() })
        };
        if self.cpu.compute_cores.as_ref().is_some_and(Vec::is_empty) {
            return bad("cpu.compute_cores", "list at least one core, or remove the field to use every online core");
        }
        if self.cpu.io_cores.as_ref().is_some_and(Vec::is_empty) {
            return bad("cpu.io_cores", "list at least one core, or remove the field to share the compute cores");
        }
        for (field, list) in [("cpu.compute_cores", &self.cpu.compute_cores), ("cpu.io_cores", &self.cpu.io_cores)] {
            let mut seen = std::collections::BTreeSet::new();
            if let Some(core) = list.iter().flatten().find(|c| !seen.insert(**c)) {
                return bad(field, &format!("CPU {core} is listed twice; list each core once"));
            }
        }
        if self.cpu.poll > 100 {
            return bad("cpu.poll", "use a value from 0 (sleep at once) to 100 (spin)");
        }
        if let Some(kib) = self.storage.read_kib {
            if !(4..=65536).contains(&kib) || kib % 4 != 0 {
                return bad(
                    "storage.read_kib",
                    "use a multiple of 4 KiB from 4 to 65536, or remove it to use the device's limit",
                );
            }
        }
        if self.storage.lanes.is_some_and(|l| !(1..=64).contains(&l)) {
            return bad("storage.lanes", "use 1 to 64 lanes, or remove it to choose from the medium");
        }
        if self.identity.ram_gib == Some(0) {
            return bad("identity.ram_gib", "give the board's nominal RAM in GiB (4, 8, 16, ...)");
        }
        for (field, mib) in
            [("memory.budget_mib", self.memory.budget_mib), ("memory.reserve_mib", Some(self.memory.reserve_mib))]
        {
            if mib.is_some_and(|m| m > MAX_MEMORY_MIB) {
                return bad(field, "give MiB up to 16777216 (16 TiB)");
            }
        }
        if self.memory.budget_mib == Some(0) {
            return bad(
                "memory.budget_mib",
                "give a budget in MiB, or remove it to use MemTotal minus memory.reserve_mib",
            );
        }
        if self.compute.service == ServiceName::Cpu && self.compute.n_gpu_layers > 0 {
            return bad(
                "compute.n_gpu_layers",
                "offloading needs service = \"cuda\"; remove n_gpu_layers for the cpu service",
            );
        }
        Ok(())
    }
}
