//! Ollama's model endpoints for the one served model: `/api/tags`, `/api/ps`, `/api/show`,
//! `/api/pull` (the served model is already here), `/api/version`, and the model management a
//! single-model server does not do.

use std::time::SystemTime;

use bytes::Bytes;
use hyper::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use super::reply::timestamp;
use super::{check_model, json_response};
use crate::serve::error::ApiError;
use crate::serve::http::Body;
use crate::serve::model_card::ModelCard;
use crate::serve::shared::Shared;

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
    let name = listed_name(&shared.model_id);
    json!({
        "name": name, "model": name, "modified_at": timestamp(card.modified), "size": card.size,
        "digest": card.digest, "details": details(card)
    })
}

/// `GET /api/tags`.
pub fn tags(shared: &Shared) -> Result<Value, ApiError> {
    Ok(json!({"models": [listed(shared, &*card(shared)?)]}))
}

/// `GET /api/ps`: the model stays loaded while the server runs.
pub fn ps(shared: &Shared) -> Result<Value, ApiError> {
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
    stream: Option<bool>,
    /// `/api/pull`: a registry without TLS (accepted; nothing is fetched).
    insecure: Option<bool>,
}

impl ModelBody {
    fn name(&self) -> Option<&str> {
        self.model.as_deref().or(self.name.as_deref())
    }
}

/// `POST /api/show`.
pub fn show(shared: &Shared, body: &ModelBody) -> Result<Value, ApiError> {
    let _ = (body.verbose, body.insecure);
    check_model(shared, body.name())?;
    let card = card(shared)?;
    let mut capabilities = vec!["completion", "tools"];
    if card.thinks {
        capabilities.push("thinking");
    }
    let arch = &card.architecture;
    let mut info = serde_json::Map::new();
    info.insert("general.architecture".into(), json!(arch));
    info.insert("general.parameter_count".into(), json!(card.parameters));
    info.insert(format!("{arch}.context_length"), json!(card.trained_context));
    Ok(json!({
        "license": "",
        "modelfile": format!("# served by sluice\nFROM {}\n", card.path.display()),
        "parameters": "",
        "template": card.template,
        "details": details(&card),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": timestamp(card.modified),
    }))
}

/// `POST /api/pull`: the served model is here already (Home Assistant pulls the model it was
/// given when `/api/tags` does not list it); any other is a clear error.
pub fn pull(shared: &Shared, body: &ModelBody) -> Result<Response<Body>, ApiError> {
    check_model(shared, body.name()).map_err(|e| {
        ApiError::new(
            404,
            "not_found_error",
            format!("{}; sluice cannot download models: it serves the GGUF file it was started with", e.message),
        )
    })?;
    let card = card(shared)?;
    if body.stream == Some(false) {
        return Ok(json_response(200, json!({"status": "success"}).to_string()));
    }
    let lines = [
        json!({"status": "pulling manifest"}),
        json!({"status": format!("pulling {}", &card.digest[..12.min(card.digest.len())]), "digest": format!("sha256:{}", card.digest), "total": card.size, "completed": card.size}),
        json!({"status": "verifying sha256 digest"}),
        json!({"status": "writing manifest"}),
        json!({"status": "success"}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let mut r = Response::new(Body::full(Bytes::from(text)));
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/x-ndjson"));
    Ok(r)
}
