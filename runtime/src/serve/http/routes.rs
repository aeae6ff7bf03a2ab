//! Request handling: routing, access control, CORS, request bodies, and responses (JSON, or
//! server-sent events).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::net::TcpStream;

use super::body::{Body, CancelOnDrop, EventSource, EventStream, Gone};
use super::conn::ConnState;
use super::reply::{Gathered, Kind, Reply};
use super::transport::peer_gone;
use super::Front;
use crate::serve::api;
use crate::serve::error::ApiError;
use crate::serve::job::{event_channel, Event, EventReceiver, GenerationRequest, Piece};
use crate::serve::shared::Shared;
use crate::serve::state::State;

const ENDPOINTS: [&str; 8] =
    ["/", "/status", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses"];

/// The status page: one self-contained HTML file that draws `GET /status`.
const STATUS_PAGE: &str = include_str!("../status.html");
/// What the status page may load and do: its own inline script and style, and requests to this
/// server; nothing from elsewhere, and no framing.
const STATUS_PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

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
    } else {
        "other"
    };
    let origin = req.headers().get(header::ORIGIN).cloned();
    let access = &shared.access;
    let mut response = if req.method() == Method::OPTIONS && access.cors_allows(origin.as_ref()).is_some() {
        preflight(&req)
    } else if let Err(e) = access.authorize(&path, req.headers().get(header::AUTHORIZATION)) {
        error(&e)
    } else {
        route(req, &path, endpoint, front, tcp, conn).await
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
        (&Method::GET, "/") => {
            let mut r = Response::new(Body::full(STATUS_PAGE));
            let h = r.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
            h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(STATUS_PAGE_POLICY));
            h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            r
        }
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
        (m, _) if endpoint != "other" => {
            error(&ApiError::new(405, "invalid_request_error", format!("{path} does not take {m}")))
        }
        _ => error(&ApiError::new(
            404,
            "not_found_error",
            format!(
                "no such endpoint: {path} (see /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /health, /metrics, /status, and the status page at /)"
            ),
        )),
    }
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

pub(super) fn json_response(status: u16, body: String) -> Response<Body> {
    let mut r = Response::new(Body::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error response. 503 says when to retry; 401 how to authenticate; a 4xx that may have
/// left a request body unread closes the connection, so no unread byte is taken for the next
/// request.
pub(super) fn error(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.status, e.body());
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
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
    let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        asked.unwrap_or_else(|| HeaderValue::from_static("authorization, content-type")),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    r
}

/// Reads a request body within the limits: `Content-Length` only, at most the body limit,
/// within the idle timeout, and only while the budget for bodies being read has room.
async fn read_body(req: Request<Incoming>, front: &Front, conn: &Arc<ConnState>) -> Result<Vec<u8>, ApiError> {
    let limit = front.limits().body_bytes;
    let too_large = || {
        ApiError::new(
            413,
            "invalid_request_error",
            format!("the request body is over {limit} bytes; send a shorter prompt"),
        )
    };
    if req.headers().contains_key(header::TRANSFER_ENCODING) {
        return Err(ApiError::invalid(
            "Transfer-Encoding request bodies are not accepted (with Content-Length too, the request could be smuggled): send the body with Content-Length alone",
            None,
        ));
    }
    let Some(length) = req.headers().get(header::CONTENT_LENGTH) else {
        return Err(ApiError::new(
            411,
            "invalid_request_error",
            "the request has no Content-Length; send the JSON body with one",
        ));
    };
    let length: usize = length
        .to_str()
        .ok()
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| ApiError::invalid("Content-Length is not a number", None))?;
    if length > limit {
        return Err(too_large());
    }
    let Ok(permit) = Arc::clone(front.body_budget()).try_acquire_many_owned(length as u32) else {
        return Err(ApiError::new(503, "server_error", "the server is busy reading other requests; retry shortly"));
    };
    let _reading = conn.reading_body();
    let read = async {
        let mut body = Vec::with_capacity(length);
        let mut incoming = req.into_body();
        while let Some(frame) = incoming.frame().await {
            let frame = frame.map_err(|e| ApiError::invalid(format!("cannot read the request body: {e}"), None))?;
            if let Ok(data) = frame.into_data() {
                if body.len() + data.len() > limit {
                    return Err(too_large());
                }
                body.extend_from_slice(&data);
            }
        }
        Ok(body)
    };
    let timeout = front.limits().idle_timeout;
    let body = tokio::time::timeout(timeout, read).await.map_err(|_| {
        ApiError::new(
            408,
            "invalid_request_error",
            format!("the request body did not arrive within {} s", timeout.as_secs()),
        )
    })?;
    drop(permit);
    body
}

/// A queued generation: its options, its events, and the flag that cancels it.
pub(super) struct Queued {
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) logprobs: bool,
    pub(super) events: EventReceiver,
    pub(super) cancel: CancelOnDrop,
}

/// Checks, parses (with `parse`, which returns what else the answer needs) and queues a
/// generation request.
pub(super) async fn enqueue<T>(
    req: Request<Incoming>,
    front: &Front,
    conn: &Arc<ConnState>,
    parse: impl FnOnce(&[u8], &Shared) -> Result<(GenerationRequest, T), ApiError>,
) -> Result<(Queued, T), ApiError> {
    let shared = front.shared();
    match shared.state() {
        State::Ready => {}
        State::Loading => return Err(ApiError::new(503, "server_error", "the model is still loading; retry shortly")),
        State::Draining => return Err(ApiError::new(503, "server_error", "the server is shutting down")),
        State::Degraded => {
            return Err(ApiError::new(503, "server_error", format!("{}; retry shortly", shared.degraded_reason())))
        }
    }
    let body = read_body(req, front, conn).await?;
    let (request, more) = parse(&body, shared)?;
    drop(body);
    shared.prompt_bound().check(&request)?;
    let (stream, include_usage, logprobs) = (request.stream, request.include_usage, request.logprobs.is_some());
    let (tx, events) = event_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    shared.enqueue(request, tx, Arc::clone(&cancel)).map_err(|why| ApiError::new(503, "server_error", why))?;
    Ok((Queued { stream, include_usage, logprobs, events, cancel: CancelOnDrop(cancel) }, more))
}

/// Waits for the engine to take a queued request: the future that tells when the client on `tcp`
/// leaves, or the response to send instead (a client that leaves meanwhile drops it).
pub(super) async fn started(events: &mut EventReceiver, tcp: &Arc<TcpStream>) -> Result<Gone, Response<Body>> {
    let mut gone = gone(tcp);
    tokio::select! {
        e = events.recv() => match e {
            Some(Event::Started) => Ok(gone),
            Some(Event::Failed(e)) => Err(error(&e)),
            Some(other) => Err(error(&ApiError::new(500, "server_error", format!("unexpected engine event {other:?}")))),
            None => Err(error(&ApiError::new(503, "server_error", "the server is shutting down"))),
        },
        () = &mut gone => {
            log::info!("client went away while its request was queued: dropping it");
            Err(error(&ApiError::new(499, "invalid_request_error", "client closed the request")))
        }
    }
}

/// The next event of a generation whose whole response is awaited, or the response to send when
/// the client went away meanwhile (dropping the generation's cancel flag then cancels it).
pub(super) async fn next_event(events: &mut EventReceiver, gone: &mut Gone) -> Result<Option<Event>, Response<Body>> {
    tokio::select! {
        e = events.recv() => Ok(e),
        () = gone => {
            log::info!("client went away mid-generation: cancelling it");
            Err(error(&ApiError::new(499, "invalid_request_error", "client closed the request")))
        }
    }
}

/// A streamed answer: `source`'s server-sent events.
pub(super) fn event_stream(source: impl EventSource + 'static) -> Response<Body> {
    let mut r = Response::new(Body::events(source));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// A future that completes when the client on `tcp` has gone away.
fn gone(tcp: &Arc<TcpStream>) -> Gone {
    let tcp = Arc::clone(tcp);
    Box::pin(async move { peer_gone(&tcp).await })
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
        Ok(s) => s,
        Err(r) => return r,
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
    loop {
        let e = match next_event(&mut events, &mut gone).await {
            Ok(e) => e,
            Err(r) => return r,
        };
        match e {
            Some(Event::Output { piece, logprobs }) => {
                if let Piece::Text(t) = piece {
                    out.text.push_str(&t);
                }
                out.logprobs.extend(logprobs);
            }
            Some(Event::Done { finish, usage, message }) => {
                out.message = message;
                return json_response(200, reply.full(&out, finish, &usage).to_string());
            }
            Some(Event::Failed(e)) => return error(&e),
            Some(Event::Started) => {}
            None => return error(&ApiError::new(500, "server_error", "the engine stopped mid-generation")),
        }
    }
}
