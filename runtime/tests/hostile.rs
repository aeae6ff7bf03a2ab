//! `sluice serve` against hostile clients: oversized heads, bodies and prompts, smuggling
//! attempts, malformed and foreign protocols, stalled and idle sockets, thousands of
//! connections under a small open-file limit, clients that leave mid-request, and access
//! control. Every error carries an OpenAI-style JSON body, and the server keeps serving.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod common;
mod serving;
use common::sluice_command;
use serving::*;

const GREEDY: &str = r#"{"prompt":"The quick brown fox","max_tokens":24,"temperature":0}"#;

/// A synthesized model and a ready server over it.
fn ready_server(dir: &Path, extra: &[&str]) -> Server {
    let model = synth(dir);
    let mut server = Server::start(dir, &model, extra);
    server.wait_note("READY=1");
    server
}

/// `bytes` sent on a fresh connection (written from a thread, so a server that stops reading
/// cannot block the test), and the response read back.
fn exchange(addr: SocketAddr, bytes: Vec<u8>) -> Response {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut writer = stream.try_clone().unwrap();
    std::thread::spawn(move || {
        let _ = writer.write_all(&bytes);
    });
    read_response(stream)
}

/// A POST of `body` with the given extra header lines.
fn post(path: &str, headers: &str, body: &str) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n{body}").into_bytes()
}

/// Whether the server closes `stream` (reads to its end) within [`PATIENCE`].
fn closed_by_server(mut stream: TcpStream) -> bool {
    let mut sink = Vec::new();
    match stream.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

fn assert_json_error(r: &Response, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}\n{}", r.head, r.body);
    assert_eq!(r.header("content-type").as_deref(), Some("application/json"), "{}", r.head);
    let v = r.json();
    let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("no error message: {}", r.body));
    assert!(v["error"]["type"].is_string(), "{}", r.body);
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
}

#[test]
fn oversized_heads_bodies_and_prompts_are_refused_with_json_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = ready_server(dir.path(), &[]);
    let big_header = format!("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "a".repeat(1 << 20));
    assert_json_error(&exchange(server.addr, big_header.into_bytes()), 431, "headers are too large");
    let many_headers: String = (0..2000).map(|i| format!("X-H{i}: v\r\n")).collect();
    let r = exchange(server.addr, format!("GET /health HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n").into_bytes());
    assert_json_error(&r, 431, "headers are too large");

    // Prompts that cannot fit the context are refused before tokenizing, whatever their size.
    for mib in [1, 4] {
        let prompt = serde_json::json!({ "prompt": "fox ".repeat(mib << 18), "max_tokens": 4 }).to_string();
        let r =
            exchange(server.addr, post("/v1/completions", &format!("Content-Length: {}\r\n", prompt.len()), &prompt));
        assert_json_error(&r, 400, "maximum context length is 4096 tokens");
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    }
    // A body over the limit (8 MiB by default) is refused from its Content-Length.
    let r = exchange(server.addr, post("/v1/completions", &format!("Content-Length: {}\r\n", 9 << 20), ""));
    assert_json_error(&r, 413, "over 8388608 bytes");
    assert_eq!(server.metric("sluice_prompt_tokens_total"), 0.0, "nothing was tokenized");
    let ok = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[test]
fn smuggling_malformed_and_foreign_requests_get_an_answer_or_a_close() {
    let dir = tempfile::tempdir().unwrap();
    let server = ready_server(dir.path(), &["--header-timeout-secs", "3"]);
    let addr = server.addr;
    let r = exchange(addr, post("/v1/completions", "Content-Length: 5\r\nContent-Length: 6\r\n", "hello!"));
    assert_json_error(&r, 400, "malformed HTTP request");
    for headers in [
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        "Transfer-Encoding: chunked\r\n",
    ] {
        let r = exchange(addr, post("/v1/completions", headers, "5\r\nhello\r\n0\r\n\r\n"));
        assert_json_error(&r, 400, "Transfer-Encoding request bodies are not accepted");
    }
    assert_json_error(&exchange(addr, post("/v1/completions", "", "")), 411, "no Content-Length");
    let r = exchange(addr, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Caf\xc3\xa9: 1\r\n\r\n".to_vec());
    assert_json_error(&r, 400, "malformed HTTP request");
    let r =
        exchange(addr, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Name: caf\xc3\xa9\r\n\r\n".to_vec());
    assert_eq!(r.status, 200, "a non-ASCII header value is answered: {}", r.head);
    assert_json_error(&exchange(addr, b"GET /\x01 HTTP/1.1\r\n\r\n".to_vec()), 400, "malformed");

    // HTTP/2's preface: closed (this server speaks HTTP/1.x).
    let h2 = send_raw(addr, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00");
    assert!(closed_by_server(h2), "an HTTP/2 preface was neither answered nor closed");

    // HTTP/1.0: answered, then closed.
    let r = read_response(send_raw(addr, b"GET /health HTTP/1.0\r\n\r\n"));
    assert_eq!(r.status, 200, "{}", r.head);
    assert!(r.head.starts_with("HTTP/1.0 200"), "{}", r.head);

    // Keep-alive: several requests on one connection.
    let mut s = send_raw(addr, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    for second in [false, true] {
        while seen.matches("{\"status\":\"ready\"}").count() < 1 + usize::from(second) {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "closed after a keep-alive response: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        if !second {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        }
    }
    assert!(closed_by_server(s));
    assert_eq!(server.request("GET", "/health", None).status, 200);
}

#[test]
fn idle_stalled_and_unread_connections_are_closed_after_their_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let server = ready_server(dir.path(), &["--header-timeout-secs", "1", "--idle-timeout-secs", "2"]);
    let addr = server.addr;
    // Nothing sent, half a head sent, idle after a response on a keep-alive connection.
    let silent = TcpStream::connect(addr).unwrap();
    silent.set_read_timeout(Some(PATIENCE)).unwrap();
    assert!(closed_by_server(silent), "a silent connection stayed open");
    assert!(closed_by_server(send_raw(addr, b"GET /health HTTP/1.1\r\nHo")), "a stalled head stayed open");
    let mut idle = send_raw(addr, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut buf = [0u8; 4096];
    assert!(idle.read(&mut buf).unwrap() > 0);
    assert!(closed_by_server(idle), "an idle keep-alive connection stayed open");
    // A body that stops arriving: 408.
    let r = read_response(send_raw(addr, &post("/v1/completions", "Content-Length: 100\r\n", "{\"prompt\":")));
    assert_json_error(&r, 408, "did not arrive within 2 s");
    assert_eq!(server.metric("sluice_connections_open"), 1.0, "only the metrics request is open");
}

#[test]
fn thousands_of_stalled_connections_under_a_small_file_limit_do_not_starve_clients() {
    if std::process::Command::new("prlimit").arg("--version").output().is_err() {
        eprintln!("skipped: no prlimit (util-linux) to give the server a small open-file limit");
        return;
    }
    // This process holds the stalled sockets: it needs more than the server gets.
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    assert!(hard >= 2100, "the test needs 2100 open files, the hard limit is {hard}");
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start_under(
        dir.path(),
        &model,
        &["--header-timeout-secs", "60"],
        &["prlimit", "--nofile=1024:1024", "--"],
    );
    server.wait_note("READY=1");
    let reference = server.request("POST", "/v1/completions", Some(GREEDY)).json()["choices"][0]["text"].clone();
    let mut stalled = Vec::new();
    for _ in 0..2000 {
        if let Ok(s) = TcpStream::connect_timeout(&server.addr, Duration::from_secs(20)) {
            stalled.push(s);
        }
    }
    assert!(stalled.len() >= 1900, "only {} of 2000 connections were made", stalled.len());
    let health = server.request("GET", "/health", None);
    assert_eq!(health.status, 200, "{}", health.body);
    let r = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["text"], reference);
    assert!(server.child.try_wait().unwrap().is_none(), "the server exited; log:\n{}", server.log());
    let open = server.metric("sluice_connections_open");
    assert!(open <= 512.0, "{open} connections open, over the cap");
    drop(stalled);
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(!log.contains("panicked"), "{log}");
}

/// Starts a long streamed generation and returns its connection once the first token arrived.
fn long_stream(addr: SocketAddr) -> std::io::BufReader<TcpStream> {
    let body = r#"{"prompt":"The quick brown fox","max_tokens":3000,"temperature":0,"stream":true}"#;
    let mut r = std::io::BufReader::new(send(addr, "POST", "/v1/completions", Some(body)));
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut r).expect("a first event").starts_with("data: "));
    r
}

#[test]
fn when_every_connection_is_in_a_request_a_new_one_gets_503() {
    let dir = tempfile::tempdir().unwrap();
    let server = ready_server(dir.path(), &["--max-connections", "2", "--idle-timeout-secs", "600"]);
    // Two requests whose bodies never finish arriving: both connections stay in a request.
    let partial = || send_raw(server.addr, &post("/v1/completions", "Content-Length: 100\r\n", "{\"prompt\":"));
    let (first, _second) = (partial(), partial());
    // Until the server has read a request's head, its connection is idle and a newcomer at the
    // cap may take its place; give it ample time to read both.
    std::thread::sleep(Duration::from_secs(2));
    let refused = server.request("GET", "/health", None);
    assert_json_error(&refused, 503, "every connection is in use");
    assert_eq!(refused.header("retry-after").as_deref(), Some("1"));
    // One leaves: the next client gets in.
    drop(first);
    let t0 = Instant::now();
    while server.request("GET", "/health", None).status != 200 {
        assert!(t0.elapsed() < PATIENCE, "no connection was admitted after one closed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.metric("sluice_connections_refused_total") >= 1.0);
}

#[test]
fn a_client_that_leaves_cancels_its_generation_whether_streaming_waiting_or_queued() {
    let dir = tempfile::tempdir().unwrap();
    let server = ready_server(dir.path(), &["--queue", "2"]);
    let addr = server.addr;
    let reference = server.request("POST", "/v1/completions", Some(GREEDY)).json()["choices"][0]["text"].clone();
    let long = r#"{"prompt":"The quick brown fox","max_tokens":3000,"temperature":0}"#;
    let mut cancelled = 0.0;
    // Non-streaming, with and without keep-alive: the client waits, then leaves.
    for connection in ["keep-alive", "close"] {
        let head = format!("Connection: {connection}\r\nContent-Length: {}\r\n", long.len());
        let s = send_raw(addr, format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n{long}").as_bytes());
        let t0 = Instant::now();
        while server.metric("sluice_queued_requests") > 0.0 || t0.elapsed() < Duration::from_millis(300) {
            assert!(t0.elapsed() < PATIENCE);
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(s);
        cancelled += 1.0;
        let t0 = Instant::now();
        while server.metric("sluice_generations_cancelled_total") < cancelled {
            assert!(t0.elapsed() < PATIENCE, "a waiting client that left ({connection}) was not cancelled");
            std::thread::sleep(Duration::from_millis(20));
        }
        let next = server.request("POST", "/v1/completions", Some(GREEDY));
        assert_eq!(next.json()["choices"][0]["text"], reference);
    }
    // Queued behind a stream, then gone: never run.
    let running = long_stream(addr);
    let queued = send(addr, "POST", "/v1/completions", Some(long));
    let t0 = Instant::now();
    while server.metric("sluice_queued_requests") < 1.0 {
        assert!(t0.elapsed() < PATIENCE, "the request never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let tokens_before = server.metric("sluice_completion_tokens_total");
    drop(queued);
    std::thread::sleep(Duration::from_millis(500));
    drop(running);
    let next = server.request("POST", "/v1/completions", Some(GREEDY));
    assert_eq!(next.json()["choices"][0]["text"], reference);
    assert_eq!(
        server.metric("sluice_generations_cancelled_total"),
        cancelled + 2.0,
        "the stream and the queued request"
    );
    let generated = server.metric("sluice_completion_tokens_total") - tokens_before;
    assert!(generated < 3000.0, "the queued request of a departed client ran ({generated} tokens)");
}

#[test]
fn an_api_key_guards_the_api_and_cors_admits_listed_origins() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, "s3cret-key\n").unwrap();
    let server = ready_server(
        dir.path(),
        &["--api-key-file", key_file.to_str().unwrap(), "--cors-origin", "https://app.example"],
    );
    let addr = server.addr;
    let get = |path: &str, headers: &str| {
        exchange(addr, format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n").into_bytes())
    };
    let r = get("/v1/models", "");
    assert_json_error(&r, 401, "didn't provide an API key");
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    assert_eq!(r.header("www-authenticate").as_deref(), Some("Bearer"));
    assert_json_error(&get("/v1/models", "Authorization: Bearer wrong\r\n"), 401, "Incorrect API key");
    assert_eq!(get("/v1/models", "Authorization: Bearer s3cret-key\r\n").status, 200);
    assert_eq!(get("/health", "").status, 200);
    assert_eq!(get("/metrics", "").status, 200);

    let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let r = exchange(
        addr,
        post(
            "/v1/completions",
            &format!(
                "Authorization: Bearer s3cret-key\r\nOrigin: https://app.example\r\nContent-Length: {}\r\n",
                GREEDY.len()
            ),
            GREEDY,
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin").as_deref(), Some("https://app.example"));
    let created = r.json()["created"].as_u64().unwrap();
    let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    assert!((before..=after).contains(&created), "created {created} is not the request's time ({before}..{after})");

    let preflight = exchange(
        addr,
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: https://app.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\r\n".to_vec(),
    );
    assert_eq!(preflight.status, 204, "{}", preflight.head);
    assert_eq!(preflight.header("access-control-allow-origin").as_deref(), Some("https://app.example"));
    assert!(preflight.header("access-control-allow-methods").unwrap().contains("POST"));
    let other = get("/health", "Origin: https://evil.example\r\n");
    assert_eq!(other.header("access-control-allow-origin"), None);

    // With --metrics-need-key, /metrics is keyed too; the key can come from the environment.
    let model = dir.path().join("m.gguf");
    let mut keyed =
        Server::start_with_env(dir.path(), &model, &["--metrics-need-key"], &[("SLUICE_API_KEY", "env-key")]);
    keyed.wait_note("READY=1");
    assert_eq!(keyed.request("GET", "/metrics", None).status, 401);
    assert_eq!(keyed.request("GET", "/health", None).status, 200);
}

#[test]
fn sigterm_while_a_long_prompt_is_tokenized_stops_within_the_drain_bound() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("long.gguf");
    let o = sluice_command().args(["synth", "--out", model.to_str().unwrap(), "--ctx", "262144"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut server = Server::start(dir.path(), &model, &["--ctx", "262144", "--drain-secs", "2"]);
    server.wait_note("READY=1");
    // Admissible (under the byte bound), and long to tokenize and evaluate.
    let prompt = serde_json::json!({ "prompt": "fox ".repeat(240_000), "max_tokens": 1 }).to_string();
    let s = send_raw(server.addr, &post("/v1/completions", &format!("Content-Length: {}\r\n", prompt.len()), &prompt));
    std::thread::sleep(Duration::from_millis(500));
    let (status, elapsed, notes, log) = server.stop();
    drop(s);
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(notes.iter().any(|n| n == "STOPPING=1"), "{notes:?}");
    assert!(elapsed < Duration::from_secs(2 + 20), "took {elapsed:?} to stop with a 2 s drain bound; log:\n{log}");
}

/// A pids cgroup (v1) holding `pid`, whose task limit is set to what it runs now; `None` where
/// this process cannot make one (not root, no pids controller).
struct PidsCgroup(std::path::PathBuf);

impl PidsCgroup {
    fn freeze_task_count(pid: u32) -> Option<PidsCgroup> {
        let dir = Path::new("/sys/fs/cgroup/pids").join(format!("sluice-test-{}", std::process::id()));
        std::fs::create_dir(&dir).ok()?;
        let cg = PidsCgroup(dir);
        std::fs::write(cg.0.join("cgroup.procs"), pid.to_string()).ok()?;
        let current = std::fs::read_to_string(cg.0.join("pids.current")).ok()?;
        std::fs::write(cg.0.join("pids.max"), current.trim()).ok()?;
        Some(cg)
    }
}

impl Drop for PidsCgroup {
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.0.join("cgroup.procs")) {
            for p in procs.lines() {
                let _ = std::fs::write("/sys/fs/cgroup/pids/cgroup.procs", p);
            }
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn no_new_thread_is_needed_to_serve_many_clients() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ready_server(dir.path(), &[]);
    let Some(_cgroup) = PidsCgroup::freeze_task_count(server.child.id()) else {
        eprintln!("skipped: cannot put the server in a pids cgroup (needs root and cgroup v1 pids)");
        return;
    };
    // Not one more thread may start: 64 clients at once are still served.
    let clients: Vec<_> = (0..64)
        .map(|i| {
            let addr = server.addr;
            std::thread::spawn(move || {
                let (path, body) = if i % 8 == 0 { ("/v1/completions", Some(GREEDY)) } else { ("/health", None) };
                let method = if body.is_some() { "POST" } else { "GET" };
                request(addr, method, path, body).status
            })
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap(), 200);
    }
    assert_eq!(server.request("POST", "/v1/completions", Some(GREEDY)).status, 200);
    assert!(server.child.try_wait().unwrap().is_none(), "the server exited; log:\n{}", server.log());
}
