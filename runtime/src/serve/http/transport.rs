//! One connection's transport: the TCP stream that hyper reads and writes, shared with the
//! connection's supervisor, which watches for a peer that went away or stopped reading.
//!
//! It also gives hyper's own error responses (400 for a malformed request, 431 for headers over
//! the limit, 414 for a long URI) the OpenAI-style JSON body every other error carries: hyper
//! writes those with an empty body and no `Content-Type`, which no response of ours lacks.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

use super::conn::ConnState;
use crate::serve::error::ApiError;

/// The stream as tokio's `AsyncRead`/`AsyncWrite` over a shared `TcpStream`.
pub struct Transport {
    stream: Arc<TcpStream>,
    state: Arc<ConnState>,
    /// A rewritten error response still to be written, and how much of it is.
    pending: Vec<u8>,
    written: usize,
}

impl Transport {
    /// Wraps `stream`; writes that block are reported to `state`.
    pub fn new(stream: Arc<TcpStream>, state: Arc<ConnState>) -> Transport {
        Transport { stream, state, pending: Vec::new(), written: 0 }
    }

    fn poll_send(&self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            if self.stream.poll_write_ready(cx).is_pending() {
                self.state.write_blocked();
                return Poll::Pending;
            }
            match self.stream.try_write(buf) {
                Ok(n) => {
                    self.state.write_progressed();
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Writes what is left of a rewritten response.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(self.poll_send(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Transport {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            match self.stream.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        // hyper answers a request it cannot parse by itself, never while one of ours is open.
        let own_error = if self.state.in_request() { None } else { with_json_error_body(buf) };
        if let Some(whole) = own_error {
            self.pending = whole;
            return Poll::Ready(Ok(buf.len()));
        }
        self.poll_send(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_pending(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        let _ = socket2::SockRef::from(&*self.stream).shutdown(std::net::Shutdown::Write);
        Poll::Ready(Ok(()))
    }
}

/// How often [`peer_gone`] looks again while request bytes it cannot see past are waiting.
const PEER_POLL: Duration = Duration::from_millis(200);

/// Completes when the peer has closed the connection (or it failed). Data the peer sent that
/// nobody read yet (a pipelined request) hides a close behind it until it is read, so while
/// there is some, it looks again every [`PEER_POLL`]. A peer that only shut its sending side
/// counts as gone: HTTP clients do not half-close while they wait for a response.
pub async fn peer_gone(stream: &TcpStream) {
    loop {
        match stream.ready(Interest::READABLE).await {
            Ok(r) if r.is_read_closed() || r.is_error() => return,
            Ok(_) => tokio::time::sleep(PEER_POLL).await,
            Err(_) => return,
        }
    }
}

/// The whole response for one hyper wrote without a body: `head` is an error status line and
/// headers without `Content-Type`. `None` for anything else (every response of ours has a
/// `Content-Type`).
fn with_json_error_body(head: &[u8]) -> Option<Vec<u8>> {
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")?;
    let text = std::str::from_utf8(&head[..end]).ok()?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next()?;
    let mut parts = status_line.splitn(3, ' ');
    let (version, code) = (parts.next()?, parts.next()?.parse::<u16>().ok()?);
    if !version.starts_with("HTTP/1.") || code < 400 || head.len() != end + 4 {
        return None;
    }
    let mut kept = Vec::new();
    for line in lines {
        let name = line.split(':').next().unwrap_or("").trim().to_ascii_lowercase();
        match name.as_str() {
            "content-type" => return None,
            "content-length" | "connection" => {}
            _ => kept.push(line),
        }
    }
    let reason = parts.next().unwrap_or("");
    let message = match code {
        431 => "the request's headers are too large; send fewer or shorter headers".to_string(),
        414 => "the request's URI is too long".to_string(),
        505 => "HTTP version not supported; use HTTP/1.1 or HTTP/1.0".to_string(),
        _ => format!("malformed HTTP request ({reason})"),
    };
    Some(closing_json_response(status_line, &kept, &ApiError::new(code, "invalid_request_error", message)))
}

/// A whole response written without hyper: `status_line`, the JSON body of `e`, `headers`
/// besides, and `connection: close`.
pub fn closing_json_response(status_line: &str, headers: &[&str], e: &ApiError) -> Vec<u8> {
    let body = e.body();
    let mut out = format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for line in headers {
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.push_str(&body);
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_bodiless_errors_get_a_json_body() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Tue, 01 Dec 2026 12:00:00 GMT\r\n\r\n";
        let out = String::from_utf8(with_json_error_body(head).unwrap()).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 "), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        assert!(head.contains("content-type: application/json") && head.contains("connection: close"), "{head}");
        assert!(head.contains("date: Tue"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("headers are too large"));
        let bad = with_json_error_body(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n").unwrap();
        assert!(String::from_utf8(bad).unwrap().contains("malformed HTTP request (Bad Request)"));
    }

    #[test]
    fn responses_of_ours_pass_unchanged() {
        for head in [
            &b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}",
            b"data: {\"x\": 1}\n\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-len",
        ] {
            assert_eq!(with_json_error_body(head), None, "{}", String::from_utf8_lossy(head));
        }
    }
}
