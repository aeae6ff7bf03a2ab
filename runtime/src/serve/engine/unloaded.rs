//! A model unloaded at a client's word (Ollama's `keep_alive: 0`): its memory (weights, expert
//! cache, slots) is given back; the front keeps its description and text tools (the tokenizer
//! and templates of the file's metadata alone, a few MiB); the next generation, slot action or
//! load request loads it again, and a generation waits for that load.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;

use anyhow::{Context as _, Result};
use ggml_sys::{Model, ModelParams};

use super::prompt::Tokenizer;
use super::EngineConfig;
use crate::serve::job::Job;
use crate::serve::model_card::ModelCard;
use crate::serve::shared::{Shared, IDLE_BEAT};
use crate::systemd::notify;

/// What ends the wait of an unloaded model.
pub(super) enum Wake {
    /// A generation, to run first once the model is loaded again.
    Job(Box<Job>),
    /// A load request or a slot action.
    Asked,
    /// Every sender is gone: the server stops.
    Done,
}

/// Waits, with the model unloaded, for what loads it again; `card` stays the front's model
/// description meanwhile.
pub(super) fn wait(
    cfg: &EngineConfig,
    shared: &Shared,
    jobs: &Receiver<Job>,
    card: Option<Arc<ModelCard>>,
) -> Result<Wake> {
    let path = &cfg.launch.model;
    let metadata = Model::load(path, &ModelParams { metadata_only: true, ..Default::default() })
        .with_context(|| format!("cannot read the metadata of {} again", path.display()))?;
    let tokenizer = Tokenizer::start(Arc::new(metadata))?;
    if let Some(card) = card {
        shared.set_loaded(Some((card, tokenizer.tools())));
    }
    let status = "idle: the model is unloaded (keep_alive 0); the next request loads it again";
    log::info!("{status}");
    notify::status(status);
    let _ = shared.take_load();
    loop {
        shared.beat();
        if shared.take_load() || shared.slot_actions.pending() {
            return Ok(Wake::Asked);
        }
        match jobs.recv_timeout(IDLE_BEAT) {
            Ok(job) => return Ok(Wake::Job(Box::new(job))),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Ok(Wake::Done),
        }
    }
}
