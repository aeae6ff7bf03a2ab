//! `sluice verify`: writes a model's checksum sidecar, or checks the model against it.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use sluice::stream::checksums;
use sluice::units::mib;

/// `sluice verify` arguments.
#[derive(Args)]
pub struct VerifyArgs {
    /// The model: a .gguf file (for a split model, its first file), or a stored model's name.
    #[arg(short, long, value_parser = super::args::model)]
    model: PathBuf,
    /// Re-read the model and compare it with the sidecar instead of writing one: lists every
    /// expert and tensor whose bytes changed; exit 1 when any did.
    #[arg(long)]
    check: bool,
}

/// Runs `sluice verify`.
pub fn run_verify(a: &VerifyArgs) -> Result<()> {
    sluice::metadata::check_model_file(&a.model)?;
    let sidecar = checksums::sidecar_of(&a.model);
    let t0 = std::time::Instant::now();
    if !a.check {
        let report = checksums::write(&a.model)?;
        outln!(
            "wrote {}: {} checksums over {:.1} MiB in {:.1} s; run with --verify (or storage.verify = true) to check every read against it",
            sidecar.display(),
            report.sums,
            mib(report.bytes),
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let report = checksums::check(&a.model)?;
    for m in &report.mismatches {
        outln!("damaged: {m}");
    }
    outln!(
        "checked {} checksums over {:.1} MiB in {:.1} s against {}: {}",
        report.sums,
        mib(report.bytes),
        t0.elapsed().as_secs_f64(),
        sidecar.display(),
        if report.mismatches.is_empty() {
            "all match".to_string()
        } else {
            format!("{} damaged", report.mismatches.len())
        }
    );
    if !report.mismatches.is_empty() {
        anyhow::bail!(
            "{}: {} of {} checksums do not match: the storage returned damaged data, or the file was changed; restore it from a good copy",
            a.model.display(),
            report.mismatches.len(),
            report.sums
        );
    }
    Ok(())
}
