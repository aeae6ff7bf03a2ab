//! Ollama's API: `/api/chat` and `/api/generate` (JSON lines, Ollama's default, or one object),
//! `/api/tags`, `/api/show`, `/api/ps`, `/api/version` and `/api/pull` of the one served model,
//! translated to and from the chat request and event stream every API shares; what a
//! single-model server cannot do (push, create, copy, delete, embeddings) answered with a clear
//! error in Ollama's shape, `{"error": "..."}`.

mod keep_alive;
mod models;
mod pulling;
mod reply;
mod request;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::error::ApiError;
use super::http;
use super::http::conn::ConnState;
use super::http::{
    error_with, json_response, off_thread, owner_of, queue, ready_body, started, streamed, whole_generation, Body,
    Ended, Front, Queued, Translate, Translated,
};
use super::job::{Event, GenerationRequest, Piece};
use super::model_card::names_served;
use super::shared::Shared;
use super::shelf::ModelChoice;
use reply::{Endpoint, OllamaReply};

/// `POST /api/chat`.
pub async fn chat(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    generation(req, front, tcp, conn, Endpoint::Chat).await
}

/// `POST /api/generate`.
pub async fn generate(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    generation(req, front, tcp, conn, Endpoint::Generate).await
}

/// `GET /api/tags`: the served model.
pub fn tags(shared: &Shared) -> Response<Body> {
    answer(models::tags(shared))
}

/// `GET /api/ps`: the loaded model.
pub fn ps(shared: &Shared) -> Response<Body> {
    answer(models::ps(shared))
}

/// `GET /` on the Ollama listener: what Ollama answers there.
pub fn running() -> Response<Body> {
    let mut r = Response::new(Body::full("Ollama is running"));
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// `GET /api/version`.
pub fn version() -> Response<Body> {
    answer(Ok(json!({"version": models::VERSION})))
}

/// `POST /api/show`: a model's details: the served one's, or another's the server may load (read
/// from its file's metadata, off the front's thread).
pub async fn show(req: Request<Incoming>, front: &Front, conn: &Arc<ConnState>) -> Response<Body> {
    let shared = front.shared();
    let body = match read(req, front, conn).await {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    answer(match models::show_target(shared, &body) {
        Ok(models::ShowTarget::Served(card)) => models::show(&shared.model_id(), &card),
        Err(e) => Err(e),
        Ok(models::ShowTarget::Other(choice)) => {
            let context = shared.prompt_bound().n_ctx;
            let path = choice.path.clone();
            let described = http::off_thread(front, move || {
                super::engine::describe(&path, context).map_err(|e| ApiError::new(500, "server_error", e.to_string()))
            })
            .await;
            described.and_then(|card| models::show(&choice.id, &card))
        }
    })
}

/// `POST /api/pull`: fetches a model into the store (progress as JSON lines).
pub async fn pull(req: Request<Incoming>, front: &Front, conn: &Arc<ConnState>) -> Response<Body> {
    match read(req, front, conn).await {
        Ok(body) => pulling::pull(front, body).await.unwrap_or_else(|e| error(&e)),
        Err(e) => error(&e),
    }
}

/// `DELETE /api/delete`: removes a stored model (not the one loaded).
pub async fn delete(req: Request<Incoming>, front: &Front, conn: &Arc<ConnState>) -> Response<Body> {
    match read(req, front, conn).await {
        Ok(body) => pulling::delete(front.shared(), &body).unwrap_or_else(|e| error(&e)),
        Err(e) => error(&e),
    }
}

/// One of Ollama's endpoints a single-model server cannot serve (`path` under it), any method:
/// it does not support `what`.
pub fn unsupported(path: &str, what: &str) -> Response<Body> {
    error(&models::unsupported(path, what))
}

/// A JSON answer, or its error in Ollama's shape.
fn answer(answer: Result<Value, ApiError>) -> Response<Body> {
    match answer {
        Ok(v) => json_response(200, v.to_string()),
        Err(e) => error(&e),
    }
}

/// Ollama's error body: `{"error": "..."}`, naming Ollama's fields: the engine's errors speak
/// of the shared request's `max_tokens`, which is Ollama's `options.num_predict`.
pub fn error_body(e: &ApiError) -> String {
    let e = request::ollama_names(e.clone());
    json!({"error": e.message.replace("max_tokens", "options.num_predict")}).to_string()
}

fn error(e: &ApiError) -> Response<Body> {
    error_with(e, error_body(e))
}

/// A body of a model request, parsed.
async fn read(req: Request<Incoming>, front: &Front, conn: &Arc<ConnState>) -> Result<models::ModelBody, ApiError> {
    let body = ready_body(req, front, conn).await?;
    http::parse_ignoring(&body, "Ollama")
}

/// The name a client gave a model, checked, with the model it runs on: the served one (its id,
/// `id:latest`, or the name `/api/tags` lists), or another stored model, which is loaded in its
/// place (the shelf refuses one that is not stored, or whose plan does not fit the board).
fn check_model(shared: &Shared, name: Option<&str>) -> Result<(String, ModelChoice), ApiError> {
    let Some(name) = name.filter(|n| !n.is_empty()) else {
        return Err(ApiError::invalid("model is required", Some("model")));
    };
    let current = shared.shelf.current();
    let listed = models::listed_name(&current.id);
    if name == listed || names_served(name, &current.id) {
        return Ok((name.to_string(), current));
    }
    Ok((name.to_string(), shared.shelf.choose_other(name)?))
}

/// `/api/chat` or `/api/generate`.
async fn generation(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
    endpoint: Endpoint,
) -> Response<Body> {
    let begun = Instant::now();
    let shared = front.shared();
    let owner = owner_of(&req);
    let parsed = match ready_body(req, front, conn).await {
        Ok(body) => {
            let shared = Arc::clone(shared);
            off_thread(front, move || parse(&body, &shared, endpoint, begun)).await
        }
        Err(e) => Err(e),
    };
    let (request, mut reply) = match parsed {
        Ok(Parsed::Generate(request, reply)) => (GenerationRequest { owner, ..*request }, reply),
        Ok(Parsed::Loaded(answer)) => return json_response(200, answer.to_string()),
        Err(e) => return error(&e),
    };
    let Queued { stream, mut events, cancel, .. } = match queue(shared, request) {
        Ok(q) => q,
        Err(e) => return error(&e),
    };
    let mut gone = match started(&mut events, tcp).await {
        Ok((gone, _)) => gone,
        Err(e) => return error(&e),
    };
    if stream {
        return streamed(Translated::new(reply, events, cancel, gone), "application/x-ndjson");
    }
    let _cancel = cancel;
    let mut text = String::new();
    let ended = whole_generation(&mut events, &mut gone, |piece, _| {
        if let Piece::Text(t) = &piece {
            text.push_str(t);
        }
        reply.piece(&piece);
    })
    .await;
    match ended {
        Ok(Ended { finish, usage, message, .. }) => {
            json_response(200, reply.whole(&text, message.as_ref(), finish, &usage).to_string())
        }
        Err(e) => error(&e),
    }
}

/// A chat or generate body: a generation, or a request that only loads or unloads the model.
enum Parsed {
    Generate(Box<GenerationRequest>, OllamaReply),
    Loaded(Value),
}

fn parse(body: &[u8], shared: &Shared, endpoint: Endpoint, begun: Instant) -> Result<Parsed, ApiError> {
    let context = shared.prompt_bound().n_ctx;
    // Thinking asked of a model whose template has none is Ollama's 400.
    let can_think = |name: &str, model: &ModelChoice, asked: bool| {
        let loaded = model.path == shared.shelf.current().path;
        let thinks = !loaded || shared.loaded().map_or(true, |(card, _)| card.thinks);
        if asked && !thinks {
            return Err(ApiError::invalid(format!("\"{name}\" does not support thinking"), Some("think")));
        }
        Ok(())
    };
    match endpoint {
        Endpoint::Chat => {
            let b: request::ChatBody = http::parse_ignoring(body, "Ollama")?;
            let (name, model) = check_model(shared, b.model.as_deref())?;
            let unload = keep_alive::unloads(b.keep_alive.as_ref())?;
            can_think(&name, &model, b.asks_thinking())?;
            let reply = OllamaReply::new(endpoint, name, begun);
            if b.loads_only() {
                return Ok(Parsed::Loaded(load_or_unload(shared, &reply, unload)));
            }
            let request = b.request(context)?;
            Ok(Parsed::Generate(
                Box::new(GenerationRequest { unload_after: unload, model: Some(model), ..request }),
                reply,
            ))
        }
        Endpoint::Generate => {
            let b: request::GenerateBody = http::parse_ignoring(body, "Ollama")?;
            let (name, model) = check_model(shared, b.model.as_deref())?;
            let unload = keep_alive::unloads(b.keep_alive.as_ref())?;
            can_think(&name, &model, b.asks_thinking())?;
            let reply = OllamaReply::new(endpoint, name, begun);
            if b.loads_only() {
                return Ok(Parsed::Loaded(load_or_unload(shared, &reply, unload)));
            }
            let request = b.request(context)?;
            Ok(Parsed::Generate(
                Box::new(GenerationRequest { unload_after: unload, model: Some(model), ..request }),
                reply,
            ))
        }
    }
}

/// Asks the engine to load the model (if it was unloaded) or to unload it, and answers as
/// Ollama does.
fn load_or_unload(shared: &Shared, reply: &OllamaReply, unload: bool) -> Value {
    if unload {
        shared.ask_unload();
    } else {
        shared.ask_load();
    }
    reply.loaded(unload)
}

/// A generation as Ollama's JSON lines.
impl Translate for OllamaReply {
    fn event(&mut self, e: Event) -> Vec<Value> {
        match e {
            Event::Output { piece, .. } => self.piece(&piece).into_iter().collect(),
            Event::Done { finish, usage, message, .. } => {
                let calls = message.as_ref().and_then(|m| self.tool_calls(m));
                calls.into_iter().chain([self.done(finish, &usage)]).collect()
            }
            Event::Failed(e) => vec![serde_json::from_str(&error_body(&e)).unwrap_or_default()],
            Event::Started { .. } => Vec::new(),
        }
    }

    fn frames(&self, values: &[Value]) -> Bytes {
        Bytes::from(values.iter().map(|l| format!("{l}\n")).collect::<String>())
    }
}
