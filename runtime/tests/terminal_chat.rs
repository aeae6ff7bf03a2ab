//! `sluice chat` in a real terminal (tmux): it serves the model for the chat, streams an answer,
//! stops it on Ctrl-C and keeps the program, carries the conversation, `/save`s and `/reset`s it,
//! and leaves no server behind when it ends. Skipped (with a message) without tmux or under an
//! emulator (the terminal, not the generation, is under test).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
mod serving;
use common::emulated;

/// A tmux server of the test's own.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let o = Command::new("tmux").args(["-L", &self.socket]).args(args).output().expect("run tmux");
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-J", "-S", "-200", "-t", "chat"])
    }

    /// Waits until the screen holds `count` times `text`.
    fn wait_for(&self, text: &str, count: usize) -> String {
        let t0 = Instant::now();
        loop {
            let screen = self.screen();
            if screen.matches(text).count() >= count {
                return screen;
            }
            assert!(t0.elapsed() < serving::PATIENCE, "{text:?} never appeared {count} times:\n{screen}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "chat"];
        args.extend_from_slice(keys);
        self.run(&args);
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        self.run(&["kill-server"]);
    }
}

fn saved(path: &Path) -> Vec<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_terminal_chat_streams_stops_on_ctrl_c_saves_and_resets() {
    if emulated() || !Command::new("tmux").arg("-V").output().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: no tmux, or under an emulator (apt-get install tmux)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = serving::synth_talkative(dir.path());
    let tmux = Tmux { socket: format!("sluice-test-{}", std::process::id()) };
    let chat = format!(
        "{} chat --model {} --temperature 0 --max-tokens 3000; sleep 600",
        env!("CARGO_BIN_EXE_sluice"),
        model.display()
    );
    tmux.run(&["new-session", "-d", "-s", "chat", "-x", "150", "-y", "50", &chat]);
    tmux.wait_for("chatting with talkative", 1);
    let save = dir.path().join("conversation.json");
    // The first answer streams (the screen grows past the question) until Ctrl-C stops it.
    tmux.keys(&["Hello there", "Enter"]);
    let t0 = Instant::now();
    while tmux.screen().split("Hello there").nth(1).is_none_or(|after| after.trim().len() < 20) {
        assert!(t0.elapsed() < serving::PATIENCE, "no answer streamed:\n{}", tmux.screen());
        std::thread::sleep(Duration::from_millis(100));
    }
    tmux.keys(&["C-c"]);
    tmux.wait_for("[stopped", 1);
    // The program goes on: the conversation's second answer streams and is stopped too.
    tmux.keys(&["Tell me more", "Enter"]);
    let t0 = Instant::now();
    while tmux.screen().split("Tell me more").nth(1).is_none_or(|after| after.matches('a').count() < 20) {
        assert!(t0.elapsed() < serving::PATIENCE, "no second answer streamed:\n{}", tmux.screen());
        std::thread::sleep(Duration::from_millis(100));
    }
    tmux.keys(&["C-c"]);
    tmux.wait_for("[stopped", 2);
    tmux.keys(&[&format!("/save {}", save.display()), "Enter"]);
    tmux.wait_for("(saved 4 messages", 1);
    let conversation = saved(&save);
    let roles: Vec<&str> = conversation.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert!(conversation[1]["content"].as_str().unwrap().len() > 5, "the stopped answer is kept as far as it came");
    tmux.keys(&["/reset", "Enter"]);
    tmux.wait_for("(a new conversation)", 1);
    tmux.keys(&[&format!("/save {}", save.display()), "Enter"]);
    tmux.wait_for("(saved 0 messages", 1);
    // The chat and the server it started, by process id.
    let pgrep = |args: &[&str]| -> Vec<String> {
        let o = Command::new("pgrep").args(args).output().unwrap();
        String::from_utf8_lossy(&o.stdout).split_whitespace().map(str::to_string).collect()
    };
    let chats = pgrep(&["-f", &format!("^{} chat --model {}", env!("CARGO_BIN_EXE_sluice"), model.display())]);
    assert_eq!(chats.len(), 1, "{chats:?}");
    let servers = pgrep(&["-P", &chats[0]]);
    assert_eq!(servers.len(), 1, "the chat's server: {servers:?}");
    tmux.keys(&["C-d"]);
    let t0 = Instant::now();
    while [&chats[0], &servers[0]].iter().any(|pid| Path::new(&format!("/proc/{pid}")).exists()) {
        assert!(t0.elapsed() < serving::PATIENCE, "the chat or its server did not end:\n{}", tmux.screen());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A fake server: answers each request of a connection with the next of `answers` (its raw
/// bytes; a `None` answer reads the request and never answers), one request a connection.
fn hostile_server(answers: Vec<Option<Vec<u8>>>) -> (String, std::thread::JoinHandle<Vec<String>>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut held = Vec::new();
        for answer in answers {
            let Ok((stream, _)) = listener.accept() else { break };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let (mut head, mut length) = (String::new(), 0);
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                head.push_str(&line);
            }
            let _ = reader.by_ref().take(length).read_to_end(&mut Vec::new());
            seen.push(head.lines().next().unwrap_or_default().to_string());
            match answer {
                Some(bytes) => {
                    let _ = (&stream).write_all(&bytes);
                }
                None => held.push(stream),
            }
        }
        // The connections never answered stay open, silent, as a stuck server's do.
        if !held.is_empty() {
            std::thread::sleep(Duration::from_secs(600));
        }
        seen
    });
    (url, handle)
}

/// A response of `status` with `body`, the connection closed after it.
fn response(status: &str, content_type: &str, body: &str) -> Option<Vec<u8>> {
    Some(format!("HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nConnection: close\r\n\r\n{body}").into_bytes())
}

/// Server-sent events, one `data:` line each.
fn events(events: &[serde_json::Value], done: bool) -> String {
    let mut out: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    if done {
        out.push_str("data: [DONE]\n\n");
    }
    out
}

#[test]
fn a_hostile_server_reaches_no_terminal_escape_and_loses_no_turn() {
    let status = |model: &str| response("200 OK", "application/json", &serde_json::json!({"model": model}).to_string());
    let chunk = |content: &str, finish: Option<&str>| serde_json::json!({"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]});
    let sse = "text/event-stream";
    let good = events(&[chunk("hello \u{1b}]52;c;ZXZpbA==\u{7}world", None), chunk("", Some("stop\u{1b}[2J"))], true);
    let error = serde_json::json!({"error": {"message": "\u{1b}[2Jboom\u{1b}]0;title\u{7}"}}).to_string();
    let endless = format!("data: {}", "a".repeat(3 << 20));
    let (url, server) = hostile_server(vec![
        status("evil\u{1b}]0;owned\u{7}\u{1b}[2J"),
        response("200 OK", sse, &good),
        status("m"),
        response("500 Internal Server Error", "application/json", &error),
        status("m"),
        // Cut mid-answer: no [DONE].
        response("200 OK", sse, &events(&[chunk("half an ans", None)], false)),
        status("m"),
        response("200 OK", sse, &endless),
        status("m"),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("conversation.json");
    let mut chat = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["chat", "--url", &url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let input = format!("first\nsecond\nthird\nfourth\n/save {}\n/quit\n", save.display());
    std::io::Write::write_all(chat.stdin.as_mut().unwrap(), input.as_bytes()).unwrap();
    let out = chat.wait_with_output().unwrap();
    let shown = [out.stdout, out.stderr].concat();
    let text = String::from_utf8_lossy(&shown);
    assert!(out.status.success(), "{text}");
    for byte in [0x1b, 0x07] {
        assert!(!shown.contains(&byte), "the server's byte {byte:#04x} reached the terminal:\n{text:?}");
    }
    for escaped in ["evil\\x1b]0;owned\\x07", "world", "stop\\x1b[2J", "error: \\x1b[2Jboom", "over 1024 KiB"] {
        assert!(text.contains(escaped), "{escaped:?} not shown:\n{text}");
    }
    assert!(text.contains("before the answer ended"), "a cut stream reads as a normal end:\n{text}");
    assert_eq!(text.matches("the question was not kept").count(), 3, "{text}");
    // Only the answered turn is kept: no empty or half assistant message of a failed turn.
    let conversation = saved(&save);
    let kept: Vec<(&str, &str)> =
        conversation.iter().map(|m| (m["role"].as_str().unwrap(), m["content"].as_str().unwrap())).collect();
    assert_eq!(kept, [("user", "first"), ("assistant", "hello \u{1b}]52;c;ZXZpbA==\u{7}world")]);
    assert_eq!(server.join().unwrap().len(), 9);
}

#[test]
fn a_silent_server_ends_the_chat_within_its_bound_instead_of_hanging() {
    let (url, _server) = hostile_server(vec![None]);
    let t0 = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["chat", "--url", &url])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("/status"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(60), "the chat waited {:?}", t0.elapsed());
}

#[test]
fn sigterm_ends_the_chat_and_the_server_it_started_and_leaves_no_files() {
    let dir = tempfile::tempdir().unwrap();
    let model = serving::synth(dir.path());
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut chat = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["chat", "--model", model.to_str().unwrap()])
        .env("TMPDIR", &tmp)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(chat.stderr.take().unwrap());
    let mut shown = String::new();
    while !shown.contains("chatting with") {
        let mut line = String::new();
        assert!(std::io::BufRead::read_line(&mut err, &mut line).unwrap() > 0, "the chat ended:\n{shown}");
        shown.push_str(&line);
    }
    let server_dir = std::fs::read_dir(&tmp).unwrap().next().expect("the server's directory").unwrap().path();
    let serving_pids = || -> Vec<String> {
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(server_dir.to_str().unwrap()) {
                pids.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        pids
    };
    assert_eq!(serving_pids().len(), 1, "the chat's server runs");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(chat.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = chat.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{status:?}");
    assert!(serving_pids().is_empty(), "the server outlived the chat");
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0, "the server's directory was left behind");
}
