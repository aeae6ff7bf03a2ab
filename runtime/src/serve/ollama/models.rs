//! Ollama's model endpoints for the one served model: `/api/tags`, `/api/ps`, `/api/show`,
//! `/api/pull` (the served model is already here), `/api/version`, and the model management a
//! single-model server does not do.

use std::time::SystemTime;

use serde::Deserialize;
use serde_json::{json, Value};

use super::check_model;
use super::reply::timestamp;
use crate::serve::error::ApiError;
use crate::serve::model_card::ModelCard;
use crate::serve::shared::Shared;
use crate::serve::shelf::ModelChoice;
use std::sync::Arc;

/// The Ollama API version this server answers as: clients check it against the features they
/// use (Open WebUI, for one, wants a number).
pub const VERSION: &str = "0.12.6";

/// The error for an endpoint a single-model server cannot serve: `path`, where it would do
/// `what`.
pub fn unsupported(path: &str, what: &str) -> ApiError {
    ApiError::new(
        501,
        "invalid_request_error",
        format!("{path}: sluice serves one model from its GGUF file and does not support {what}; the model is chosen with `sluice serve --model`"),
    )
}

/// The name `/api/tags` lists the served model under: its id, with `:latest` when it has no tag.
pub fn listed_name(id: &str) -> String {
    if id.contains(':') {
        id.to_string()
    } else {
        format!("{id}:latest")
    }
}

fn card(shared: &Shared) -> Result<std::sync::Arc<ModelCard>, ApiError> {
    shared.loaded().map(|(card, _)| card)
}

fn details(card: &ModelCard) -> Value {
    json!({
        "parent_model": "", "format": "gguf", "family": card.architecture, "families": [card.architecture],
        "parameter_size": card.parameter_size(), "quantization_level": card.quantization
    })
}

/// The served model as `/api/tags` and `/api/ps` list it.
fn listed(shared: &Shared, card: &ModelCard) -> Value {
    let name = listed_name(&shared.model_id());
    json!({
        "name": name, "model": name, "modified_at": timestamp(card.modified), "size": card.size,
        "digest": card.digest, "details": details(card)
    })
}

/// `GET /api/tags`: the served model, then every other stored model.
pub fn tags(shared: &Shared) -> Result<Value, ApiError> {
    let mut models: Vec<Value> = card(shared).ok().map(|c| listed(shared, &c)).into_iter().collect();
    for m in shared.shelf.others() {
        let Some(d) = shared.shelf.describe(&m.path) else { continue };
        models.push(json!({
            "name": m.name, "model": m.name, "modified_at": timestamp(d.modified), "size": m.bytes, "digest": d.digest,
            "details": {
                "parent_model": "", "format": "gguf", "family": d.architecture, "families": [d.architecture],
                "parameter_size": "", "quantization_level": d.quantization
            }
        }));
    }
    Ok(json!({"models": models}))
}

/// `GET /api/ps`: the model while it is in memory (not before it is loaded, nor once a client
/// unloaded it with `keep_alive: 0`); it stays there until then.
pub fn ps(shared: &Shared) -> Result<Value, ApiError> {
    if !shared.resident() {
        return Ok(json!({"models": []}));
    }
    let card = card(shared)?;
    let mut m = listed(shared, &card);
    m["expires_at"] = json!(timestamp(SystemTime::now() + std::time::Duration::from_secs(100 * 365 * 86_400)));
    m["size_vram"] = json!(0);
    m["context_length"] = json!(card.context);
    Ok(json!({"models": [m]}))
}

/// The body of `/api/show` and `/api/pull`: the model (`name` is its older spelling).
#[derive(Debug, Deserialize)]
pub struct ModelBody {
    model: Option<String>,
    name: Option<String>,
    /// `/api/show`: more detail (accepted; the answer is the same).
    verbose: Option<bool>,
    /// `/api/pull`: JSON lines of progress (the default) or one object.
    pub stream: Option<bool>,
    /// `/api/pull`: a registry without TLS (accepted; nothing is fetched).
    insecure: Option<bool>,
}

impl ModelBody {
    /// The model named.
    pub fn name(&self) -> Option<&str> {
        self.model.as_deref().or(self.name.as_deref())
    }
}

/// The model `/api/show` names.
pub enum ShowTarget {
    /// The served one.
    Served(Arc<ModelCard>),
    /// Another model the server may load (described from its file).
    Other(ModelChoice),
}

/// What `/api/show` is asked about.
pub fn show_target(shared: &Shared, body: &ModelBody) -> Result<ShowTarget, ApiError> {
    let _ = (body.verbose, body.insecure);
    let (_, choice) = check_model(shared, body.name())?;
    if choice.path == shared.shelf.current().path {
        card(shared).map(ShowTarget::Served)
    } else {
        Ok(ShowTarget::Other(choice))
    }
}

/// `POST /api/show` of the model described by `card` and named `id`.
pub fn show(id: &str, card: &ModelCard) -> Result<Value, ApiError> {
    let mut capabilities = vec!["completion", "tools"];
    if card.thinks {
        capabilities.push("thinking");
    }
    let arch = &card.architecture;
    let mut info = card.info.clone();
    info.insert("general.architecture".into(), json!(arch));
    info.insert("general.parameter_count".into(), json!(card.parameters));
    info.insert(format!("{arch}.context_length"), json!(card.trained_context));
    let basename = card.info.get("general.basename").and_then(Value::as_str).unwrap_or(id);
    info.insert("general.basename".into(), json!(basename));
    // The served context, as a Modelfile's PARAMETER line (the file's path is the board's own).
    let parameters = format!("num_ctx {}", card.context);
    let name = listed_name(id);
    Ok(json!({
        "license": card.info.get("general.license").cloned().unwrap_or(json!("")),
        "modelfile": format!("# Modelfile generated by sluice\nFROM {name}\nPARAMETER {parameters}\n"),
        "parameters": parameters,
        "template": card.template,
        "details": details(card),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": timestamp(card.modified),
    }))
}
