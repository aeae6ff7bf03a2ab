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
