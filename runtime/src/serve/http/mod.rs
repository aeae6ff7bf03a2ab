//! The HTTP/1.1 front: hyper connections on one tokio current-thread runtime, with limits that
//! hold against hostile clients.
//!
//! - Request heads: at most [`HttpLimits::header_bytes`] (431 beyond) and
//!   [`HttpLimits::header_timeout`] to arrive, which is also how long an idle keep-alive
//!   connection stays open; hyper enforces both.
//! - Bodies: at most [`HttpLimits::body_bytes`] (413), within [`HttpLimits::idle_timeout`] (408),
//!   and all bodies being read at once share a byte budget (503 beyond it), so many large
//!   uploads cannot exhaust memory. Only `Content-Length` bodies are taken: a
//!   `Transfer-Encoding` body (alone, or beside a `Content-Length`: request smuggling) is 400,
//!   as conflicting `Content-Length` values are (hyper).
//! - Connections: at most [`HttpLimits::max_connections`], below the open-file limit; at the cap
//!   the least recently active connection that is not in a request gives way
//!   ([`conn::Registry`]), and when all are in a request the new one gets 503. A response the
//!   client stops reading is dropped after [`HttpLimits::idle_timeout`].
//! - `accept` failing for want of file descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
//!   evicts an idle connection and pauses accepting briefly instead of ending the server.
//! - Closing: after the last response the write side is shut and what the client still sends
//!   is read and discarded for a moment (a lingering close), so a client still sending an
//!   oversized request reads its 413 or 431 instead of a reset.

mod body;
pub mod conn;
mod exchange;
mod parse;
mod response;
mod transport;

pub(crate) use body::{typed_events, Body, CancelOnDrop, EventSource, Gone, Translate, Translated};
pub(crate) use exchange::{
    enqueue, event_stream, off_thread, owner_of, queue, read_body, ready_body, started, streamed, whole_generation,
    Ended, Queued,
};
pub(crate) use parse::{parse, parse_ignoring, parse_value};
pub(crate) use response::{error, error_with, json_response, preflight};

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::error::ApiError;
use super::shared::Shared;
use conn::Registry;
use transport::Transport;

/// The HTTP front's limits.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Connections open at once (further capped by the open-file limit).
    pub max_connections: usize,
    /// Largest request head (request line and headers).
    pub header_bytes: usize,
    /// Largest request body.
    pub body_bytes: usize,
    /// Time for a request head to arrive, and for an idle keep-alive connection to stay open.
    pub header_timeout: Duration,
    /// Time for a request body to arrive, and for a client to resume reading its response.
    pub idle_timeout: Duration,
}

/// How long accepting pauses after running out of file descriptors or memory.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// How often the acceptor reports that it is alive when no client connects.
const ACCEPTOR_BEAT: Duration = Duration::from_millis(250);
/// How often a connection's supervisor checks for a client that stopped reading.
const STALL_CHECK: Duration = Duration::from_millis(500);
/// A lingering close reads what the client still sends for at most this long...
const LINGER_TIME: Duration = Duration::from_secs(2);
/// ... and at most this much.
const LINGER_BYTES: usize = 64 << 20;
/// Connections refused with 503 that may linger at once; more are closed at once.
const MAX_REFUSING: usize = 64;

/// What answers each request: the router above the APIs ([`crate::serve::routes`]), which this
/// transport knows only as this function.
pub type Handler = for<'a> fn(
    Request<Incoming>,
    &'a Front,
    &'a Arc<TcpStream>,
    &'a Arc<conn::ConnState>,
) -> Pin<Box<dyn Future<Output = Response<Body>> + Send + 'a>>;

/// The running front: limits, connections, and what its requests share.
pub struct Front {
    handler: Handler,
    limits: HttpLimits,
    shared: Arc<Shared>,
    registry: Registry,
    /// Bytes of request bodies being read, all connections together.
    body_budget: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    http: http1::Builder,
    /// The parser thread's queue ([`Front::parse`]).
    parser: std::sync::mpsc::Sender<ParseWork>,
}

/// A body's parse and translation, run on the parser thread.
pub(crate) type ParseWork = Box<dyn FnOnce() + Send>;

impl Front {
    /// A front answering with `handler` within `limits`, its connection cap lowered to what
    /// `fd_room` more file descriptors allow, with its parser thread started.
    pub fn new(handler: Handler, limits: HttpLimits, shared: Arc<Shared>, fd_room: usize) -> std::io::Result<Front> {
        let cap = limits.max_connections.min(fd_room.saturating_sub(MAX_REFUSING)).max(1);
        if cap < limits.max_connections {
            log::warn!(
                "at most {cap} connections (not {}): the open-file limit leaves room for no more; raise LimitNOFILE",
                limits.max_connections
            );
        }
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_header_size(limits.header_bytes)
            .max_buf_size(limits.header_bytes.max(8192) + 8192)
            .keep_alive(true)
            .half_close(false);
        let body_budget = Arc::new(Semaphore::new(limits.body_bytes.saturating_mul(2).min(Semaphore::MAX_PERMITS)));
        let (parser, work) = std::sync::mpsc::channel::<ParseWork>();
        std::thread::Builder::new().name("sluice-parse".into()).spawn(move || {
            for w in work {
                w();
            }
        })?;
        Ok(Front {
            handler,
            limits,
            shared,
            registry: Registry::new(cap),
            body_budget,
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
            http,
            parser,
        })
    }

    /// Hands `work` (a body's JSON parse and its API's translation, each bounded by the body's
    /// shape: [`parse::check_shape`]) to the parser thread, started with the front: the I/O
    /// thread serves the other connections meanwhile, one body is parsed at a time, and no
    /// thread is started per request.
    pub(crate) fn parse(&self, work: ParseWork) -> Result<(), ApiError> {
        self.parser.send(work).map_err(|_| ApiError::new(500, "server_error", "the request parser stopped"))
    }

    /// The open connections.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Accepts connections until the task is dropped, beating the acceptor's heartbeat.
    pub async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        let mut last_warning: Option<Instant> = None;
        loop {
            self.shared.acceptor_beat();
            let accepted = tokio::select! {
                r = listener.accept() => r,
                () = tokio::time::sleep(ACCEPTOR_BEAT) => continue,
            };
            match accepted {
                Ok((tcp, _)) => self.admit(tcp),
                Err(e) if out_of_resources(&e) => {
                    self.shared.metrics.accept_error();
                    let evicted = self.registry.evict_one();
                    if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        log::warn!(
                            "cannot accept a connection ({e}); {}pausing accepts for {} ms (raise LimitNOFILE or lower --max-connections)",
                            if evicted { "closed an idle connection, " } else { "" },
                            ACCEPT_PAUSE.as_millis()
                        );
                        last_warning = Some(Instant::now());
                    }
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
                Err(e) => log::debug!("accept: {e}"),
            }
        }
    }

    /// Serves a new connection, or refuses it with 503 when every connection is busy.
    fn admit(self: &Arc<Self>, tcp: TcpStream) {
        let _ = tcp.set_nodelay(true);
        match self.registry.admit() {
            Ok((id, state)) => {
                self.shared.metrics.connection_opened();
                let front = Arc::clone(self);
                tokio::spawn(async move {
                    front.serve_connection(Arc::new(tcp), &state).await;
                    front.registry.remove(id);
                    front.shared.metrics.connection_closed();
                });
            }
            Err(conn::Full) => {
                self.shared.metrics.connection_refused();
                let Ok(permit) = Arc::clone(&self.refusing).try_acquire_owned() else { return };
                tokio::spawn(async move {
                    let e = ApiError::new(
                        503,
                        "server_error",
                        "the server is busy: every connection is in use; retry later",
                    );
                    let response =
                        transport::closing_json_response("HTTP/1.1 503 Service Unavailable", &["retry-after: 1"], &e);
                    let tcp = Arc::new(tcp);
                    let _ = tokio::time::timeout(LINGER_TIME, write_all(&tcp, &response)).await;
                    linger(&tcp).await;
                    drop(permit);
                });
            }
        }
    }

    /// Runs hyper on one connection until it ends, it is evicted, or its client stops reading.
    async fn serve_connection(self: &Arc<Self>, tcp: Arc<TcpStream>, state: &Arc<conn::ConnState>) {
        let service = {
            let (front, tcp, state) = (Arc::clone(self), Arc::clone(&tcp), Arc::clone(state));
            hyper::service::service_fn(move |req| {
                let (front, tcp, state) = (Arc::clone(&front), Arc::clone(&tcp), Arc::clone(&state));
                async move { Ok::<_, std::convert::Infallible>((front.handler)(req, &front, &tcp, &state).await) }
            })
        };
        let connection =
            self.http.serve_connection(TokioIo::new(Transport::new(Arc::clone(&tcp), Arc::clone(state))), service);
        tokio::pin!(connection);
        let mut check = tokio::time::interval(STALL_CHECK);
        loop {
            tokio::select! {
                r = connection.as_mut() => {
                    if let Err(e) = r {
                        log::debug!("connection ended: {e}");
                    }
                    break;
                }
                () = state.close.notified() => {
                    log::debug!("connection evicted to make room");
                    return;
                }
                _ = check.tick() => {
                    if state.write_stalled_for() > self.limits.idle_timeout {
                        log::info!("closing a connection whose client stopped reading for {} s", self.limits.idle_timeout.as_secs());
                        return;
                    }
                }
            }
        }
        tokio::select! {
            () = linger(&tcp) => {}
            () = state.close.notified() => {}
        }
    }

    /// The limits.
    pub fn limits(&self) -> &HttpLimits {
        &self.limits
    }

    /// What the requests share.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Bytes of request bodies being read, all connections together.
    pub fn body_budget(&self) -> &Arc<Semaphore> {
        &self.body_budget
    }
}

/// Raises the soft open-file limit to the hard one, and returns how many more descriptors
/// connections may use: the limit less those open now and `reserve` for the rest of the
/// server (model files, reader lanes).
pub fn fd_room(reserve: usize) -> usize {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                log::warn!("cannot raise the open-file limit from {soft} to {hard}: {e}");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    };
    let open = std::fs::read_dir("/proc/self/fd").map_or(16, |d| d.count());
    usize::try_from(soft).unwrap_or(usize::MAX).saturating_sub(open + reserve)
}

/// Whether `accept` failed for want of file descriptors or memory.
fn out_of_resources(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// Writes `bytes` whole.
async fn write_all(tcp: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        tcp.writable().await?;
        match tcp.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and discards what the client still sends, until it closes, for a bounded time and
/// amount: closing a socket with unread data resets it, and the client would lose the
/// response it has not read yet.
async fn linger(tcp: &TcpStream) {
    let _ = socket2::SockRef::from(tcp).shutdown(std::net::Shutdown::Write);
    let drain = async {
        let mut buf = vec![0u8; 16 << 10];
        let mut total = 0;
        while total < LINGER_BYTES {
            if tcp.readable().await.is_err() {
                return;
            }
            match tcp.try_read(&mut buf) {
                Ok(0) => return,
                Ok(n) => total += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}
