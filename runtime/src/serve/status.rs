//! sluice's own endpoints: the chat page (`/`), the status page (`/status.html`) and what it
//! draws (`/status`), `/health` and the Prometheus `/metrics`.

use hyper::header::{self, HeaderValue};
use hyper::Response;
use serde_json::json;

use super::http::{json_response, Body};
use super::shared::Shared;
use super::state::State;

/// The chat page at `/`: one self-contained HTML file that talks to `/v1/chat/completions`.
const CHAT_PAGE: &str = include_str!("chat.html");
/// The status page at `/status.html`: one self-contained HTML file that draws `GET /status`.
const STATUS_PAGE: &str = include_str!("status.html");
/// What the pages may load and do: their own inline script and style, and requests to this
/// server; nothing from elsewhere (a board may be offline), and no framing.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// The chat page.
pub fn chat_page() -> Response<Body> {
    page(CHAT_PAGE)
}

/// The status page.
pub fn status_page() -> Response<Body> {
    page(STATUS_PAGE)
}

/// One of the self-contained pages.
fn page(html: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::full(html));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(PAGE_POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// `/status`: what the status page draws (the metrics' summary, the state, the queue).
pub fn status(shared: &Shared) -> Response<Body> {
    let state = shared.state();
    let reason = (state == State::Degraded).then(|| shared.degraded_reason());
    let body = shared.metrics.status(state.as_str(), reason, &shared.model_id(), shared.queued());
    let mut r = json_response(200, body.to_string());
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// `/metrics`, in Prometheus's text format.
pub fn metrics(shared: &Shared) -> Response<Body> {
    let body = shared.metrics.render(shared.state().as_str(), shared.queued());
    let mut r = Response::new(Body::full(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

/// `/health`: 200 while ready and the engine makes progress; 503 while loading, degraded,
/// draining, or when a ready engine has made no progress for [`ENGINE_STALLED`] (one step it
/// cannot leave, such as a read stuck on storage). The body says which, whether a generation
/// runs, and how many wait.
pub fn health(shared: &Shared) -> Response<Body> {
    let state = shared.state();
    let silent = shared.engine_silent();
    let stalled = state == State::Ready && silent >= ENGINE_STALLED;
    let busy = shared.engine_busy();
    let mut body = json!({
        "status": if stalled { "stalled" } else { state.as_str() },
        "engine": if busy { "busy" } else { "idle" },
        "queued": shared.queued(),
    });
    if state == State::Degraded {
        body["reason"] = json!(shared.degraded_reason());
    }
    if busy || stalled {
        body["engine_silent_s"] = json!(silent.as_secs());
    }
    let code = if state == State::Ready && !stalled { 200 } else { 503 };
    let mut r = json_response(code, body.to_string());
    if matches!(state, State::Loading | State::Degraded) || stalled {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// How long a ready engine may go without progress before `/health` says it is stalled: half the
/// packaged unit's watchdog interval (a prompt batch streamed from an SD card can take tens of
/// seconds; the watchdog restarts the service at the whole interval).
const ENGINE_STALLED: std::time::Duration = std::time::Duration::from_secs(30);
