//! Request handling: routing, bodies, and responses (JSON, or server-sent events).

use std::io::{Read as _, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response};

use super::api::{self, ApiError, GenerationRequest};
use super::engine::{Event, Finish, Job};
use super::{Shared, State};

/// Which generation endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

const ENDPOINTS: [&str; 5] = ["/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"];

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("static header names and ASCII values are valid")
}

/// Answers one request; counts it in the metrics.
pub fn handle(req: Request, shared: &Shared) {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let endpoint = if ENDPOINTS.contains(&path.as_str()) { path.as_str() } else { "other" };
    let status = match (req.method(), path.as_str()) {
        (Method::Get, "/health") => {
            let state = shared.state();
            let code = if state == State::Ready { 200 } else { 503 };
            respond_json(req, code, &json!({ "status": state.as_str() }).to_string(), state == State::Loading)
        }
        (Method::Get, "/metrics") => {
            let body = shared.metrics.render(shared.state().as_str(), shared.queued());
            let r = Response::from_string(body).with_header(header("Content-Type", "text/plain; version=0.0.4"));
            let _ = req.respond(r);
            200
        }
        (Method::Get, "/v1/models") => {
            let body = json!({
                "object": "list",
                "data": [{ "id": shared.model_id, "object": "model", "created": shared.created, "owned_by": "sluice" }]
            });
            respond_json(req, 200, &body.to_string(), false)
        }
        (Method::Post, "/v1/completions") => generate(req, shared, Kind::Completion),
        (Method::Post, "/v1/chat/completions") => generate(req, shared, Kind::Chat),
        (m, _) if endpoint != "other" => {
            let e = ApiError::new(405, "invalid_request_error", format!("{path} does not take {m}"));
            error(req, &e)
        }
        _ => {
            let e = ApiError::new(404, "not_found_error", format!("no such endpoint: {path} (see /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics)"));
            error(req, &e)
        }
    };
    shared.metrics.request(endpoint, status);
}

fn respond_json(req: Request, status: u16, body: &str, retry: bool) -> u16 {
    let mut r =
        Response::from_string(body).with_status_code(status).with_header(header("Content-Type", "application/json"));
    if retry {
        r.add_header(header("Retry-After", "1"));
    }
    let _ = req.respond(r);
    status
}

fn error(req: Request, e: &ApiError) -> u16 {
    respond_json(req, e.status, &e.body(), e.status == 503)
}

/// A request accepted by the engine: its prompt fits and generation has begun.
struct Accepted {
    events: Receiver<Event>,
    cancel: CancelOnDrop,
    prompt_tokens: usize,
    stream: bool,
}

/// Checks, parses and queues a generation request, and waits for the engine to take it.
fn accept(req: &mut Request, shared: &Shared, kind: Kind) -> Result<Accepted, ApiError> {
    match shared.state() {
        State::Ready => {}
        State::Loading => return Err(ApiError::new(503, "server_error", "the model is still loading; retry shortly")),
        State::Draining => return Err(ApiError::new(503, "server_error", "the server is shutting down")),
    }
    let mut body = Vec::new();
    let limit = shared.max_body as u64;
    if let Err(e) = req.as_reader().take(limit + 1).read_to_end(&mut body) {
        return Err(ApiError::invalid(format!("cannot read the request body: {e}"), None));
    }
    if body.len() as u64 > limit {
        return Err(ApiError::new(
            413,
            "invalid_request_error",
            format!("the request body is over {} bytes; send a shorter prompt", shared.max_body),
        ));
    }
    let request: GenerationRequest = match kind {
        Kind::Completion => api::completion_request(&body, &shared.model_id)?,
        Kind::Chat => api::chat_request(&body, &shared.model_id)?,
    };
    let stream = request.stream;
    let (tx, events) = channel();
    let cancel = Arc::new(AtomicBool::new(false));
    shared
        .enqueue(Job { request, events: tx, cancel: Arc::clone(&cancel) })
        .map_err(|why| ApiError::new(503, "server_error", why))?;
    let cancel = CancelOnDrop(cancel);
    let prompt_tokens = match events.recv() {
        Ok(Event::Started { prompt_tokens }) => prompt_tokens,
        Ok(Event::Failed(e)) => return Err(e),
        Ok(other) => return Err(ApiError::new(500, "server_error", format!("unexpected engine event {other:?}"))),
        Err(_) => return Err(ApiError::new(503, "server_error", "the server is shutting down")),
    };
    Ok(Accepted { events, cancel, prompt_tokens, stream })
}

/// A generation request, answered; returns the status sent.
fn generate(mut req: Request, shared: &Shared, kind: Kind) -> u16 {
    let accepted = match accept(&mut req, shared, kind) {
        Ok(a) => a,
        Err(e) => return error(req, &e),
    };
    let id = format!("{}-{:x}{:04x}", kind.id_prefix(), shared.created, shared.next_id());
    let reply = Reply { kind, id, created: shared.created, model: shared.model_id.clone() };
    if accepted.stream {
        stream_events(req.into_writer(), &reply, &accepted.events, &accepted.cancel.0);
        return 200;
    }
    let mut text = String::new();
    loop {
        match accepted.events.recv() {
            Ok(Event::Text(t)) => text.push_str(&t),
            Ok(Event::Done { finish, completion_tokens, .. }) => {
                let body = reply.full(&text, finish, accepted.prompt_tokens, completion_tokens);
                return respond_json(req, 200, &body.to_string(), false);
            }
            Ok(Event::Failed(e)) => return error(req, &e),
            Ok(Event::Started { .. }) => {}
            Err(_) => return error(req, &ApiError::new(500, "server_error", "the engine stopped mid-generation")),
        }
    }
}

/// Sets the generation's cancel flag when the handler returns, whatever the path: a client
/// that is gone no longer needs its tokens.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The fields every response of one request shares.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }
    }
}

impl Reply {
    fn full(&self, text: &str, finish: Finish, prompt_tokens: usize, completion_tokens: usize) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({ "text": text, "index": 0, "logprobs": null, "finish_reason": finish.as_str() }),
            Kind::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": null,
                "finish_reason": finish.as_str()
            }),
        };
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens
            }
        })
    }

    /// One streamed chunk: `text` so far, or the end with `finish`.
    fn chunk(&self, delta: Value, text: Option<&str>, finish: Option<Finish>) -> Value {
        let finish = finish.map(Finish::as_str);
        let choice = match self.kind {
            Kind::Completion => {
                json!({ "text": text.unwrap_or(""), "index": 0, "logprobs": null, "finish_reason": finish })
            }
            Kind::Chat => json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }),
        };
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
            "created": self.created,
            "model": self.model,
            "choices": [choice]
        })
    }
}

/// Writes one HTTP chunk holding one server-sent event and flushes it.
fn send_event(w: &mut dyn Write, data: &str) -> std::io::Result<()> {
    let event = format!("data: {data}\n\n");
    write!(w, "{:x}\r\n{event}\r\n", event.len())?;
    w.flush()
}

/// Streams the generation as server-sent events over chunked transfer encoding (written by
/// hand: tiny_http's own chunked writer buffers 8 KiB before sending). A write that fails means
/// the client is gone: the generation is cancelled.
fn stream_events(mut w: Box<dyn Write + Send>, reply: &Reply, events: &Receiver<Event>, cancel: &AtomicBool) {
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
    let mut result = w.write_all(head.as_bytes()).and_then(|()| w.flush());
    if result.is_ok() && reply.kind == Kind::Chat {
        result =
            send_event(&mut w, &reply.chunk(json!({ "role": "assistant", "content": "" }), None, None).to_string());
    }
    while result.is_ok() {
        result = match events.recv() {
            Ok(Event::Text(t)) => send_event(&mut w, &reply.chunk(json!({ "content": t }), Some(&t), None).to_string()),
            Ok(Event::Done { finish, .. }) => {
                let end = send_event(&mut w, &reply.chunk(json!({}), None, Some(finish)).to_string())
                    .and_then(|()| send_event(&mut w, "[DONE]"))
                    .and_then(|()| w.write_all(b"0\r\n\r\n"))
                    .and_then(|()| w.flush());
                if let Err(e) = end {
                    log::info!("client went away at the end of a stream: {e}");
                }
                return;
            }
            Ok(Event::Failed(e)) => {
                let _ = send_event(&mut w, &e.body()).and_then(|()| w.write_all(b"0\r\n\r\n")).and_then(|()| w.flush());
                return;
            }
            Ok(Event::Started { .. }) => Ok(()),
            Err(_) => {
                let _ = w.write_all(b"0\r\n\r\n").and_then(|()| w.flush());
                return;
            }
        };
    }
    if let Err(e) = result {
        log::info!("client went away mid-stream ({e}): cancelling its generation");
        cancel.store(true, Ordering::Relaxed);
    }
}
