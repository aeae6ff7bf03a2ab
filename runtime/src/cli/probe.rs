//! `sluice probe` (what the hardware probe finds and what the profile resolves to, optionally
//! measuring storage throughput) and `sluice boards` (the built-in profiles).

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;

use sluice::board::{self, BoardChoice};
use sluice_hal::root::SysRoot;
use sluice_hal::storage::{measure_direct_read, StorageProbe};

use super::args::TuningArgs;

/// `sluice probe` arguments.
#[derive(Args)]
pub struct ProbeArgs {
    /// Read the machine's facts under this directory instead of / (a saved or fake tree).
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// Size reads for the storage this model file is on (default: the root file system's).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Measure O_DIRECT read throughput of this file at the resolved read size and lanes.
    #[arg(long, value_name = "FILE")]
    io: Option<PathBuf>,
    /// With --io: read at most this many MiB of the file.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    io_mib: u64,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// Runs `sluice probe`.
pub fn run_probe(a: &ProbeArgs, choice: &BoardChoice) -> Result<()> {
    let root = SysRoot::new(&a.root);
    let storage_file = a.model.as_deref().or(a.io.as_deref());
    if let Some(f) = storage_file {
        let meta = std::fs::metadata(f).with_context(|| format!("{}: cannot read it", f.display()))?;
        anyhow::ensure!(
            meta.is_file(),
            "{} is not a regular file (a directory, FIFO or device): give a model or another file on the storage to measure",
            f.display()
        );
    }
    let (probe, resolved) = board::probe_and_resolve(&root, choice, storage_file, &a.tuning.overrides());
    out!("{}", board::describe_probe(&probe));
    outln!("ggml");
    outln!("  backends: {}", ggml_sys::backends().join(", "));
    let gpu = ggml_sys::supports_gpu_offload();
    outln!("  GPU offload: {}", if gpu { "yes" } else { "no (this build has no CUDA, or its driver finds no GPU)" });
    for s in ggml_sys::extension_services() {
        outln!("  {}: {}", s.name, s.backend.map_or("absent".to_string(), |b| format!("present ({b})")));
    }
    outln!(
        "  compute services this build can run: {}",
        if gpu { "cpu, cuda" } else { "cpu (a `--features cuda` build on the board adds cuda)" }
    );
    let resolved = resolved?;
    out!("{}", board::describe_resolved(&resolved));
    if let Some(file) = &a.io {
        let align = StorageProbe::for_file(&SysRoot::default(), file).map_or(4096, |s| s.direct_alignment()) as usize;
        if let Err(e) = sluice_hal::storage::drop_cached(file) {
            log::warn!("cannot drop {} from the page cache: {e}", file.display());
        }
        let t = measure_direct_read(
            file,
            resolved.read_bytes.value as usize,
            resolved.lanes.value as usize,
            align,
            a.io_mib << 20,
        )
        .with_context(|| format!("reading {}", file.display()))?;
        outln!(
            "io: {} MiB of {} in {:.2} s = {:.1} MiB/s ({}, {} KiB requests, {} lanes, {} B alignment)",
            t.bytes >> 20,
            file.display(),
            t.elapsed.as_secs_f64(),
            t.mib_per_s(),
            if t.direct { "O_DIRECT" } else { "buffered: O_DIRECT refused" },
            resolved.read_bytes.value >> 10,
            resolved.lanes.value,
            align
        );
    }
    Ok(())
}

/// Runs `sluice boards`.
pub fn run_boards() {
    out!("{}", board::list_profiles());
}
