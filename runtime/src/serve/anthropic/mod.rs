//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens`, translated to and from the chat request and event stream
//! every API shares; errors in Anthropic's shape.

mod reply;
mod request;

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::json;
use tokio::net::TcpStream;

use super::error::ApiError;
use super::http::conn::ConnState;
use super::http::{
    enqueue, error_with, json_response, read_body, started, streamed, typed_events, whole_generation, Body, Ended,
    Front, Queued, Translate, Translated,
};
use super::job::{Event, Piece, PromptInput};
use super::messages::{Answer, Question};
use reply::MessageReply;

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`, its type named
/// for the status as Anthropic names them.
pub fn error_body(e: &ApiError) -> String {
    let e = &request::anthropic_names(e.clone());
    let kind = match e.status {
        400 | 405 | 411 | 499 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}}).to_string()
}

/// An error response in Anthropic's shape: a server that cannot take the request now (a full
/// queue, loading, stopping) is Anthropic's 529 `overloaded_error`, which its clients retry,
/// with `Retry-After` as for a 503.
pub fn error(e: &ApiError) -> Response<Body> {
    let mut r = error_with(e, error_body(e));
    if e.status == 503 {
        *r.status_mut() = hyper::StatusCode::from_u16(529).unwrap_or(hyper::StatusCode::SERVICE_UNAVAILABLE);
    }
    r
}

/// `POST /v1/messages`.
pub async fn messages(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    let shared = front.shared();
    let (Queued { stream, mut events, cancel, .. }, setup) =
        match enqueue(req, front, conn, |body, _| request::parse(body, false)).await {
            Ok(q) => q,
            Err(e) => return error(&e),
        };
    let (mut gone, prompt_tokens) = match started(&mut events, tcp).await {
        Ok(s) => s,
        Err(e) => return error(&e),
    };
    let reply = MessageReply::new(shared.new_id("msg_"), shared.model_id(), setup, prompt_tokens);
    if stream {
        return streamed(Translated::new(reply, events, cancel, gone), "text/event-stream");
    }
    let _cancel = cancel;
    match whole_generation(&mut events, &mut gone, |_, _| {}).await {
        Ok(Ended { finish, usage, message, stop_sequence }) => {
            let message = message.unwrap_or_default();
            json_response(200, reply.whole(&message, finish, stop_sequence.as_deref(), &usage).to_string())
        }
        Err(e) => error(&e),
    }
}

/// A message as Anthropic's typed server-sent events.
impl Translate for MessageReply {
    fn opening(&mut self) -> Vec<serde_json::Value> {
        self.start_events()
    }

    fn event(&mut self, e: Event) -> Vec<serde_json::Value> {
        match e {
            Event::Output { piece: Piece::Delta(d), .. } => self.push(&d),
            Event::Done { finish, usage, stop_sequence, .. } => self.finish(finish, stop_sequence.as_deref(), &usage),
            Event::Failed(e) => vec![serde_json::from_str(&error_body(&e)).unwrap_or_default()],
            Event::Output { .. } | Event::Started { .. } => Vec::new(),
        }
    }

    fn frames(&self, values: &[serde_json::Value]) -> Bytes {
        typed_events(values)
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model's template renders it.
pub async fn count_tokens(req: Request<Incoming>, front: &Front, conn: &Arc<ConnState>) -> Response<Body> {
    counted_tokens(req, front, conn).await.unwrap_or_else(|e| error(&e))
}

async fn counted_tokens(
    req: Request<Incoming>,
    front: &Front,
    conn: &Arc<ConnState>,
) -> Result<Response<Body>, ApiError> {
    let shared = front.shared();
    let (_, tools) = shared.loaded()?;
    let body = read_body(req, front, conn).await?;
    let (request, _) = request::parse(&body, true)?;
    shared.prompt_bound().check(&request)?;
    let PromptInput::Chat(inputs) = request.prompt else {
        return Err(ApiError::new(500, "server_error", "a Messages request made no chat"));
    };
    match tools.ask(Question::CountChat(inputs), shared.prompt_bound()).await? {
        Answer::Count(n) => Ok(json_response(200, json!({"input_tokens": n}).to_string())),
        other => Err(ApiError::new(500, "server_error", format!("unexpected answer {other:?}"))),
    }
}
