//! What every API's generation handler does around the engine: read the body within the
//! limits, parse and queue the request, wait for the engine to take it, and follow its events
//! while the client stays.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response};
use tokio::net::TcpStream;

use super::body::{Body, CancelOnDrop, EventSource, Gone};
use super::conn::ConnState;
use super::transport::peer_gone;
use super::Front;
use crate::serve::error::ApiError;
use crate::serve::job::{event_channel, Event, EventReceiver, Finish, GenerationRequest, Owner, Piece, TokenUsage};
use crate::serve::logprobs::TokenLogprob;
use crate::serve::shared::Shared;
use crate::serve::state::State;
use ggml_sys::ParsedMessage;

/// Reads a request body within the limits: `Content-Length` only, at most the body limit,
/// within the idle timeout, and only while the budget for bodies being read has room.
pub(crate) async fn read_body(
    req: Request<Incoming>,
    front: &Front,
    conn: &Arc<ConnState>,
) -> Result<Vec<u8>, ApiError> {
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
pub(crate) struct Queued {
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) logprobs: bool,
    pub(crate) events: EventReceiver,
    pub(crate) cancel: CancelOnDrop,
}

/// Checks, parses (with `parse`, which returns what else the answer needs) and queues a
/// generation request.
pub(crate) async fn enqueue<T: Send + 'static>(
    req: Request<Incoming>,
    front: &Front,
    conn: &Arc<ConnState>,
    parse: impl FnOnce(&[u8], &Shared) -> Result<(GenerationRequest, T), ApiError> + Send + 'static,
) -> Result<(Queued, T), ApiError> {
    let owner = owner_of(&req);
    let body = ready_body(req, front, conn).await?;
    let shared = Arc::clone(front.shared());
    let (mut request, more) = off_thread(front, move || parse(&body, &shared)).await?;
    request.owner = owner;
    Ok((queue(front.shared(), request)?, more))
}

/// The client the router found a request to be from ([`Owner`]).
pub(crate) fn owner_of(req: &Request<Incoming>) -> Owner {
    req.extensions().get::<Owner>().cloned().unwrap_or_default()
}

/// Runs `work` (a body's parse and translation) on the front's parser thread ([`Front::parse`]):
/// the I/O thread goes on serving the other connections meanwhile.
pub(crate) async fn off_thread<R: Send + 'static>(
    front: &Front,
    work: impl FnOnce() -> Result<R, ApiError> + Send + 'static,
) -> Result<R, ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    front.parse(Box::new(move || {
        let _ = tx.send(work());
    }))?;
    rx.await.map_err(|_| ApiError::new(500, "server_error", "the request parser stopped"))?
}

/// The body of a request for the model, once the server is ready for one.
pub(crate) async fn ready_body(
    req: Request<Incoming>,
    front: &Front,
    conn: &Arc<ConnState>,
) -> Result<Vec<u8>, ApiError> {
    let shared = front.shared();
    match shared.state() {
        State::Ready => {}
        State::Loading => return Err(ApiError::new(503, "server_error", "the model is still loading; retry shortly")),
        State::Draining => return Err(ApiError::new(503, "server_error", "the server is shutting down")),
        State::Degraded => {
            return Err(ApiError::new(503, "server_error", format!("{}; retry shortly", shared.degraded_reason())))
        }
    }
    read_body(req, front, conn).await
}

/// Queues a parsed generation request within the prompt bound and the admission limit.
pub(crate) fn queue(shared: &Shared, request: GenerationRequest) -> Result<Queued, ApiError> {
    shared.prompt_bound().check(&request)?;
    let (stream, include_usage, logprobs) = (request.stream, request.include_usage, request.logprobs.is_some());
    let (tx, events) = event_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    shared.enqueue(request, tx, Arc::clone(&cancel)).map_err(|why| ApiError::new(503, "server_error", why))?;
    Ok(Queued { stream, include_usage, logprobs, events, cancel: CancelOnDrop(cancel) })
}

/// Waits for the engine to take a queued request: the future that tells when the client on `tcp`
/// leaves and the prompt's tokens, or the error to answer instead (a client that leaves
/// meanwhile drops it).
pub(crate) async fn started(events: &mut EventReceiver, tcp: &Arc<TcpStream>) -> Result<(Gone, usize), ApiError> {
    let mut gone = gone(tcp);
    tokio::select! {
        e = events.recv() => match e {
            Some(Event::Started { prompt_tokens }) => Ok((gone, prompt_tokens)),
            Some(Event::Failed(e)) => Err(e),
            Some(other) => Err(ApiError::new(500, "server_error", format!("unexpected engine event {other:?}"))),
            None => Err(ApiError::new(503, "server_error", "the server is shutting down")),
        },
        () = &mut gone => {
            log::info!("client went away while its request was queued: dropping it");
            Err(ApiError::new(499, "invalid_request_error", "client closed the request"))
        }
    }
}

/// How a generation ended: its [`Event::Done`].
pub(crate) struct Ended {
    /// Why.
    pub finish: Finish,
    /// What it counted.
    pub usage: TokenUsage,
    /// A chat's whole answer, parsed.
    pub message: Option<ParsedMessage>,
    /// The stop sequence that ended the text, if one did.
    pub stop_sequence: Option<String>,
}

/// Waits for the whole of a generation whose response is not streamed, handing each output
/// (its piece and log probabilities) to `output`; its end, or the error to answer: the
/// generation's failure, the client gone meanwhile (dropping the generation's cancel flag then
/// cancels it), or the engine stopping before the end.
pub(crate) async fn whole_generation(
    events: &mut EventReceiver,
    gone: &mut Gone,
    mut output: impl FnMut(Piece, Vec<TokenLogprob>),
) -> Result<Ended, ApiError> {
    loop {
        let event = tokio::select! {
            e = events.recv() => e,
            () = &mut *gone => {
                log::info!("client went away mid-generation: cancelling it");
                return Err(ApiError::new(499, "invalid_request_error", "client closed the request"));
            }
        };
        match event {
            Some(Event::Output { piece, logprobs }) => output(piece, logprobs),
            Some(Event::Done { finish, usage, message, stop_sequence }) => {
                return Ok(Ended { finish, usage, message, stop_sequence })
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Started { .. }) => {}
            None => return Err(ApiError::new(500, "server_error", "the engine stopped mid-generation")),
        }
    }
}

/// A streamed answer: `source`'s server-sent events.
pub(crate) fn event_stream(source: impl EventSource + 'static) -> Response<Body> {
    streamed(source, "text/event-stream")
}

/// A streamed answer of `content_type` (server-sent events, or Ollama's JSON lines).
pub(crate) fn streamed(source: impl EventSource + 'static, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::events(source));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// A future that completes when the client on `tcp` has gone away.
fn gone(tcp: &Arc<TcpStream>) -> Gone {
    let tcp = Arc::clone(tcp);
    Box::pin(async move { peer_gone(&tcp).await })
}
