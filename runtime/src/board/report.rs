//! Text reports: `sluice probe` and `sluice boards`.

use std::fmt::Write as _;

use sluice_hal::cpulist;
use sluice_hal::probe::HardwareProbe;

use super::profile::{BoardProfile, Draft};
use super::resolve::{ComputeService, ResolvedBoard};
use super::BUILTIN;

fn mib(b: u64) -> String {
    format!("{} MiB", b >> 20)
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "unknown".to_string(), |v| v.to_string())
}

/// What the hardware probe found.
pub fn describe_probe(p: &HardwareProbe) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "root: {}", p.root.dir().display());
    let _ = writeln!(o, "board");
    let _ = writeln!(o, "  model: {}", p.identity.model.as_deref().unwrap_or("(no device tree)"));
    let _ = writeln!(
        o,
        "  compatible: {}",
        if p.identity.compatible.is_empty() { "(none)".into() } else { p.identity.compatible.join(", ") }
    );
    let _ = writeln!(o, "  jetson release: {}", p.identity.tegra_release.as_deref().unwrap_or("(none)"));
    let _ = writeln!(o, "cpu");
    let _ = writeln!(o, "  possible: {}  online: {}", cpulist::format(&p.cpu.possible), cpulist::format(&p.cpu.online));
    for k in p.cpu.clusters() {
        let _ = writeln!(
            o,
            "  cluster {}: cpus {}, capacity {}, max {}",
            if k.id < 0 { "(none reported)".to_string() } else { k.id.to_string() },
            cpulist::format(&k.cpus),
            opt(k.capacity),
            k.max_freq_khz.map_or("unknown".into(), |f| format!("{} MHz", f / 1000))
        );
    }
    describe_memory(&mut o, p);
    describe_storage(&mut o, p);
    describe_thermal(&mut o, p);
    o
}

/// The probe's memory section.
fn describe_memory(o: &mut String, p: &HardwareProbe) {
    let _ = writeln!(o, "memory");
    let _ =
        writeln!(o, "  MemTotal: {}  MemAvailable: {}", opt(p.memory.total.map(mib)), opt(p.memory.available.map(mib)));
    match &p.memory.cgroup {
        Some(c) => {
            let _ = writeln!(
                o,
                "  cgroup {:?} {}: limit {}, usage {}",
                c.version,
                c.dir.display(),
                c.limit.map_or("none".into(), mib),
                opt(c.usage.map(mib))
            );
        }
        None => {
            let _ = writeln!(o, "  cgroup: none found");
        }
    }
}

/// The probe's storage section: the model's device, its block sizes and direct-I/O alignment.
fn describe_storage(o: &mut String, p: &HardwareProbe) {
    let _ = writeln!(o, "storage");
    match &p.storage {
        Some(s) if s.disk.is_some() => {
            let _ = writeln!(
                o,
                "  device: {}{} ({})",
                s.disk.as_deref().unwrap_or("?"),
                s.partition.as_deref().map(|p| format!(", partition {p}")).unwrap_or_default(),
                s.medium.name()
            );
            let _ = writeln!(
                o,
                "  blocks: logical {} B, physical {} B, optimal I/O {} B, max request {}, rotational {}",
                opt(s.logical_block),
                opt(s.physical_block),
                opt(s.optimal_io),
                s.max_request.map_or("unknown".into(), |b| format!("{} KiB", b >> 10)),
                opt(s.rotational)
            );
            let _ = writeln!(
                o,
                "  direct I/O alignment: {}",
                s.dio.map_or("not reported (statx DIOALIGN needs a file, Linux 6.1+ and file-system support); using the logical block size".into(), |d| format!(
                    "memory {} B, offset {} B (statx DIOALIGN)",
                    d.memory, d.offset
                ))
            );
        }
        _ => {
            let _ = writeln!(o, "  device: none (not on a block device: tmpfs, overlay or network)");
        }
    }
}

/// The probe's thermal section.
fn describe_thermal(o: &mut String, p: &HardwareProbe) {
    let _ = writeln!(o, "thermal");
    if p.thermal.zones.is_empty() {
        let _ = writeln!(o, "  zones: none");
    }
    for z in &p.thermal.zones {
        let _ = writeln!(o, "  {}: {:.1} °C", z.kind, z.celsius);
    }
    if let Some(t) = p.thermal.throttled {
        let c = t.conditions();
        let _ = writeln!(o, "  throttled: {:#x} ({})", t.0, if c.is_empty() { "none".into() } else { c.join(", ") });
    }
}

/// The values a run takes from the resolved profile.
pub fn describe_resolved(r: &ResolvedBoard) -> String {
    let mut o = String::new();
    let s = &r.selected;
    let _ = writeln!(o, "profile: {} \"{}\" ({}): {}", s.id, s.profile.name, s.origin, s.reason);
    let _ = writeln!(
        o,
        "  compute cores: {}  ({} threads: {})",
        cpulist::format(&r.compute_cores),
        r.threads.value,
        r.threads.source
    );
    let _ = writeln!(o, "  thread pool: priority {:?}, poll {}, strict_cpu {}", r.priority, r.poll, r.strict_cpu);
    let _ = writeln!(o, "  I/O cores: {}", cpulist::format(&r.io_cores));
    let _ = writeln!(o, "  read size: {} KiB ({})", r.read_bytes.value >> 10, r.read_bytes.source);
    let _ = writeln!(o, "  lanes: {} ({})", r.lanes.value, r.lanes.source);
    let _ = writeln!(o, "  direct I/O: {}", if r.direct_io { "on" } else { "off" });
    let _ = writeln!(o, "  verify reads: {}", if r.verify { "on (checksum sidecar)" } else { "off" });
    let _ = writeln!(o, "  overlap: {} ({})", r.overlap.value.name(), r.overlap.source);
    let draft = match r.draft.value {
        Draft::Off => "off",
        Draft::Ngram => "ngram",
    };
    let _ = writeln!(o, "  draft: {draft} ({})", r.draft.source);
    let _ = writeln!(
        o,
        "  expert slots: {}",
        if r.expert_slots { "on (a pool committed at open)" } else { "off (fresh pages per read)" }
    );
    let _ = writeln!(
        o,
        "  lookahead: {}",
        if r.lookahead { "on (next layer's guessed experts read early)" } else { "off" }
    );
    if let Some(mbps) = r.pace_mbps {
        let _ = writeln!(o, "  reads paced to {mbps} MB/s (--pace-mbps)");
    }
    let _ = writeln!(o, "  expert cache policy: {} ({})", r.cache_policy.value, r.cache_policy.source);
    let _ = writeln!(o, "  KV cache types: {}", r.kv.describe());
    let _ = writeln!(o, "  budget: {} ({})", mib(r.budget.value), r.budget.source);
    let _ = writeln!(
        o,
        "  compute service: {}",
        match r.compute {
            ComputeService::Cpu => "cpu (ggml thread pool)".to_string(),
            ComputeService::Cuda { n_gpu_layers } =>
                format!("cuda ({n_gpu_layers} layers offloaded, experts streamed into CPU memory)"),
        }
    );
    let _ = writeln!(o, "  extension work: {}", r.compute_via);
    if let Some(arch) = &s.profile.build.ggml_cpu_arm_arch {
        let _ = writeln!(o, "  build: GGML_CPU_ARM_ARCH={arch}");
    }
    for n in &r.notes {
        let _ = writeln!(o, "  note: {n}");
    }
    o
}

/// `sluice boards`: every built-in profile with what it matches.
pub fn list_profiles() -> String {
    let mut o = format!("{:<15} {:<32} {:<8} {}\n", "id", "name", "RAM", "matches (device-tree compatible)");
    for (id, text) in BUILTIN {
        match BoardProfile::parse(text, id) {
            Ok(p) => {
                let _ = writeln!(
                    o,
                    "{:<15} {:<32} {:<8} {}",
                    id,
                    p.name,
                    p.identity.ram_gib.map_or("-".into(), |g| format!("{g} GiB")),
                    if p.identity.compatible.is_empty() {
                        "(chosen by id only)".into()
                    } else {
                        p.identity.compatible.join(", ")
                    }
                );
            }
            Err(e) => {
                let _ = writeln!(o, "{id:<15} (broken: {e})");
            }
        }
    }
    o
}
