//! Another stored model at a request's word: the engine serves it in place of the current one
//! (one model at a time), keeping each model's heat map and slots apart, and goes back to the
//! one it had when the other does not load.

use std::path::{Path, PathBuf};

use super::{EngineConfig, LoadFailure};
use crate::serve::error::ApiError;
use crate::serve::job::{Event, Job};
use crate::serve::shared::Shared;
use crate::serve::shelf::ModelChoice;

/// Whether `job` runs on another model than the one at `loaded`.
pub(super) fn needs_switch(job: &Job, loaded: &Path) -> bool {
    job.request.model.as_ref().is_some_and(|m| m.path != loaded)
}

/// Where the heat map and slots of `choice` are kept: the state directory for the model the
/// server started with, a folder of its own under `models/` for each other one.
pub(super) fn state_dir_of(base: Option<&Path>, first_model: &Path, choice: &ModelChoice) -> Option<PathBuf> {
    let base = base?;
    if choice.path == first_model {
        return Some(base.to_path_buf());
    }
    let folder: String = choice
        .id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' })
        .collect();
    Some(base.join("models").join(folder))
}

/// Makes `choice` the model the engine loads next, its state kept in `state_dir`.
pub(super) fn switch(cfg: &mut EngineConfig, shared: &Shared, choice: &ModelChoice, state_dir: Option<PathBuf>) {
    log::info!("switching to {} ({})", choice.id, choice.path.display());
    if let Some(dir) = &state_dir {
        if let Err(e) = std::fs::create_dir_all(dir) {
            log::warn!("{}: {e}; {} is served without saved state", dir.display(), choice.id);
        }
    }
    cfg.launch.model = choice.path.clone();
    cfg.state_dir = state_dir;
    shared.shelf.set_current(choice.clone());
}

/// Fails the request that asked for a model that did not load; `back` is loaded again.
pub(super) fn refuse_switch(job: Option<Job>, e: &LoadFailure, back: &ModelChoice) {
    log::warn!("the model a request named did not load ({e}); loading {} again", back.id);
    if let Some(job) = job {
        let message = format!("the model could not be loaded: {e}");
        let _ = job.events.send(Event::Failed(ApiError::new(500, "server_error", message)));
    }
}
