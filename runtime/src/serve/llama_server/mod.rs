//! llama-server's utility endpoints, in its request and response shapes: `POST /tokenize`,
//! `POST /detokenize`, `POST /apply-template`, `GET /props`, `GET /slots` and
//! `POST /slots/{id}?action=save|restore|erase`.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header;
use hyper::{Request, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::http::conn::ConnState;
use super::http::{error_with, json_response, read_body, ready_body, Body, Front};
use super::job::PromptInput;
use super::messages::SlotAction;
use super::messages::{Answer, Question};
use super::state::State;
use super::{http, openai};

/// `POST /tokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// `POST /detokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    tokens: Vec<i64>,
}

/// The questions about text llama-server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextQuestion {
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /detokenize`.
    Detokenize,
    /// `POST /apply-template`.
    ApplyTemplate,
}

/// `POST /tokenize`, `/detokenize` or `/apply-template`.
pub async fn text(
    req: Request<Incoming>,
    question: TextQuestion,
    front: &Front,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    answer(match read_body(req, front, conn).await {
        Ok(body) => text_answer(question, &body, front).await,
        Err(e) => Err(e),
    })
}

/// `GET /props`.
pub fn props(front: &Front) -> Response<Body> {
    answer(model_props(front))
}

/// `GET /slots`.
pub fn slots(front: &Front) -> Response<Body> {
    answer(slot_list(front))
}

/// `POST /slots/{id}?action=...`.
pub async fn slot_action(req: Request<Incoming>, path: &str, front: &Front, conn: &Arc<ConnState>) -> Response<Body> {
    answer(run_slot_action(req, path, front, conn).await)
}

/// A JSON answer, or its error in OpenAI's shape (as llama-server answers).
fn answer(answer: Result<Value, ApiError>) -> Response<Body> {
    match answer {
        Ok(v) => json_response(200, v.to_string()),
        Err(e) => error_with(&e, e.body()),
    }
}

/// `/tokenize`, `/detokenize` and `/apply-template`, answered by the model's tokenizer and
/// template.
async fn text_answer(question: TextQuestion, body: &[u8], front: &Front) -> Result<Value, ApiError> {
    let shared = front.shared();
    let (_, tools) = shared.loaded()?;
    let bound = shared.prompt_bound();
    match question {
        TextQuestion::Tokenize => {
            let b: TokenizeBody = http::parse(body)?;
            if let Some(limit) = bound.bytes().filter(|limit| b.content.len() > *limit) {
                return Err(ApiError::invalid(
                    format!("content: {} bytes is over the maximum context length of {} tokens ({limit} bytes at most): a longer text could never be a prompt", b.content.len(), bound.n_ctx),
                    Some("content"),
                )
                .with_code("context_length_exceeded"));
            }
            let q = Question::Tokenize { text: b.content, add_special: b.add_special, parse_special: b.parse_special };
            let Answer::Tokens(tokens) = tools.ask(q, bound).await? else { return Err(unexpected()) };
            let tokens: Vec<Value> = if b.with_pieces {
                tokens
                    .into_iter()
                    .map(|(id, bytes)| match String::from_utf8(bytes) {
                        Ok(piece) => json!({"id": id, "piece": piece}),
                        // A piece that is part of a character: its bytes, as llama-server gives them.
                        Err(e) => json!({"id": id, "piece": e.into_bytes()}),
                    })
                    .collect()
            } else {
                tokens.into_iter().map(|(id, _)| json!(id)).collect()
            };
            Ok(json!({"tokens": tokens}))
        }
        TextQuestion::Detokenize => {
            let b: DetokenizeBody = http::parse(body)?;
            let tokens = b
                .tokens
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    i32::try_from(*t).map_err(|_| {
                        let param = format!("tokens[{i}]");
                        ApiError::invalid(format!("{param}: {t} is not a token id"), Some(&param))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let Answer::Text(content) = tools.ask(Question::Detokenize(tokens), bound).await? else {
                return Err(unexpected());
            };
            Ok(json!({"content": content}))
        }
        TextQuestion::ApplyTemplate => {
            let request = openai::chat_request(body, &shared.model_id())?;
            bound.check(&request)?;
            let PromptInput::Chat(inputs) = request.prompt else { return Err(unexpected()) };
            let Answer::Text(prompt) = tools.ask(Question::Render(inputs), bound).await? else {
                return Err(unexpected());
            };
            Ok(json!({"prompt": prompt}))
        }
    }
}

/// The body of a slot action: the saved slot's file (a restore needs it; a save is named by
/// what it holds, and its answer gives the name).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SlotBody {
    filename: Option<String>,
}

/// How long a slot action may wait for the engine (it runs between decodes).
const SLOT_ACTION_PATIENCE: Duration = Duration::from_secs(60);

/// `POST /slots/{id}?action=save|restore|erase`, run by the engine between its steps.
async fn run_slot_action(
    req: Request<Incoming>,
    path: &str,
    front: &Front,
    conn: &Arc<ConnState>,
) -> Result<Value, ApiError> {
    let id = &path["/slots/".len()..];
    let slot: u32 = id.parse().map_err(|_| {
        ApiError::invalid(format!("{id:?} is not a slot number (GET /slots lists them)"), Some("id_slot"))
    })?;
    let query = req.uri().query().unwrap_or_default().to_string();
    let asked = query.split('&').find_map(|kv| kv.strip_prefix("action=")).unwrap_or_default().to_string();
    let sent =
        req.headers().contains_key(header::CONTENT_LENGTH) || req.headers().contains_key(header::TRANSFER_ENCODING);
    let raw = if sent { ready_body(req, front, conn).await? } else { Vec::new() };
    let body: SlotBody = if raw.iter().all(u8::is_ascii_whitespace) { SlotBody::default() } else { http::parse(&raw)? };
    let action = match (asked.as_str(), body.filename) {
        ("save", _) => SlotAction::Save,
        ("erase", _) => SlotAction::Erase,
        ("restore", Some(f)) => SlotAction::Restore(f),
        ("restore", None) => {
            return Err(ApiError::invalid("restore needs {\"filename\": ...}, as a save answered it", Some("filename")))
        }
        (other, _) => {
            return Err(ApiError::invalid(
                format!("action {other:?} is not save, restore or erase (POST /slots/{{id}}?action=...)"),
                Some("action"),
            ))
        }
    };
    let shared = front.shared();
    if shared.state() != State::Ready {
        return Err(ApiError::new(503, "server_error", "the model is not ready; retry shortly"));
    }
    match tokio::time::timeout(SLOT_ACTION_PATIENCE, shared.slot_actions.ask(slot, action)).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err(ApiError::new(503, "server_error", "the engine stopped; retry shortly")),
        Err(_) => {
            Err(ApiError::new(503, "server_error", "the engine did not take the slot action in time; retry shortly"))
        }
    }
}

fn unexpected() -> ApiError {
    ApiError::new(500, "server_error", "the tokenizer thread answered another question")
}

/// `GET /props`: the served model and the server's settings.
fn model_props(front: &Front) -> Result<Value, ApiError> {
    let shared = front.shared();
    let (card, _) = shared.loaded()?;
    let slots = shared.metrics.slots().len();
    Ok(json!({
        "default_generation_settings": {"n_ctx": card.context, "params": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}},
        "total_slots": slots,
        "model_alias": shared.model_id(),
        "model_path": card.path.display().to_string(),
        "chat_template": card.template,
        "modalities": {"vision": false, "audio": false},
        "build_info": format!("sluice {}", env!("CARGO_PKG_VERSION")),
    }))
}

/// `GET /slots`: each slot, whether it runs a request, and the tokens its memory holds.
fn slot_list(front: &Front) -> Result<Value, ApiError> {
    let shared = front.shared();
    let n_ctx = shared.prompt_bound().n_ctx;
    let slots: Vec<Value> = shared
        .metrics
        .slots()
        .iter()
        .enumerate()
        .map(|(id, s)| {
            json!({"id": id, "n_ctx": n_ctx, "is_processing": s.busy, "n_tokens": s.tokens,
                "last_prompt_reused": s.reused, "last_prompt_computed": s.computed})
        })
        .collect();
    Ok(Value::Array(slots))
}
