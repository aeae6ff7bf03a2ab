//! What `sluice chat` talks to: a running server (`--url`), or `sluice serve` started for the
//! chat on a loopback port with a key of its own (in its own process group, so the terminal's
//! Ctrl-C reaches the chat alone); and its streamed answers, read on a thread that stops reading
//! (and so closes the connection, which cancels the generation) when the answer is stopped.
//!
//! The server is not trusted: every wait on it is bounded or given up at Ctrl-C, what it sends
//! is bounded (an event line, an error body, a JSON answer), and a stream that ends without its
//! `[DONE]` is a failed answer, not a finished one. What it says reaches the terminal only
//! through [`sluice::text::escaped`] (the caller's part).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use sluice::serve::config::ServeSettings;

/// How long a started server may take to load its model.
const LOAD_PATIENCE: Duration = Duration::from_secs(600);
/// How long a connection to the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a GET (`/status`, `/health`) may take, whole.
const GET_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest server-sent event line read; a longer one fails the answer.
const MAX_EVENT_LINE: u64 = 1 << 20;
/// The largest JSON answer or error body read.
const MAX_BODY: u64 = 1 << 20;

/// The server started for a chat: its process and its directory (settings, log).
pub struct OwnServer {
    child: Child,
    dir: tempfile::TempDir,
}

impl OwnServer {
    /// Stops the server (SIGTERM, then waits) and removes its directory.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
        let _ = self.dir.close();
    }
}

/// A server to chat with.
pub struct Link {
    base: String,
    key: Option<String>,
    agent: ureq::Agent,
    /// The server started for this chat, shared with whoever stops it on a signal.
    own: Arc<Mutex<Option<OwnServer>>>,
}

/// What a streamed answer brings.
#[derive(Debug)]
pub enum Piece {
    /// Thinking text.
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// The end: why, and the tokens generated.
    Done { finish: String, tokens: u64 },
    /// The request failed.
    Failed(String),
}

impl Link {
    /// A running server at `url`.
    pub fn remote(url: &str, key: Option<String>) -> Link {
        Link { base: url.trim_end_matches('/').to_string(), key, agent: agent(), own: Arc::default() }
    }

    /// `sluice serve` with `settings`, started for this chat and kept in `own` (where a signal's
    /// handler finds it); returns once its model is loaded.
    pub fn start(
        settings: &ServeSettings,
        interrupted: &AtomicBool,
        own: Arc<Mutex<Option<OwnServer>>>,
    ) -> Result<Link> {
        let dir = tempfile::tempdir().context("cannot make a directory for the chat's server")?;
        let config = dir.path().join("sluice.toml");
        let mut settings = settings.clone();
        settings.listen = None;
        std::fs::write(&config, toml::to_string(&settings).context("cannot write the chat's settings")?)
            .with_context(|| format!("cannot write {}", config.display()))?;
        let port =
            TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).context("no free loopback port")?.port();
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no random key: {e}"))?;
        let key: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let log = dir.path().join("serve.log");
        let child = Command::new(std::env::current_exe().context("cannot find the sluice binary")?)
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--drain-secs", "1"])
            .env("SLUICE_API_KEY", &key)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).with_context(|| format!("cannot write {}", log.display()))?)
            .process_group(0)
            .spawn()
            .context("cannot start sluice serve")?;
        *own.lock().unwrap_or_else(PoisonError::into_inner) = Some(OwnServer { child, dir });
        let link = Link { base: format!("http://127.0.0.1:{port}"), key: Some(key), agent: agent(), own };
        link.wait_ready(&log, interrupted)?;
        Ok(link)
    }

    /// Waits for `/health` to say ready; the server's log tells why when it stops first, and
    /// Ctrl-C (`interrupted`) gives up.
    fn wait_ready(&self, log: &Path, interrupted: &AtomicBool) -> Result<()> {
        let t0 = Instant::now();
        loop {
            if interrupted.load(Ordering::Relaxed) {
                bail!("interrupted while the model loaded");
            }
            if let Some(own) = self.own.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
                if let Some(status) = own.child.try_wait()? {
                    let text = std::fs::read_to_string(log).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(5).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    bail!("the model could not be served ({status}):\n{}", tail.join("\n"));
                }
            }
            if self.get("/health", interrupted).is_ok_and(|v| v["status"] == "ready") {
                return Ok(());
            }
            if t0.elapsed() > LOAD_PATIENCE {
                bail!("the model did not load within {} s", LOAD_PATIENCE.as_secs());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A GET of `path`, as JSON, within [`GET_TIMEOUT`]; Ctrl-C (`interrupted`) gives up on
    /// it at once.
    pub fn get(&self, path: &str, interrupted: &AtomicBool) -> Result<Value> {
        let mut req = self.agent.get(format!("{}{path}", self.base)).config().timeout_global(Some(GET_TIMEOUT)).build();
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let text = req.call().and_then(|mut r| r.body_mut().with_config().limit(MAX_BODY).read_to_string());
            let _ = tx.send(text);
        });
        let text = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(text) => break text.with_context(|| format!("{}{path}", self.base))?,
                Err(RecvTimeoutError::Timeout) if interrupted.load(Ordering::Relaxed) => bail!("interrupted"),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => bail!("{}{path}: no answer", self.base),
            }
        };
        serde_json::from_str(&text).with_context(|| format!("{path} did not answer JSON"))
    }

    /// Streams the answer to `body` (a chat request) on a thread: its pieces, in order. Setting
    /// `stop` ends it (the connection is closed at the next piece, which cancels the generation).
    pub fn stream(&self, body: &Value, stop: Arc<AtomicBool>) -> Receiver<Piece> {
        let (tx, rx) = channel();
        let mut req =
            self.agent.post(format!("{}/v1/chat/completions", self.base)).header("Content-Type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let bytes = body.to_string().into_bytes();
        std::thread::spawn(move || {
            let fail = |m: String| Piece::Failed(m);
            let resp = match req.send(&bytes[..]) {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(fail(format!("cannot reach the server: {e}")));
                    return;
                }
            };
            let status = resp.status().as_u16();
            let mut reader = BufReader::new(resp.into_body().into_reader());
            if status != 200 {
                let mut text = String::new();
                let _ = std::io::Read::read_to_string(&mut std::io::Read::take(&mut reader, MAX_BODY), &mut text);
                let message = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(str::to_string));
                let _ = tx.send(fail(message.unwrap_or(format!("the server answered {status}"))));
                return;
            }
            read_events(&mut reader, &tx, &stop);
        });
        rx
    }
}

/// Reads server-sent events into pieces until the stream ends, fails, or `stop` is set. A
/// stream must end with `[DONE]`: one that stops before is a failed answer.
fn read_events(reader: &mut impl BufRead, tx: &std::sync::mpsc::Sender<Piece>, stop: &AtomicBool) {
    let (mut finish, mut tokens) = (String::from("stop"), 0);
    let mut line = String::new();
    loop {
        line.clear();
        let failed = match std::io::Read::take(&mut *reader, MAX_EVENT_LINE).read_line(&mut line) {
            Ok(0) => Some("the server closed the connection before the answer ended".to_string()),
            Ok(_) if !line.ends_with('\n') && line.len() as u64 >= MAX_EVENT_LINE => {
                Some(format!("the server sent an event line over {} KiB", MAX_EVENT_LINE >> 10))
            }
            Ok(_) => None,
            Err(e) => Some(format!("the answer could not be read: {e}")),
        };
        if stop.load(Ordering::Relaxed) {
            return;
        }
        if let Some(m) = failed {
            let _ = tx.send(Piece::Failed(m));
            return;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
        if let Some(m) = v["error"]["message"].as_str() {
            let _ = tx.send(Piece::Failed(m.to_string()));
            return;
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
        let choice = &v["choices"][0];
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
        for (field, piece) in
            [("reasoning_content", Piece::Reasoning as fn(String) -> Piece), ("content", Piece::Content)]
        {
            if let Some(t) = choice["delta"][field].as_str().filter(|t| !t.is_empty()) {
                let _ = tx.send(piece(t.to_string()));
            }
        }
    }
    let _ = tx.send(Piece::Done { finish, tokens });
}

/// An agent that connects within [`CONNECT_TIMEOUT`], waits as long as a generation takes (a
/// stopped answer is given up by its reader) and hands every status back.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_connect(Some(CONNECT_TIMEOUT)).build().into()
}

/// Stops the server started for a chat, if it still runs (a signal's handler, or the end).
pub fn stop_own(own: &Mutex<Option<OwnServer>>) {
    if let Some(server) = own.lock().unwrap_or_else(PoisonError::into_inner).take() {
        server.stop();
    }
}

impl Drop for Link {
    /// Stops the server started for the chat.
    fn drop(&mut self) {
        stop_own(&self.own);
    }
}

/// The request for a conversation: streamed, with the usage at the end.
pub fn request(messages: &[Value], temperature: f32, max_tokens: u32) -> Value {
    json!({"messages": messages, "stream": true, "stream_options": {"include_usage": true},
        "temperature": temperature, "max_tokens": max_tokens})
}
