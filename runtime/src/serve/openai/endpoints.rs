//! OpenAI's `/v1/completions` and `/v1/chat/completions` (whole, or streamed as chunks) and
//! `/v1/models`.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::json;
use tokio::net::TcpStream;

use super::chat_stream::ChatStream;
use super::reply::{Gathered, Kind, Reply};
use crate::serve::error::ApiError;
use crate::serve::http::conn::ConnState;
use crate::serve::http::{
    enqueue, error, event_stream, json_response, started, whole_generation, Body, Ended, Front, Queued, Translated,
};
use crate::serve::job::Piece;
use crate::serve::model_card::names_served;
use crate::serve::shared::Shared;

/// `GET /v1/models`: the served model, then the other stored models a request may name.
pub fn models(shared: &Shared) -> Response<Body> {
    let others = shared
        .shelf
        .others()
        .into_iter()
        .map(|m| json!({ "id": m.name, "object": "model", "created": shared.created, "owned_by": "sluice" }));
    let data: Vec<serde_json::Value> = std::iter::once(model_json(shared)).chain(others).collect();
    let body = json!({ "object": "list", "data": data });
    json_response(200, body.to_string())
}

/// `GET /v1/models/{id}`: the served model (by any name that reaches it), or 404 for another.
pub fn model(shared: &Shared, id: &str) -> Response<Body> {
    if names_served(id, &shared.model_id()) {
        json_response(200, model_json(shared).to_string())
    } else {
        let e = ApiError::new(
            404,
            "invalid_request_error",
            format!("The model `{id}` does not exist: this server serves `{}`", shared.model_id()),
        )
        .with_code("model_not_found")
        .with_param("model");
        error(&e)
    }
}

/// The served model, as OpenAI's model object.
fn model_json(shared: &Shared) -> serde_json::Value {
    json!({ "id": shared.model_id(), "object": "model", "created": shared.created, "owned_by": "sluice" })
}

/// A generation request, answered.
pub async fn generate(
    req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
    kind: Kind,
) -> Response<Body> {
    let shared = front.shared();
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let parse = move |body: &[u8], shared: &Shared| {
        let r: super::RequestBody = crate::serve::http::parse(body)?;
        // A name of another stored model (as `/v1/models` lists it) loads it and is checked as
        // its name; the served model's names, or none, serve the loaded one.
        let (served, name) = (shared.model_id(), r.model.clone().unwrap_or_default());
        let other = shared.shelf.other_named(&name, &served)?;
        let checked_as = if other.is_some() { name.as_str() } else { served.as_str() };
        let mut request = match kind {
            Kind::Completion => super::completion_from(r, checked_as)?,
            Kind::Chat => super::chat_from(r, checked_as)?,
        };
        let id = other.as_ref().map_or(served, |m| m.id.clone());
        request.model = other;
        Ok((request, id))
    };
    let (Queued { stream, include_usage, logprobs, mut events, cancel }, model) =
        match enqueue(req, front, conn, parse).await {
            Ok(q) => q,
            Err(e) => return error(&e),
        };
    let mut gone = match started(&mut events, tcp).await {
        Ok((gone, _)) => gone,
        Err(e) => return error(&e),
    };
    let reply =
        Reply { kind, id: shared.new_id(&format!("{}-", kind.id_prefix())), created, model, logprobs, include_usage };
    if stream {
        return event_stream(Translated::new(ChatStream::new(reply), events, cancel, gone));
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
