//! Request handling: routing, access control, CORS, request bodies, and responses (JSON, or
//! server-sent events).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::net::TcpStream;

use super::body::{Body, EventStream};
use super::conn::ConnState;
use super::exchange::{enqueue, event_stream, started, whole_generation, Ended, Queued};
use super::reply::{Gathered, Kind, Reply};
use super::Front;
use crate::serve::error::ApiError;
use crate::serve::job::Piece;
use crate::serve::shared::Shared;
use crate::serve::state::State;
use crate::serve::{anthropic, api, llama_server, ollama};

/// The endpoints counted by name in the metrics (others count as `other`).
const ENDPOINTS: [&str; 30] = [
    "/",
    "/status",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
    "/api/pull",
    "/api/push",
    "/api/create",
    "/api/copy",
    "/api/delete",
    "/api/embed",
    "/api/embeddings",
    "/api/blobs",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/props",
    "/slots",
    "/status.html",
];

/// Which API a path belongs to: its errors are answered in that API's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    OpenAi,
    Anthropic,
    Ollama,
}

impl Api {
    fn of(path: &str) -> Api {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Api::Anthropic
        } else if path.starts_with("/api/") {
            Api::Ollama
        } else {
            Api::OpenAi
        }
    }

    fn error(self, e: &ApiError) -> Response<Body> {
        match self {
            Api::OpenAi => error(e),
            Api::Anthropic => error_with(e, anthropic::error_body(e)),
            Api::Ollama => error_with(e, ollama::error_body(e)),
        }
    }
}

/// The chat page at `/`: one self-contained HTML file that talks to `/v1/chat/completions`.
const CHAT_PAGE: &str = include_str!("../chat.html");
/// The status page at `/status.html`: one self-contained HTML file that draws `GET /status`.
const STATUS_PAGE: &str = include_str!("../status.html");
/// What the pages may load and do: their own inline script and style, and requests to this
/// server; nothing from elsewhere (a board may be offline), and no framing.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// Answers one request; counts it in the metrics.
pub async fn handle(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    let guard = conn.begin_request();
    let shared = front.shared();
    let path = req.uri().path().to_string();
    let endpoint = if ENDPOINTS.contains(&path.as_str()) {
        path.as_str()
    } else if path.starts_with("/v1/models/") {
        "/v1/models/{id}"
    } else if path.starts_with("/v1/responses/") {
        "/v1/responses/{id}"
    } else if path.starts_with("/slots/") {
        "/slots/{id}"
    } else {
        "other"
    };
    let api = Api::of(&path);
    let origin = req.headers().get(header::ORIGIN).cloned();
    let access = &shared.access;
    let mut response = if req.method() == Method::OPTIONS && access.cors_allows(origin.as_ref()).is_some() {
        preflight(&req)
    } else if let Err(e) =
        access.authorize(&path, req.headers().get(header::AUTHORIZATION), req.headers().get("x-api-key"))
    {
        api.error(&e)
    } else {
        match api {
            Api::OpenAi => route(req, &path, endpoint, front, tcp, conn).await,
            Api::Anthropic => anthropic::route(req, &path, front, tcp, conn).await,
            Api::Ollama => ollama::route(req, &path, front, tcp, conn).await,
        }
    };
    if let Some(allowed) = access.cors_allows(origin.as_ref()) {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
        h.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    shared.metrics.request(endpoint, response.status().as_u16());
    response.body_mut().hold(guard);
    response
}

async fn route(
    req: Request<Incoming>,
    path: &str,
    endpoint: &str,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    let shared = front.shared();
    match (req.method(), path) {
        // HEAD: Ollama's clients ask whether a server runs.
        (&Method::GET | &Method::HEAD, "/") => page(CHAT_PAGE),
        (&Method::GET, "/status.html") => page(STATUS_PAGE),
        (&Method::GET, "/status") => {
            let state = shared.state();
            let reason = (state == State::Degraded).then(|| shared.degraded_reason());
            let body = shared.metrics.status(state.as_str(), reason, &shared.model_id, shared.queued());
            let mut r = json_response(200, body.to_string());
            r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            r
        }
        (&Method::GET, "/health") => health(shared),
        (&Method::GET, "/metrics") => {
            let body = shared.metrics.render(shared.state().as_str(), shared.queued());
            let mut r = Response::new(Body::full(body));
            r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
            r
        }
        (&Method::GET, "/v1/models") => {
            let body = json!({ "object": "list", "data": [model_json(shared)] });
            json_response(200, body.to_string())
        }
        (&Method::GET, p) if p.starts_with("/v1/models/") => {
            let id = &p["/v1/models/".len()..];
            if id == shared.model_id {
                json_response(200, model_json(shared).to_string())
            } else {
                let e = ApiError::new(
                    404,
                    "invalid_request_error",
                    format!("The model `{id}` does not exist: this server serves `{}`", shared.model_id),
                )
                .with_code("model_not_found")
                .with_param("model");
                error(&e)
            }
        }
        (&Method::POST, "/v1/completions") => generate(req, front, tcp, conn, Kind::Completion).await,
        (&Method::POST, "/v1/chat/completions") => generate(req, front, tcp, conn, Kind::Chat).await,
        (&Method::POST, "/v1/responses") => super::responses::answer(req, front, tcp, conn).await,
        (_, p) if p.starts_with("/v1/responses/") => super::responses::kept(req.method(), p, shared),
        (_, p) if llama_server::PATHS.contains(&p) || p.starts_with("/slots/") => {
            llama_server::route(req, p, front, conn).await
        }
        (m, _) if endpoint != "other" => {
            error(&ApiError::new(405, "invalid_request_error", format!("{path} does not take {m}")))
        }
        _ => error(&ApiError::new(
            404,
            "not_found_error",
            format!(
                "no such endpoint: {path} (see /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, Ollama's /api/..., /tokenize, /detokenize, /apply-template, /props, /slots, /health, /metrics, /status, the chat page at / and the status page at /status.html)"
            ),
        )),
    }
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

/// `/health`: 200 while ready and the engine makes progress; 503 while loading, degraded,
/// draining, or when a ready engine has made no progress for [`ENGINE_STALLED`] (one step it
/// cannot leave, such as a read stuck on storage). The body says which, whether a generation
/// runs, and how many wait.
fn health(shared: &crate::serve::shared::Shared) -> Response<Body> {
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

/// The served model, as OpenAI's model object.
fn model_json(shared: &crate::serve::shared::Shared) -> serde_json::Value {
    json!({ "id": shared.model_id, "object": "model", "created": shared.created, "owned_by": "sluice" })
}

pub(crate) fn json_response(status: u16, body: String) -> Response<Body> {
    let mut r = Response::new(Body::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error response in OpenAI's shape (see [`error_with`]).
pub(crate) fn error(e: &ApiError) -> Response<Body> {
    error_with(e, e.body())
}

/// An error response with `body`, an API's rendering of `e`. 503 says when to retry; 401 how to
/// authenticate; a 4xx that may have left a request body unread closes the connection, so no
/// unread byte is taken for the next request.
pub(crate) fn error_with(e: &ApiError, body: String) -> Response<Body> {
    let mut r = json_response(e.status, body);
    let h = r.headers_mut();
    match e.status {
        503 => {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        401 => {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        400 | 408 | 411 | 413 => {
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        _ => {}
    }
    r
}

/// A CORS preflight from an allowed origin.
fn preflight(req: &Request<Incoming>) -> Response<Body> {
    let mut r = Response::new(Body::full(Bytes::new()));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, DELETE, OPTIONS"));
    let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        asked.unwrap_or_else(|| HeaderValue::from_static("authorization, content-type")),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    r
}

/// A generation request, answered.
async fn generate(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
    kind: Kind,
) -> Response<Body> {
    let shared = front.shared();
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let parse = |body: &[u8], shared: &Shared| {
        let request = match kind {
            Kind::Completion => api::completion_request(body, &shared.model_id)?,
            Kind::Chat => api::chat_request(body, &shared.model_id)?,
        };
        Ok((request, ()))
    };
    let (Queued { stream, include_usage, logprobs, mut events, cancel }, ()) =
        match enqueue(req, front, conn, parse).await {
            Ok(q) => q,
            Err(e) => return error(&e),
        };
    let mut gone = match started(&mut events, tcp).await {
        Ok((gone, _)) => gone,
        Err(e) => return error(&e),
    };
    let reply = Reply {
        kind,
        id: shared.new_id(&format!("{}-", kind.id_prefix())),
        created,
        model: shared.model_id.clone(),
        logprobs,
        include_usage,
    };
    if stream {
        return event_stream(EventStream::new(reply, events, cancel, gone));
    }
    let _cancel = cancel;
    let mut out = Gathered::default();
    let ended = whole_generation(&mut events, &mut gone, |piece, logprobs| {
        if let Piece::Text(t) = piece {
            out.text.push_str(&t);
        }
        out.logprobs.extend(logprobs);
    })
    .await;
    match ended {
        Ok(Ended { finish, usage, message, .. }) => {
            out.message = message;
            json_response(200, reply.full(&out, finish, &usage).to_string())
        }
        Err(e) => error(&e),
    }
}
