//! What the `sluice serve` tests share: a server under a fake systemd, and a raw HTTP client
//! (the tests need to send what a well-behaved client library never would).
#![allow(dead_code)] // each test binary uses a part

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::common::sluice_command;

/// How long a test waits for anything; generous for qemu.
pub const PATIENCE: Duration = Duration::from_secs(180);

pub fn synth(dir: &Path) -> PathBuf {
    let p = dir.join("m.gguf");
    let o = sluice_command().args(["synth", "--out", p.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    p
}

/// A fixture model whose chat template is Qwen3's (thinking, Hermes-style tool calls), as its
/// GGUFs ship it.
pub fn synth_qwen3(dir: &Path) -> PathBuf {
    let template = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/chat/templates/Qwen-Qwen3-0.6B.jinja");
    let template = std::fs::read_to_string(template).unwrap();
    let p = dir.join("qwen3.gguf");
    let o =
        sluice_command().args(["synth", "--out", p.to_str().unwrap(), "--chat-template", &template]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    p
}

/// The chat templates of tests/chat/templates the fixtures carry; `None` is a model without a
/// template (llama.cpp's ChatML, which has no tool-call syntax: generic JSON calls).
pub const TEMPLATES: [Option<&str>; 10] = [
    Some("Qwen-Qwen3-0.6B"),
    Some("Qwen3.5-4B"),
    Some("openai-gpt-oss-120b"),
    Some("deepseek-ai-DeepSeek-V3.1"),
    Some("DeepSeek-V3.2"),
    Some("GLM-4.6"),
    Some("LFM2-8B-A1B"),
    Some("moonshotai-Kimi-K2-Thinking"),
    Some("MiniMax-M2"),
    None,
];

/// A synthetic model carrying `template` (its markers are tokens of its vocabulary).
pub fn synth_with(dir: &Path, template: Option<&str>) -> PathBuf {
    let path = dir.join(format!("{}.gguf", template.unwrap_or("chatml")));
    let mut cmd = sluice_command();
    cmd.args(["synth", "--out", path.to_str().unwrap()]);
    if let Some(t) = template {
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/chat/templates/");
        cmd.args(["--chat-template", &std::fs::read_to_string(format!("{source}{t}.jinja")).unwrap()]);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    path
}

/// A fixture `name`.gguf carrying `template` (of tests/chat/templates) whose weights favour
/// `token` at every position (`synth --favour`).
pub fn synth_favouring(dir: &Path, name: &str, template: &str, token: &str) -> PathBuf {
    let source = format!("{}/../tests/chat/templates/{template}.jinja", env!("CARGO_MANIFEST_DIR"));
    let p = dir.join(format!("{name}.gguf"));
    let o = sluice_command()
        .args(["synth", "--out", p.to_str().unwrap(), "--favour", token, "--chat-template"])
        .arg(std::fs::read_to_string(source).unwrap())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    p
}

/// A fixture with Qwen3's template whose weights favour the letter `a` at every position: its
/// answers run until their token bound, for tests that stop an answer midway.
pub fn synth_talkative(dir: &Path) -> PathBuf {
    synth_favouring(dir, "talkative", "Qwen-Qwen3-0.6B", "a")
}

pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// A running `sluice serve` with its notification socket and log.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    notes: Arc<Mutex<Vec<(Instant, String)>>>,
    log: PathBuf,
}

impl Server {
    pub fn start(dir: &Path, model: &Path, extra: &[&str]) -> Server {
        Server::start_under(dir, model, extra, &[])
    }

    /// [`Server::start`] through `wrapper` (a command that runs the rest of its arguments,
    /// such as `prlimit --nofile=1024:1024 --`); none when empty.
    pub fn start_under(dir: &Path, model: &Path, extra: &[&str], wrapper: &[&str]) -> Server {
        Server::spawn(dir, model, extra, wrapper, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(dir: &Path, model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::spawn(dir, model, extra, &[], env)
    }

    fn spawn(dir: &Path, model: &Path, extra: &[&str], wrapper: &[&str], env: &[(&str, &str)]) -> Server {
        let addr = free_port();
        let sock_path = dir.join(format!("notify-{}.sock", addr.port()));
        let sock = UnixDatagram::bind(&sock_path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let notes = Arc::new(Mutex::new(Vec::new()));
        {
            let notes = Arc::clone(&notes);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match sock.recv(&mut buf) {
                        Ok(n) => {
                            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                            let mut n = notes.lock().unwrap();
                            for line in text.lines() {
                                n.push((Instant::now(), line.to_string()));
                            }
                        }
                        Err(e)
                            if e.kind() == std::io::ErrorKind::WouldBlock
                                || e.kind() == std::io::ErrorKind::TimedOut =>
                        {
                            if Arc::strong_count(&notes) == 1 {
                                return;
                            }
                        }
                        Err(_) => return,
                    }
                }
            });
        }
        let log = dir.join(format!("serve-{}.log", addr.port()));
        let mut cmd = sluice_command();
        if let Some((program, args)) = wrapper.split_first() {
            let mut wrapped = Command::new(program);
            wrapped.args(args).arg(cmd.get_program()).args(cmd.get_args()).env_remove("RUST_LOG");
            cmd = wrapped;
        }
        let child = cmd
            .args(["-v", "serve", "--no-config", "--model", model.to_str().unwrap(), "--listen", &addr.to_string()])
            .args(["--threads", "1"])
            .args(extra)
            .env_remove("SLUICE_API_KEY")
            .env_remove("CREDENTIALS_DIRECTORY")
            // The store is the test's own, and no pull leaves the machine.
            .env("HF_HUB_CACHE", dir.join("hub"))
            .env("OLLAMA_MODELS", dir.join("ollama"))
            .env("HF_ENDPOINT", "http://127.0.0.1:9")
            .env("SLUICE_OLLAMA_REGISTRY", "http://127.0.0.1:9")
            .envs(env.iter().copied())
            .env("NOTIFY_SOCKET", &sock_path)
            .env("WATCHDOG_USEC", "400000")
            .env_remove("WATCHDOG_PID")
            .env_remove("STATE_DIRECTORY")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Server { child, addr, notes, log }
    }

    pub fn notes(&self) -> Vec<String> {
        self.notes.lock().unwrap().iter().map(|(_, s)| s.clone()).collect()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for a notification line equal to `line`.
    pub fn wait_note(&mut self, line: &str) {
        let t0 = Instant::now();
        while !self.notes().iter().any(|n| n == line) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("sluice serve exited ({status}) before {line}; log:\n{}", self.log());
            }
            assert!(
                t0.elapsed() < PATIENCE,
                "no {line} after {PATIENCE:?}; notes {:?}; log:\n{}",
                self.notes(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the log holds `needle` `count` times.
    pub fn wait_log_count(&mut self, needle: &str, count: usize) {
        let t0 = Instant::now();
        while self.log().matches(needle).count() < count {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("sluice serve exited ({status}) before {needle:?} came {count} times; log:\n{}", self.log());
            }
            assert!(t0.elapsed() < PATIENCE, "{needle:?} not {count} times after {PATIENCE:?}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(mut self) -> (ExitStatus, Duration, Vec<String>, String) {
        let t0 = Instant::now();
        nix_kill(self.child.id());
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < PATIENCE, "sluice serve did not exit after SIGTERM; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = t0.elapsed();
        (status, elapsed, self.notes(), self.log())
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Response {
        request(self.addr, method, path, body)
    }

    pub fn metric(&self, name: &str) -> f64 {
        let m = self.request("GET", "/metrics", None);
        assert_eq!(m.status, 200);
        m.body
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no metric {name} in:\n{}", m.body))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn nix_kill(pid: u32) {
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM to sluice serve");
}

/// An HTTP response, chunked bodies decoded.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
}

pub fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

pub fn read_head(r: &mut impl BufRead) -> (u16, String) {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        head.push_str(&line);
    }
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head)
}

/// Reads one chunk of a chunked body (`None` at the end).
pub fn read_chunk(r: &mut impl BufRead) -> Option<String> {
    let mut size = String::new();
    r.read_line(&mut size).unwrap();
    let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
    if n == 0 {
        return None;
    }
    let mut buf = vec![0u8; n + 2];
    r.read_exact(&mut buf).unwrap();
    buf.truncate(n);
    Some(String::from_utf8(buf).unwrap())
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Response {
    read_response(send(addr, method, path, body))
}

/// Connects and writes `bytes` as they are.
pub fn send_raw(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(bytes).unwrap();
    s
}

/// Reads one response (the body to the connection's end, or its chunks).
pub fn read_response(stream: TcpStream) -> Response {
    let mut r = BufReader::new(stream);
    let (status, head) = read_head(&mut r);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let mut body = String::new();
    if chunked {
        while let Some(c) = read_chunk(&mut r) {
            body.push_str(&c);
        }
    } else {
        r.read_to_string(&mut body).unwrap();
    }
    Response { status, head, body }
}

/// The `data:` payloads of a server-sent event stream.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
}

/// The text of a streamed completion, and its finish reason.
pub fn streamed_text(body: &str, chat: bool) -> (String, String) {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut text = String::new();
    let mut finish = String::new();
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        let piece = if chat { c["delta"]["content"].as_str() } else { c["text"].as_str() };
        text.push_str(piece.unwrap_or(""));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

pub fn assert_api_error(r: &Response, status: u16, param: Option<&str>, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert!(v["error"]["type"].as_str().is_some(), "{}", r.body);
    assert_eq!(v["error"]["param"].as_str(), param, "{}", r.body);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
}

/// Runs `scripts/SCRIPT BASE_URL KEY m` with the Python `make test` installs the client
/// libraries into (`SLUICE_OPENAI_PYTHON`) against a server on `model` (with an API key, served
/// as `m`), and returns what it printed, after checking that it succeeded; `None`, with a note,
/// when that Python cannot import `modules`, or under an emulator (the clients test the HTTP
/// API, which the native run covers; the emulated run samples generation itself).
pub fn client_script(dir: &Path, model: &Path, script: &str, modules: &str) -> Option<String> {
    client_script_with(dir, model, script, modules, &[])
}

/// [`client_script`] with more arguments after the model's name.
pub fn client_script_with(dir: &Path, model: &Path, script: &str, modules: &str, args: &[&str]) -> Option<String> {
    if super::common::emulated() {
        eprintln!("skipped under an emulator: {script} tests the HTTP API, which the native run covers");
        return None;
    }
    let python = std::env::var("SLUICE_OPENAI_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = Command::new(&python).args(["-c", &format!("import {modules}")]).output();
    if !has.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: {python} cannot import {modules} (make test installs them; or set SLUICE_OPENAI_PYTHON)");
        return None;
    }
    let mut server = Server::start_with_env(dir, model, &["--model-id", "m"], &[("SLUICE_API_KEY", "test-key")]);
    server.wait_note("READY=1");
    let script = format!("{}/../scripts/{script}", env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(&python)
        .args([&script, &format!("http://{}/v1", server.addr), "test-key", "m"])
        .args(args)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
    println!("{out}");
    Some(out)
}
