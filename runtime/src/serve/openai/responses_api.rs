//! `POST /v1/responses`, answered: the chat generation's events turned into the response object,
//! whole or as its stream of typed server-sent events, and the conversation kept for a later
//! `previous_response_id` (unless the request said `store: false`).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use ggml_sys::ParsedMessage;
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::reply::message_json;
use super::response_items::ResponseBuilder;
use crate::serve::error::ApiError;
use crate::serve::http::conn::ConnState;
use crate::serve::http::{
    enqueue, error, event_stream, json_response, started, typed_events, whole_generation, Body, CancelOnDrop, Ended,
    Front, Gone, Queued, Translate, Translated,
};
use crate::serve::job::{Event, EventReceiver, Piece};
use crate::serve::shared::Shared;
use crate::serve::stored::Kept;

/// Answers a `/v1/responses` request.
pub async fn answer(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    let shared = Arc::clone(front.shared());
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let parse = |body: &[u8], shared: &Shared| {
        let previous = |id: &str| shared.responses.lock().unwrap_or_else(|e| e.into_inner()).get(id);
        super::responses_request(body, &shared.model_id(), &previous)
    };
    let (Queued { stream, mut events, cancel, .. }, setup) = match enqueue(req, front, conn, parse).await {
        Ok(q) => q,
        Err(e) => return error(&e),
    };
    let gone = match started(&mut events, tcp).await {
        Ok((gone, _)) => gone,
        Err(e) => return error(&super::responses::responses_names(e)),
    };
    let id = shared.new_id("resp_");
    let builder = ResponseBuilder::new(id, created, shared.model_id(), setup);
    let answer = Answering { builder, shared };
    if stream {
        return event_stream(Translated::new(answer, events, cancel, gone));
    }
    whole(answer, events, gone, cancel).await
}

/// The whole response, once the generation ends.
async fn whole(
    mut answer: Answering,
    mut events: EventReceiver,
    mut gone: Gone,
    _cancel: CancelOnDrop,
) -> Response<Body> {
    let ended = whole_generation(&mut events, &mut gone, |piece, _| {
        if let Piece::Delta(d) = piece {
            answer.builder.push(&d);
        }
    })
    .await;
    match ended {
        Ok(Ended { finish, usage, message, .. }) => {
            let (_, r) = answer.builder.finish(finish, &usage);
            answer.keep(message, &r);
            json_response(200, r.to_string())
        }
        Err(e) => error(&super::responses::responses_names(e)),
    }
}

/// A response being answered: its builder, and where its conversation is kept.
struct Answering {
    builder: ResponseBuilder,
    shared: Arc<Shared>,
}

impl Answering {
    /// Keeps the conversation (this request's and the answer) for `previous_response_id`, and
    /// the `response` object and input items; a call cut off by `max_output_tokens` (its
    /// arguments not JSON yet) is not part of the conversation.
    fn keep(&self, message: Option<ParsedMessage>, response: &Value) {
        let setup = self.builder.setup();
        if !setup.store {
            return;
        }
        let mut message = message.unwrap_or_default();
        message.tool_calls.retain(|c| serde_json::from_str::<serde::de::IgnoredAny>(&c.arguments).is_ok());
        let mut messages = setup.history.clone();
        messages.push(message_json(&message));
        let id = self.builder.id().to_string();
        let kept = Kept { messages, response: response.clone(), input_items: setup.input_items.clone() };
        if !self.shared.responses.lock().unwrap_or_else(|e| e.into_inner()).put(id.clone(), kept) {
            log::warn!("response {id} is not kept: its conversation is over the bound of kept responses");
        }
    }
}

/// A response as its stream of typed server-sent events.
impl Translate for Answering {
    fn opening(&mut self) -> Vec<Value> {
        self.builder.opening()
    }

    fn event(&mut self, e: Event) -> Vec<Value> {
        match e {
            Event::Output { piece: Piece::Delta(d), .. } => self.builder.push(&d),
            Event::Done { finish, usage, message, .. } => {
                let (events, response) = self.builder.finish(finish, &usage);
                self.keep(message, &response);
                events
            }
            Event::Failed(e) => vec![self.builder.failed(&e.message, e.code)],
            Event::Output { .. } | Event::Started { .. } => Vec::new(),
        }
    }

    fn frames(&self, values: &[Value]) -> Bytes {
        typed_events(values)
    }
}

/// `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`
/// of a kept response.
pub fn kept(method: &hyper::Method, path: &str, shared: &Shared) -> Response<Body> {
    let rest = &path["/v1/responses/".len()..];
    let (id, items) = match rest.strip_suffix("/input_items") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    let mut stored = shared.responses.lock().unwrap_or_else(|e| e.into_inner());
    let not_found = || {
        error(
            &ApiError::new(
                404,
                "invalid_request_error",
                format!("No response with id '{id}' is kept here (sluice keeps a bounded number of recent responses in memory while it runs; store: false responses are not kept)"),
            )
            .with_param("response_id"),
        )
    };
    match (method, items) {
        (&hyper::Method::GET, false) => match stored.kept(id) {
            Some(k) => json_response(200, k.response.to_string()),
            None => not_found(),
        },
        (&hyper::Method::GET, true) => match stored.kept(id) {
            Some(k) => {
                let data = &k.input_items;
                let first = data.first().map(|i| i["id"].clone()).unwrap_or(Value::Null);
                let last = data.last().map(|i| i["id"].clone()).unwrap_or(Value::Null);
                let list =
                    json!({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": false});
                json_response(200, list.to_string())
            }
            None => not_found(),
        },
        (&hyper::Method::DELETE, false) if stored.delete(id) => {
            json_response(200, json!({"id": id, "object": "response", "deleted": true}).to_string())
        }
        (&hyper::Method::DELETE, false) => not_found(),
        (m, _) => error(&ApiError::new(405, "invalid_request_error", format!("{path} does not take {m}"))),
    }
}
