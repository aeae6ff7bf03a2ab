//! Boards: profiles (`boards/*.toml`, compiled in), choosing one for the probed machine, and
//! resolving it into the cores, reads, budget and compute service a run uses.

mod builtin;
mod caps;
pub mod profile;
mod report;
pub mod resolve;
pub mod select;
mod service;

use std::path::PathBuf;

pub use builtin::BUILTIN;
pub use caps::BuildCaps;
pub use profile::{BoardProfile, Draft, Overlap};
pub use report::{describe_probe, describe_resolved, list_profiles};
pub use resolve::{resolve, ComputeService, Overrides, ResolvedBoard};
pub use select::{select, BoardChoice, SelectedBoard};

use sluice_hal::probe::HardwareProbe;
use sluice_hal::root::SysRoot;

/// Errors of choosing and resolving a board profile. Each names the profile and the field.
#[derive(Debug, thiserror::Error)]
pub enum BoardError {
    /// The TOML does not parse or has a wrong or unknown field.
    #[error("{origin}: {message}\n(the fields and their units are listed in boards/README.md)")]
    Parse {
        /// The profile.
        origin: String,
        /// The parser's message (it names the field and line).
        message: String,
    },
    /// A field's value is out of range.
    #[error("{origin}: {field}: {fix}")]
    Field {
        /// The profile.
        origin: String,
        /// The field.
        field: String,
        /// What to do.
        fix: String,
    },
    /// A profile file cannot be read.
    #[error("board profile {path}: {message} (give a profile file, a built-in id — see `sluice boards` — or auto)")]
    Read {
        /// The path.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// No built-in profile has this id.
    #[error("no built-in board profile {id:?} (known: {known}); give one of those, a .toml file, or auto")]
    UnknownId {
        /// The id given.
        id: String,
        /// The ids there are.
        known: String,
    },
    /// A core this machine does not have.
    #[error("{origin}: {field} names CPU {core}, which this machine does not have (possible CPUs: {possible}); list cores from {possible}, or remove the field")]
    NoSuchCore {
        /// The profile.
        origin: String,
        /// The field.
        field: String,
        /// The core.
        core: usize,
        /// The machine's possible CPUs.
        possible: String,
    },
    /// None of the listed cores is online and allowed.
    #[error("{origin}: none of {field} is online and allowed for this process (usable: {usable}); list usable cores")]
    NoUsableCore {
        /// The profile.
        origin: String,
        /// The field.
        field: String,
        /// What could be used.
        usable: String,
    },
    /// The budget is more than the machine's RAM.
    #[error("{origin}: memory.budget_mib = {budget_mib} is more than this machine's RAM ({ram_mib} MiB); lower it, or remove it to use MemTotal minus memory.reserve_mib")]
    BudgetOverRam {
        /// The profile.
        origin: String,
        /// The budget asked for.
        budget_mib: u64,
        /// MemTotal.
        ram_mib: u64,
    },
    /// No MemTotal under the probed root.
    #[error("{}: no MemTotal in proc/meminfo; cannot size a memory budget", root.display())]
    NoMemInfo {
        /// The root probed.
        root: PathBuf,
    },
    /// Overlap asked for in a build without the CPU extension service its kernel runs on.
    #[error("{origin}: overlap asked for ({asked_by}) but this build's ggml lacks the CPU extension service (ggml_ext_cpu_parallel_v1, vendor patch 0005); run vendor/sync and rebuild, or turn overlap off")]
    NoOverlap {
        /// The profile.
        origin: String,
        /// Who asked.
        asked_by: String,
    },
    /// CUDA asked for, not available, no fallback allowed.
    #[error("{origin}: compute.service = \"cuda\" but this sluice was built without CUDA; build with `--features cuda` on the board (or in NVIDIA's JetPack container), or set compute.cpu_fallback = true to run on the CPU")]
    NoCuda {
        /// The profile.
        origin: String,
    },
    /// CUDA built in, but its ggml lacks the extension services the cuda service runs through.
    #[error("{origin}: compute.service = \"cuda\" but this build's ggml has no ggml_ext_cuda_device_v1 service (vendor patch 0005); rebuild after vendor/sync")]
    NoCudaService {
        /// The profile.
        origin: String,
    },
}

/// Probes the machine under `root`, chooses the profile, and resolves it. `model` is the file
/// whose storage sizes the reads (else the root file system's device).
pub fn board_for(
    root: &SysRoot,
    choice: &BoardChoice,
    model: Option<&std::path::Path>,
    overrides: &Overrides,
) -> Result<(HardwareProbe, ResolvedBoard), BoardError> {
    let (probe, resolved) = probe_and_resolve(root, choice, model, overrides);
    Ok((probe, resolved?))
}

/// The hardware probe, always, and the profile resolved against it (or why it cannot be): what
/// `sluice probe` shows even when the profile does not fit this build or board.
pub fn probe_and_resolve(
    root: &SysRoot,
    choice: &BoardChoice,
    model: Option<&std::path::Path>,
    overrides: &Overrides,
) -> (HardwareProbe, Result<ResolvedBoard, BoardError>) {
    let probe = HardwareProbe::run(root, model);
    let resolved = resolve_probed(root, choice, &probe, overrides);
    (probe, resolved)
}

fn resolve_probed(
    root: &SysRoot,
    choice: &BoardChoice,
    probe: &HardwareProbe,
    overrides: &Overrides,
) -> Result<ResolvedBoard, BoardError> {
    let selected = select(choice, &probe.identity)?;
    let allowed = if root.is_real() { sluice_hal::cpu::allowed_cpus().ok() } else { None };
    let resolved = resolve(selected, probe, overrides, allowed.as_deref(), BuildCaps::of_this_build())?;
    log::info!("board profile {} ({}): {}", resolved.selected.id, resolved.selected.origin, resolved.selected.reason);
    for note in &resolved.notes {
        log::warn!("board {}: {note}", resolved.selected.id);
    }
    Ok(resolved)
}
