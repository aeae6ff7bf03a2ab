//! `/api/pull` and `/api/delete`: models fetched into the store and removed from it, as Ollama's
//! clients (Home Assistant, Open WebUI) drive them. A pull streams Ollama's progress lines
//! (`status`, and `digest`, `total`, `completed` while a file comes) and fetches only from the
//! hosts the settings name; it is refused when pulling is off, when the host does not have the
//! name, when the model is over the size the settings allow or over the free space.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::json_response;
use super::models::ModelBody;
use crate::pull::progress::Progress;
use crate::pull::{self, Planned, PullError};
use crate::serve::error::ApiError;
use crate::serve::http::{streamed, Body, EventSource, Front};
use crate::serve::shared::Shared;
use crate::store::ModelName;

/// How often a file's progress line is sent at most.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// The status a pull error gets before its stream starts.
fn status_of(e: &PullError) -> u16 {
    match e {
        PullError::Name(_) | PullError::Quant(_) | PullError::TooBig { .. } => 400,
        PullError::NotFound { .. } => 404,
        PullError::Denied { .. } => 403,
        PullError::NoSpace { .. } => 507,
        _ => 502,
    }
}

/// `POST /api/pull`.
pub async fn pull(front: &Front, body: ModelBody) -> Result<Response<Body>, ApiError> {
    let shared = Arc::clone(front.shared());
    let Some(name) = body.name().filter(|n| !n.is_empty()).map(str::to_string) else {
        return Err(ApiError::invalid("model is required", Some("model")));
    };
    let Some(settings) = shared.shelf.pull_settings().cloned() else {
        return Err(ApiError::new(
            403,
            "permission_error",
            "pulling is switched off on this server (pull = false in its settings)",
        ));
    };
    let parsed = ModelName::parse(&name).map_err(|e| ApiError::invalid(e.to_string(), Some("model")))?;
    let stream = body.stream != Some(false);
    if shared.shelf.find(&name).is_some() || names_current(&shared, &name) {
        return Ok(done(stream, vec![json!({"status": "pulling manifest"}), json!({"status": "success"})]));
    }
    let store = shared.shelf.store().clone();
    let planning = {
        let (store, settings) = (store.clone(), settings.clone());
        on_thread(move || {
            let planned = pull::plan(&store, &parsed, &settings)?;
            pull::check_room(&planned, &settings)?;
            Ok::<_, PullError>(planned)
        })
        .await?
    };
    let planned = planning.map_err(|e| ApiError::new(status_of(&e), "invalid_request_error", e.to_string()))?;
    if !shared.shelf.start_pull(&name) {
        return Err(ApiError::new(409, "invalid_request_error", format!("a pull of {name} is already running")));
    }
    let (tx, rx) = unbounded_channel();
    let _ = tx.send(line(&json!({"status": "pulling manifest"})));
    let thread = std::thread::Builder::new().name("sluice-pull".into()).spawn({
        let shared = Arc::clone(&shared);
        move || run(&shared, &name, &store, &planned, &settings, tx)
    });
    if let Err(e) = thread {
        return Err(ApiError::new(500, "server_error", format!("cannot start the pull: {e}")));
    }
    if stream {
        return Ok(streamed(LineBody(rx), "application/x-ndjson"));
    }
    let last = last_line(rx).await;
    match last.get("error").and_then(Value::as_str) {
        Some(e) => Err(ApiError::new(500, "server_error", e.to_string())),
        None => Ok(json_response(200, last.to_string())),
    }
}

/// Runs `work` (network requests: it may take as long as the host's answers) on a thread of its
/// own, not the front's parser.
async fn on_thread<R: Send + 'static>(work: impl FnOnce() -> R + Send + 'static) -> Result<R, ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("sluice-pull-plan".into())
        .spawn(move || {
            let _ = tx.send(work());
        })
        .map_err(|e| ApiError::new(500, "server_error", format!("cannot start the pull: {e}")))?;
    rx.await.map_err(|_| ApiError::new(500, "server_error", "the pull's planning stopped"))
}

/// Whether `name` is the served model's name (it may not be in the store: a file given by path).
fn names_current(shared: &Shared, name: &str) -> bool {
    let id = shared.model_id();
    name == super::models::listed_name(&id) || crate::serve::model_card::names_served(name, &id)
}

/// The last line a pull sent (its result).
async fn last_line(mut rx: UnboundedReceiver<Bytes>) -> Value {
    let mut last = Value::Null;
    while let Some(b) = rx.recv().await {
        last = serde_json::from_slice(&b).unwrap_or(Value::Null);
    }
    last
}

/// Runs the pull on its own thread, sending progress lines, and ends the stream with `success`
/// or `{"error": ...}`.
fn run(
    shared: &Shared,
    name: &str,
    store: &crate::store::Store,
    planned: &Planned,
    settings: &pull::PullSettings,
    tx: UnboundedSender<Bytes>,
) {
    let digests = planned.files.iter().map(|f| (f.label.clone(), f.sha256.clone())).collect();
    let progress = ProgressLines { tx: tx.clone(), digests, files: Mutex::new(HashMap::new()) };
    let result = pull::pull_planned(store, planned, settings, &progress, Instant::now());
    shared.shelf.end_pull(name);
    let last = match result {
        Ok(report) => {
            log::info!("pulled {} ({} bytes fetched)", report.model.name, report.fetched);
            let _ = tx.send(line(&json!({"status": "verifying sha256 digest"})));
            let _ = tx.send(line(&json!({"status": "writing manifest"})));
            json!({"status": "success"})
        }
        Err(e) => {
            log::warn!("pull of {name} failed: {e}");
            json!({"error": e.to_string()})
        }
    };
    let _ = tx.send(line(&last));
}

fn line(v: &Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

fn done(stream: bool, lines: Vec<Value>) -> Response<Body> {
    if !stream {
        return json_response(200, lines.last().cloned().unwrap_or(Value::Null).to_string());
    }
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let mut r = Response::new(Body::full(Bytes::from(text)));
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/x-ndjson"));
    r
}

/// A pull's lines as a response body.
struct LineBody(UnboundedReceiver<Bytes>);

impl EventSource for LineBody {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        self.0.poll_recv(cx)
    }
}

/// A pull's progress as Ollama's lines: `pulling <digest>` with the bytes so far, at most every
/// [`PROGRESS_EVERY`] a file.
struct ProgressLines {
    tx: UnboundedSender<Bytes>,
    digests: HashMap<String, String>,
    /// Per file: size, bytes here, when its last line went.
    files: Mutex<HashMap<String, (u64, u64, Instant)>>,
}

impl ProgressLines {
    fn send(&self, label: &str, total: u64, completed: u64) {
        let hex = self.digests.get(label).map_or("", String::as_str);
        let _ = self.tx.send(line(&json!({
            "status": format!("pulling {}", &hex[..12.min(hex.len())]),
            "digest": format!("sha256:{hex}"),
            "total": total,
            "completed": completed,
        })));
    }
}

impl Progress for ProgressLines {
    fn file_start(&self, label: &str, size: u64, have: u64) {
        self.files.lock().unwrap_or_else(|p| p.into_inner()).insert(label.into(), (size, have, Instant::now()));
        self.send(label, size, have);
    }

    fn advance(&self, label: &str, bytes: u64) {
        let due = {
            let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
            let Some((size, done, last)) = files.get_mut(label) else { return };
            *done += bytes;
            let due = last.elapsed() >= PROGRESS_EVERY;
            if due {
                *last = Instant::now();
            }
            due.then_some((*size, *done))
        };
        if let Some((size, done)) = due {
            self.send(label, size, done);
        }
    }

    fn file_done(&self, label: &str) {
        let size = self.files.lock().unwrap_or_else(|p| p.into_inner()).get(label).map_or(0, |f| f.0);
        self.send(label, size, size);
    }

    fn note(&self, text: &str) {
        log::info!("pull: {text}");
    }
}

/// `DELETE /api/delete`: removes a stored model that is not the one loaded.
pub fn delete(shared: &Shared, body: &ModelBody) -> Result<Response<Body>, ApiError> {
    let Some(name) = body.name().filter(|n| !n.is_empty()) else {
        return Err(ApiError::invalid("model is required", Some("model")));
    };
    let being_served = || {
        ApiError::invalid(format!("model '{name}' is the one being served; load another model first"), Some("model"))
    };
    if names_current(shared, name) {
        return Err(being_served());
    }
    let Some(found) = shared.shelf.find(name) else {
        return Err(ApiError::new(404, "not_found_error", format!("model '{name}' not found")));
    };
    if found.path == shared.shelf.current().path {
        return Err(being_served());
    }
    shared.shelf.store().remove(&found.name).map_err(|e| ApiError::new(500, "server_error", e))?;
    log::info!("deleted {name}");
    Ok(json_response(200, String::new()))
}
