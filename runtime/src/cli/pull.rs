//! `sluice pull NAME` and `sluice models`: models by name, fetched into the store and listed or
//! removed there.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, ValueEnum};

use sluice::pull::progress::{Bars, Lines, Progress};
use sluice::pull::{self, PullSettings};
use sluice::store::{ModelName, Store};

use super::args::StoreArgs;

/// How progress is shown.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ProgressKind {
    /// Bars on a terminal, lines otherwise.
    Auto,
    /// Bars.
    Bars,
    /// A line per file every few seconds (for the journal and pipes).
    Lines,
}

/// `sluice pull` arguments.
#[derive(Parser)]
pub struct PullArgs {
    /// The model: owner/repo[:QUANT] or hf.co/owner/repo[:QUANT] (a Hugging Face GGUF
    /// repository; QUANT defaults to Q4_K_M), or model[:tag] (an Ollama model).
    name: String,
    #[command(flatten)]
    store: StoreArgs,
    /// The Hugging Face endpoint.
    #[arg(long, env = "HF_ENDPOINT", default_value = "https://huggingface.co")]
    hf_endpoint: String,
    /// The Ollama registry.
    #[arg(long, env = "SLUICE_OLLAMA_REGISTRY", default_value = "https://registry.ollama.ai")]
    ollama_registry: String,
    /// Ranges fetched at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=32))]
    connections: u32,
    /// Seconds without a byte after which a connection is dropped and its range tried again.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    stall_seconds: u64,
    /// Tries of a range that makes no progress before the pull gives up.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(0..=100))]
    retries: u32,
    /// How progress is shown.
    #[arg(long, value_enum, default_value_t = ProgressKind::Auto)]
    progress: ProgressKind,
    /// Skip the plan before the download (which reads each GGUF file's header first, a few
    /// MiB, to say whether the model fits the board).
    #[arg(long)]
    no_plan: bool,
    /// KiB a range (tests make ranges small to count them).
    #[arg(long, hide = true, default_value_t = 16 << 10, value_parser = clap::value_parser!(u64).range(4..=1 << 20))]
    chunk_kib: u64,
}

/// Runs `sluice pull`: says whether the model fits the board (planned from its headers alone),
/// then fetches it; it asks nothing (scripts run it).
pub fn run_pull(a: &PullArgs, choice: &sluice::board::BoardChoice) -> Result<()> {
    let name = ModelName::parse(&a.name)?;
    let store = a.store.store();
    let mut settings = PullSettings {
        hf_endpoint: a.hf_endpoint.clone(),
        ollama_registry: a.ollama_registry.clone(),
        stall: Duration::from_secs(a.stall_seconds),
        ..PullSettings::default()
    };
    settings.fetch.connections = a.connections as usize;
    settings.fetch.retries = a.retries;
    settings.fetch.chunk = a.chunk_kib << 10;
    let bars = a.progress == ProgressKind::Bars || a.progress == ProgressKind::Auto && std::io::stderr().is_terminal();
    let progress: Box<dyn Progress> =
        if bars { Box::new(Bars::new()) } else { Box::new(Lines::new(Duration::from_secs(5))) };
    let t0 = std::time::Instant::now();
    let planned = pull::plan(&store, &name, &settings)?;
    pull::check_room(&planned, &settings)?;
    if !a.no_plan && store.find(&planned.name).is_none() {
        let verdict = pull::header::fetch_headers(&planned, &settings)
            .map_err(anyhow::Error::from)
            .and_then(|copy| super::plan::verdict(choice, &copy.first, &store.hub.root));
        match verdict {
            Ok(v) => noteln!("{}: {}", planned.name, v),
            Err(e) => noteln!("{}: no plan before the download ({e})", planned.name),
        }
    }
    let report = pull::pull_planned(&store, &planned, &settings, progress.as_ref(), t0)?;
    let rate = report.fetched as f64 / report.seconds.max(1e-3);
    outln!(
        "{}: {} in {} ({} fetched in {:.1} s, {}/s); every file's sha256 checked",
        report.model.name,
        bytesize::ByteSize(report.model.bytes),
        report.model.path.display(),
        bytesize::ByteSize(report.fetched),
        report.seconds,
        bytesize::ByteSize(rate as u64)
    );
    match &report.sidecar {
        Some(s) => outln!("checksums for --verify: {}", s.display()),
        None => outln!("no checksum sidecar (see above); `sluice verify --model {}` writes one", report.model.name),
    }
    outln!(
        "run it: sluice run --model {} --prompt \"...\"   serve it: sluice serve --model {}",
        report.model.name,
        report.model.name
    );
    Ok(())
}

/// The file a `--model` value means (a path, or a stored model's name); with `pull`, a name not
/// yet stored is pulled first (as `sluice pull NAME` with its defaults, into the default store),
/// else it is an error that says to pull it.
pub fn resolve_model(model: &std::path::Path, pull: bool, choice: &sluice::board::BoardChoice) -> Result<PathBuf> {
    let store = Store::new(None, None);
    match store.resolve(model) {
        Err(sluice::store::StoreError::NotStored { name, .. }) if pull => {
            let args = PullArgs::parse_from(["pull", name.as_str()]);
            run_pull(&args, choice)?;
            Ok(store.resolve(model)?)
        }
        other => Ok(other?),
    }
}

/// `sluice models` arguments.
#[derive(Args)]
pub struct ModelsArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Remove this stored model (its files, and blobs no other stored model uses).
    #[arg(long, value_name = "NAME")]
    rm: Option<String>,
}

/// Runs `sluice models`: lists the stored models (with whether each fits this board as `sluice
/// serve` runs it by default), or removes one.
pub fn run_models(a: &ModelsArgs, choice: &sluice::board::BoardChoice) -> Result<()> {
    let store = a.store.store();
    if let Some(name) = &a.rm {
        let name = ModelName::parse(name)?;
        let freed = store.remove(&name).map_err(anyhow::Error::msg)?;
        outln!("removed {name}: {} freed", bytesize::ByteSize(freed));
        return Ok(());
    }
    let models = store.list();
    if models.is_empty() {
        outln!("no stored models (looked in {}); `sluice pull NAME` fetches one", store.places());
        return Ok(());
    }
    outln!("{:<48} {:>10} {:<10} {:<12} {:<5} FILE", "NAME", "SIZE", "QUANT", "ARCH", "FITS");
    for m in models {
        let (quant, arch) = describe(&m.path);
        let fits = match super::plan::fits(choice, &m.path) {
            Some(true) => "yes",
            Some(false) => "no",
            None => "?",
        };
        let size = bytesize::ByteSize(m.bytes).to_string();
        outln!("{:<48} {:>10} {:<10} {:<12} {:<5} {}", m.name.to_string(), size, quant, arch, fits, m.path.display());
    }
    Ok(())
}

/// A stored model's quantization (the file type its header names) and architecture.
fn describe(path: &std::path::Path) -> (String, String) {
    match ggml_sys::GgufFile::open(path) {
        Ok(g) => (
            sluice::metadata::quantization_of(&g).unwrap_or_else(|| "?".into()),
            g.architecture().unwrap_or_else(|| "?".into()),
        ),
        Err(_) => ("?".into(), "not GGUF".into()),
    }
}
