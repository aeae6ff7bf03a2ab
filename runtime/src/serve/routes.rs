//! The router: every path the server answers, once, in [`ROUTES`] (its methods, its API, its
//! metrics label, whether it needs the key), above the API folders it hands each request to.
//! The answers no API gives itself come from the table too: 404 for a path in no route, 405 for
//! a method a route does not take, each in the shape of the API the path belongs to, and 401 for
//! a route that needs the key; then CORS and the request's count in the metrics.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response};
use tokio::net::TcpStream;

use super::error::ApiError;
use super::http::conn::ConnState;
use super::http::{error, error_with, preflight, Body, Front};
use super::job::Owner;
use super::llama_server::TextQuestion;
use super::{anthropic, llama_server, ollama, openai, status};

/// Which API a path belongs to: its errors are answered in that API's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    /// OpenAI's, and the paths in no other API's room.
    OpenAi,
    /// Anthropic's, under `/v1/messages`.
    Anthropic,
    /// Ollama's, under `/api/`.
    Ollama,
    /// llama-server's utility endpoints (errors in OpenAI's shape, as llama-server's).
    LlamaServer,
    /// sluice's own pages, health and metrics (errors in OpenAI's shape).
    Sluice,
}

/// Whether a route needs the API key when the server has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    /// Always.
    Needed,
    /// Never: health checks and the pages, which hold no data.
    Free,
    /// As `--metrics-need-key` says.
    AsMetrics,
}

/// How a route's path matches a request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Under {
    /// The path alone.
    No,
    /// The path and every path below it (`/api/blobs/sha256:...`), counted as `other`.
    Also,
    /// Only paths below it (`/v1/models/{id}`, the part after the last `/` being any text).
    Only,
}

/// What answers a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    ChatPage,
    StatusPage,
    Status,
    Health,
    Metrics,
    Models,
    Model,
    Completions,
    ChatCompletions,
    Responses,
    KeptResponse,
    Messages,
    CountTokens,
    OllamaChat,
    OllamaGenerate,
    Tags,
    Show,
    Ps,
    Version,
    OllamaRunning,
    Pull,
    Delete,
    /// What a single-model server cannot do at this path (Ollama's push, create, ...).
    OllamaUnsupported(&'static str),
    Text(TextQuestion),
    Props,
    Slots,
    SlotAction,
}

/// One route: the methods it takes (space-separated; empty: any, the handler answers each), its
/// path (a trailing `{id}` with [`Under::Only`]), its API, whether it needs the key, its handler.
#[derive(Debug, Clone, Copy)]
struct Route {
    methods: &'static str,
    path: &'static str,
    under: Under,
    api: Api,
    key: Key,
    endpoint: Endpoint,
}

const fn route(methods: &'static str, path: &'static str, api: Api, endpoint: Endpoint) -> Route {
    Route { methods, path, under: Under::No, api, key: Key::Needed, endpoint }
}

const fn with_key(route: Route, key: Key) -> Route {
    Route { key, ..route }
}

const fn below(route: Route, under: Under) -> Route {
    Route { under, ..route }
}

use Api::{Anthropic, LlamaServer, Ollama, OpenAi, Sluice};
use Endpoint as E;

/// `/` on the listener that stands for Ollama (`--ollama-listen`): `Ollama is running`, as
/// front-ends and editor extensions detect an Ollama server (the chat page is on sluice's port).
const OLLAMA_ROOT: Route = with_key(route("GET HEAD", "/", Ollama, E::OllamaRunning), Key::Free);

/// Every route, each path once.
const ROUTES: [Route; 33] = [
    // HEAD: Ollama's clients ask whether a server runs.
    with_key(route("GET HEAD", "/", Sluice, E::ChatPage), Key::Free),
    with_key(route("GET", "/status.html", Sluice, E::StatusPage), Key::Free),
    route("GET", "/status", Sluice, E::Status),
    with_key(route("GET", "/health", Sluice, E::Health), Key::Free),
    with_key(route("GET", "/metrics", Sluice, E::Metrics), Key::AsMetrics),
    route("GET", "/v1/models", OpenAi, E::Models),
    below(route("GET", "/v1/models/{id}", OpenAi, E::Model), Under::Only),
    route("POST", "/v1/completions", OpenAi, E::Completions),
    route("POST", "/v1/chat/completions", OpenAi, E::ChatCompletions),
    route("POST", "/v1/responses", OpenAi, E::Responses),
    below(route("", "/v1/responses/{id}", OpenAi, E::KeptResponse), Under::Only),
    route("POST", "/v1/messages", Anthropic, E::Messages),
    route("POST", "/v1/messages/count_tokens", Anthropic, E::CountTokens),
    route("POST", "/api/chat", Ollama, E::OllamaChat),
    route("POST", "/api/generate", Ollama, E::OllamaGenerate),
    route("GET HEAD", "/api/tags", Ollama, E::Tags),
    route("POST", "/api/show", Ollama, E::Show),
    route("GET HEAD", "/api/ps", Ollama, E::Ps),
    route("GET HEAD", "/api/version", Ollama, E::Version),
    route("POST", "/api/pull", Ollama, E::Pull),
    below(route("", "/api/push", Ollama, E::OllamaUnsupported("pushing models to a registry")), Under::Also),
    below(route("", "/api/create", Ollama, E::OllamaUnsupported("creating models")), Under::Also),
    below(route("", "/api/copy", Ollama, E::OllamaUnsupported("copying models")), Under::Also),
    route("DELETE", "/api/delete", Ollama, E::Delete),
    below(route("", "/api/blobs", Ollama, E::OllamaUnsupported("uploading model files")), Under::Also),
    below(route("", "/api/embed", Ollama, E::OllamaUnsupported("embeddings")), Under::Also),
    below(route("", "/api/embeddings", Ollama, E::OllamaUnsupported("embeddings")), Under::Also),
    route("POST", "/tokenize", LlamaServer, E::Text(TextQuestion::Tokenize)),
    route("POST", "/detokenize", LlamaServer, E::Text(TextQuestion::Detokenize)),
    route("POST", "/apply-template", LlamaServer, E::Text(TextQuestion::ApplyTemplate)),
    route("GET", "/props", LlamaServer, E::Props),
    route("GET", "/slots", LlamaServer, E::Slots),
    below(route("POST", "/slots/{id}", LlamaServer, E::SlotAction), Under::Only),
];

impl Route {
    /// Whether the route answers `path` (any method).
    fn matches(&self, path: &str) -> bool {
        match self.under {
            Under::No => path == self.path,
            Under::Also => path == self.path || path.strip_prefix(self.path).is_some_and(|r| r.starts_with('/')),
            Under::Only => path.starts_with(self.path.trim_end_matches("{id}")),
        }
    }

    /// Whether the route takes `method`.
    fn takes(&self, method: &Method) -> bool {
        self.methods.is_empty() || self.methods.split(' ').any(|m| m == method.as_str())
    }

    /// The route's label in the metrics for `path`.
    fn label(&self, path: &str) -> &'static str {
        if self.under == Under::Also && path != self.path {
            "other"
        } else {
            self.path
        }
    }
}

impl Api {
    /// The API whose room `path` is in (for a path in no route).
    fn of(path: &str) -> Api {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Api::Anthropic
        } else if path.starts_with("/api/") {
            Api::Ollama
        } else {
            Api::OpenAi
        }
    }

    /// `e` in this API's shape.
    fn error(self, e: &ApiError) -> Response<Body> {
        match self {
            Api::OpenAi | Api::LlamaServer | Api::Sluice => error(e),
            Api::Anthropic => anthropic::error(e),
            Api::Ollama => error_with(e, ollama::error_body(e)),
        }
    }

    /// The paths of this API's routes, in the table's order.
    fn paths(self) -> impl Iterator<Item = &'static str> {
        ROUTES.iter().filter(move |r| r.api == self && r.under == Under::No).map(|r| r.path)
    }

    /// 405 for `method` on `path`, a route of this API.
    fn method_not_allowed(self, path: &str, method: &Method) -> ApiError {
        let hint = if self == Api::Anthropic { "; use POST" } else { "" };
        ApiError::new(405, "invalid_request_error", format!("{path} does not take {method}{hint}"))
    }

    /// 404 for `path`, in no route, in the room of this API.
    fn not_found(self, path: &str) -> ApiError {
        let here = match self {
            Api::Anthropic => format!("see {}", self.paths().collect::<Vec<_>>().join(" and ")),
            Api::Ollama => {
                let answered =
                    ROUTES.iter().filter(|r| r.api == self && !matches!(r.endpoint, Endpoint::OllamaUnsupported(_)));
                format!("Ollama's API here: {}", answered.map(|r| r.path).collect::<Vec<_>>().join(", "))
            }
            _ => "see /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, Ollama's /api/..., /tokenize, /detokenize, /apply-template, /props, /slots, /health, /metrics, /status, the chat page at / and the status page at /status.html".to_string(),
        };
        ApiError::new(404, "not_found_error", format!("no such endpoint: {path} ({here})"))
    }
}

/// Answers one request ([`crate::serve::http::Handler`]).
pub fn handle<'a>(
    req: Request<Incoming>,
    front: &'a Front,
    tcp: &'a Arc<TcpStream>,
    conn: &'a Arc<ConnState>,
) -> Pin<Box<dyn Future<Output = Response<Body>> + Send + 'a>> {
    Box::pin(answer(req, front, tcp, conn))
}

/// Answers one request; counts it in the metrics.
async fn answer(
    mut req: Request<Incoming>,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    let guard = conn.begin_request();
    let shared = front.shared();
    let path = req.uri().path().to_string();
    let on_ollama = tcp.local_addr().is_ok_and(|a| shared.on_ollama_listener(a));
    let found = if on_ollama && OLLAMA_ROOT.matches(&path) {
        Some(&OLLAMA_ROOT)
    } else {
        ROUTES.iter().find(|r| r.matches(&path))
    };
    let api = found.map_or_else(|| Api::of(&path), |r| r.api);
    let needs_key = match found.map_or(Key::Needed, |r| r.key) {
        Key::Needed => true,
        Key::Free => false,
        Key::AsMetrics => shared.access.metrics_keyed(),
    };
    let origin = req.headers().get(header::ORIGIN).cloned();
    let access = &shared.access;
    let mut response = if let Err(e) = access.admit(req.headers().get(header::HOST), origin.as_ref()) {
        api.error(&e)
    } else if req.method() == Method::OPTIONS && access.cors_allows(origin.as_ref()).is_some() {
        preflight(&req)
    } else {
        match access.authorize(needs_key, req.headers().get(header::AUTHORIZATION), req.headers().get("x-api-key")) {
            Err(e) => api.error(&e),
            Ok(key) => {
                let address = tcp.peer_addr().ok().map(|a| a.ip());
                req.extensions_mut().insert(Owner::of(key.as_deref(), address));
                route_to(found, req, &path, api, front, tcp, conn).await
            }
        }
    };
    if let Some(allowed) = access.cors_allows(origin.as_ref()) {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
        h.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    shared.metrics.request(found.map_or("other", |r| r.label(&path)), response.status().as_u16());
    response.body_mut().hold(guard);
    response
}

/// Hands a request to the route `found` for it, or answers 405 or 404 in `api`'s shape.
async fn route_to(
    found: Option<&Route>,
    req: Request<Incoming>,
    path: &str,
    api: Api,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    match found {
        Some(route) if route.takes(req.method()) => dispatch(route.endpoint, req, path, front, tcp, conn).await,
        Some(_) => api.error(&api.method_not_allowed(path, req.method())),
        None => api.error(&api.not_found(path)),
    }
}

/// Hands a request to the API that answers `endpoint`.
async fn dispatch(
    endpoint: Endpoint,
    req: Request<Incoming>,
    path: &str,
    front: &Front,
    tcp: &Arc<TcpStream>,
    conn: &Arc<ConnState>,
) -> Response<Body> {
    let shared = front.shared();
    match endpoint {
        E::ChatPage => status::chat_page(),
        E::StatusPage => status::status_page(),
        E::Status => status::status(shared),
        E::Health => status::health(shared),
        E::Metrics => status::metrics(shared),
        E::Models => openai::models(shared),
        E::Model => openai::model(shared, &path["/v1/models/".len()..]),
        E::Completions => openai::generate(req, front, tcp, conn, openai::Kind::Completion).await,
        E::ChatCompletions => openai::generate(req, front, tcp, conn, openai::Kind::Chat).await,
        E::Responses => openai::responses(req, front, tcp, conn).await,
        E::KeptResponse => openai::kept(req.method(), path, shared),
        E::Messages => anthropic::messages(req, front, tcp, conn).await,
        E::CountTokens => anthropic::count_tokens(req, front, conn).await,
        E::OllamaChat => ollama::chat(req, front, tcp, conn).await,
        E::OllamaGenerate => ollama::generate(req, front, tcp, conn).await,
        E::Tags => ollama::tags(shared),
        E::OllamaRunning => ollama::running(),
        E::Show => ollama::show(req, front, conn).await,
        E::Ps => ollama::ps(shared),
        E::Version => ollama::version(),
        E::Pull => ollama::pull(req, front, conn).await,
        E::Delete => ollama::delete(req, front, conn).await,
        E::OllamaUnsupported(what) => ollama::unsupported(path, what),
        E::Text(question) => llama_server::text(req, question, front, conn).await,
        E::Props => llama_server::props(front),
        E::Slots => llama_server::slots(front),
        E::SlotAction => llama_server::slot_action(req, path, front, conn).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route_of(path: &str) -> Option<&'static Route> {
        ROUTES.iter().find(|r| r.matches(path))
    }

    #[test]
    fn each_path_is_one_route_and_every_path_finds_its_own() {
        for (i, r) in ROUTES.iter().enumerate() {
            assert!(ROUTES[..i].iter().all(|o| o.path != r.path), "{} twice", r.path);
            let concrete = r.path.replace("{id}", "7");
            let found = route_of(&concrete).unwrap();
            assert_eq!(found.path, r.path, "{concrete} found another route");
        }
    }

    #[test]
    fn paths_below_a_route_match_as_its_kind_says_and_are_labelled_so() {
        let label = |p: &str| route_of(p).map_or("other", |r| r.label(p));
        assert_eq!(label("/v1/models/qwen3:30b"), "/v1/models/{id}");
        assert_eq!(label("/v1/models/"), "/v1/models/{id}");
        assert_eq!(label("/slots/0"), "/slots/{id}");
        assert_eq!(label("/api/blobs"), "/api/blobs");
        assert_eq!(label("/api/blobs/sha256:00"), "other");
        assert_eq!(route_of("/api/embeddings").unwrap().path, "/api/embeddings");
        assert!(route_of("/api/embeddingsx").is_none() && route_of("/v1/modelsx").is_none());
        assert_eq!(label("/nope"), "other");
    }

    #[test]
    fn methods_and_keys_are_the_tables() {
        let r = route_of("/api/tags").unwrap();
        assert!(r.takes(&Method::GET) && r.takes(&Method::HEAD) && !r.takes(&Method::POST));
        assert!(route_of("/v1/responses/x").unwrap().takes(&Method::DELETE), "any: its handler answers each");
        let free: Vec<&str> = ROUTES.iter().filter(|r| r.key != Key::Needed).map(|r| r.path).collect();
        assert_eq!(free, ["/", "/status.html", "/health", "/metrics"]);
    }

    #[test]
    fn a_path_in_no_route_is_answered_in_its_apis_room() {
        assert_eq!((Api::of("/v1/messages/x"), Api::of("/api/x"), Api::of("/x")), (Anthropic, Ollama, OpenAi));
        let e = Api::Anthropic.not_found("/v1/messages/x");
        assert_eq!(e.message, "no such endpoint: /v1/messages/x (see /v1/messages and /v1/messages/count_tokens)");
        let e = Api::Ollama.not_found("/api/x");
        assert_eq!(
            e.message,
            "no such endpoint: /api/x (Ollama's API here: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version, /api/pull, /api/delete)"
        );
        let e = Api::Anthropic.method_not_allowed("/v1/messages", &Method::GET);
        assert_eq!((e.status, e.message.as_str()), (405, "/v1/messages does not take GET; use POST"));
    }
}
