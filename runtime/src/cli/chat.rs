//! `sluice chat`: a conversation in the terminal with a local model (served for the chat, with
//! `serve`'s flags) or a running server (`--url`): line editing and history, streamed answers
//! (the thinking dimmed), Ctrl-C to stop an answer (not the program), `/reset`, `/save FILE`, and
//! a status line with the answer's speed.

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use rustyline::error::ReadlineError;
use serde_json::{json, Value};

use super::chat_link::{request, stop_own, Link, OwnServer, Piece};
use sluice::serve::config::ServeSettings;
use sluice::text::{escaped, DisplayText};

/// `sluice chat` arguments.
#[derive(clap::Args)]
pub struct ChatArgs {
    /// A running server to talk to (such as http://127.0.0.1:8080); without it, `--model` is
    /// served for the chat, with the other flags as `sluice serve` takes them.
    #[arg(long, conflicts_with = "model")]
    url: Option<String>,
    /// The running server's API key (with --url; the server started for a chat has its own).
    #[arg(long, env = "SLUICE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// The most tokens an answer takes.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    #[command(flatten)]
    settings: ServeSettings,
}

const HELP: &str = "commands: /reset (a new conversation), /save FILE (the conversation as JSON), /quit (or Ctrl-D); Ctrl-C stops an answer";

/// Runs `sluice chat`.
pub fn run_chat(a: &ChatArgs) -> Result<()> {
    // Ctrl-C stops what runs (a load, an answer); at the prompt the line editor reads it as a key.
    let interrupted = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&interrupted))?;
    let own = Arc::default();
    let terminated = on_termination(Arc::clone(&own));
    let link = match &a.url {
        Some(url) => Link::remote(url, a.api_key.clone()),
        None => {
            if a.settings.model.is_none() {
                anyhow::bail!("give --model (a GGUF file to serve for the chat) or --url (a running server)");
            }
            noteln!("loading the model...");
            Link::start(&a.settings, &interrupted, own)?
        }
    };
    let status = link.get("/status", &interrupted).context("the server does not answer /status")?;
    noteln!("chatting with {} ({HELP})", escaped(status["model"].as_str().unwrap_or("the model")));
    let mut editor = rustyline::DefaultEditor::new().context("cannot set up line editing")?;
    let history = history_file();
    if let Some(h) = &history {
        let _ = editor.load_history(h);
    }
    let mut conversation = Conversation::new(a.system.as_deref());
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => {
                noteln!("(Ctrl-D or /quit leaves)");
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("cannot read the terminal"),
        };
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(text);
        match command(text, &mut conversation) {
            Some(Flow::Quit) => break,
            Some(Flow::Handled) => continue,
            None => {}
        }
        conversation.messages.push(json!({"role": "user", "content": text}));
        interrupted.store(false, Ordering::Relaxed);
        match answer(&link, &conversation.body(a.temperature, a.max_tokens), &interrupted) {
            Some(answer) => conversation.messages.push(json!({"role": "assistant", "content": answer})),
            // A turn without an answer is not kept: the question can be asked again.
            None => {
                conversation.messages.pop();
            }
        }
    }
    if let Some(h) = &history {
        if let Some(dir) = h.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = editor.save_history(h);
    }
    // A signal that came as the input ended (a service stopped, its stdin closed) still says how
    // the chat ended: the exit status is the signal's, as when its handler exits.
    let signal = terminated.load(Ordering::SeqCst);
    if signal != 0 {
        drop(link);
        std::process::exit(128 + signal as i32);
    }
    Ok(())
}

/// The conversation so far.
struct Conversation {
    system: Option<String>,
    messages: Vec<Value>,
}

impl Conversation {
    fn new(system: Option<&str>) -> Conversation {
        Conversation { system: system.map(str::to_string), messages: Vec::new() }
    }

    fn body(&self, temperature: f32, max_tokens: u32) -> Value {
        let mut all: Vec<Value> = self.system.iter().map(|s| json!({"role": "system", "content": s})).collect();
        all.extend(self.messages.iter().cloned());
        request(&all, temperature, max_tokens)
    }
}

/// What a command line did.
enum Flow {
    Quit,
    Handled,
}

/// Runs `text` if it is a command.
fn command(text: &str, conversation: &mut Conversation) -> Option<Flow> {
    let (name, rest) = text.split_once(' ').map_or((text, ""), |(n, r)| (n, r.trim()));
    match name {
        "/quit" | "/exit" => Some(Flow::Quit),
        "/reset" => {
            conversation.messages.clear();
            noteln!("(a new conversation)");
            Some(Flow::Handled)
        }
        "/save" if rest.is_empty() => {
            noteln!("/save needs a file name");
            Some(Flow::Handled)
        }
        "/save" => {
            let all = conversation.body(0.0, 1)["messages"].clone();
            match std::fs::write(rest, serde_json::to_string_pretty(&all).unwrap_or_default()) {
                Ok(()) => noteln!("(saved {} messages to {rest})", all.as_array().map_or(0, Vec::len)),
                Err(e) => noteln!("cannot write {rest}: {e}"),
            }
            Some(Flow::Handled)
        }
        "/help" => {
            noteln!("{HELP}");
            Some(Flow::Handled)
        }
        n if n.starts_with('/') => {
            noteln!("unknown command {n}; {HELP}");
            Some(Flow::Handled)
        }
        _ => None,
    }
}

/// Streams one answer to the terminal until it ends or `stop` is set (Ctrl-C). Returns its text
/// (what came, when stopped), or `None` when the answer failed or was stopped before any text.
fn answer(link: &Link, body: &Value, stop: &Arc<AtomicBool>) -> Option<String> {
    let pieces = link.stream(body, Arc::clone(stop));
    let dim = std::io::stdout().is_terminal();
    // Control characters a model writes are shown as escapes, not sent to the terminal.
    let mut shown = DisplayText::default();
    let (mut text, mut thinking) = (String::new(), false);
    let t0 = Instant::now();
    let mut first: Option<Instant> = None;
    let mut failed = false;
    let end = loop {
        if stop.load(Ordering::Relaxed) {
            break "stopped".to_string();
        }
        let piece = match pieces.recv_timeout(Duration::from_millis(50)) {
            Ok(p) => p,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) if stop.load(Ordering::Relaxed) => break "stopped".to_string(),
            Err(RecvTimeoutError::Disconnected) => {
                failed = true;
                break "error: the answer's reader stopped".to_string();
            }
        };
        match piece {
            Piece::Reasoning(t) => {
                first.get_or_insert_with(Instant::now);
                if !thinking && dim {
                    out!("\x1b[2m");
                }
                thinking = true;
                out!("{}", shown.push(t.as_bytes()));
            }
            Piece::Content(t) => {
                first.get_or_insert_with(Instant::now);
                if thinking {
                    out!("{}\n", if dim { "\x1b[0m" } else { "" });
                    thinking = false;
                }
                out!("{}", shown.push(t.as_bytes()));
                text.push_str(&t);
            }
            Piece::Done { finish, tokens } => {
                let secs = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
                let speed = if secs > 0.0 { tokens as f64 / secs } else { 0.0 };
                break format!(
                    "{tokens} tokens, {speed:.1} tok/s, first after {:.1} s, {}",
                    first.map_or(0.0, |f| (f - t0).as_secs_f64()),
                    escaped(&finish)
                );
            }
            Piece::Failed(m) => {
                failed = true;
                break format!("error: {}", escaped(&m));
            }
        }
        let _ = std::io::stdout().flush();
    };
    if thinking && dim {
        out!("\x1b[0m");
    }
    let hits = link.get("/status", stop).ok().and_then(|s| s["expert_cache"]["hit_rate"].as_f64());
    let hits = hits.map_or(String::new(), |h| format!(", {:.1}% expert hits", h * 100.0));
    out!("\n");
    if failed || text.is_empty() {
        noteln!("[{end}{hits}; the question was not kept]");
        return None;
    }
    noteln!("[{end}{hits}]");
    Some(text)
}

/// On SIGTERM, SIGHUP or SIGQUIT (a closed terminal, a service manager, `kill`): the terminal
/// is given back as it was (the line editor holds it raw while it reads), the server started
/// for the chat is stopped and its directory removed, and the chat exits. Returns the signal
/// that came, as it comes (0: none yet).
fn on_termination(own: Arc<Mutex<Option<OwnServer>>>) -> Arc<AtomicUsize> {
    use signal_hook::consts::{SIGHUP, SIGQUIT, SIGTERM};
    let terminated = Arc::new(AtomicUsize::new(0));
    let ends = [SIGTERM, SIGHUP, SIGQUIT];
    for signal in ends {
        // Set in the handler itself, at delivery: the main thread sees it however the threads run.
        let _ = signal_hook::flag::register_usize(signal, Arc::clone(&terminated), signal as usize);
    }
    let terminal =
        std::io::stdin().is_terminal().then(|| nix::sys::termios::tcgetattr(std::io::stdin()).ok()).flatten();
    let Ok(mut signals) = signal_hook::iterator::Signals::new(ends) else { return terminated };
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            if let Some(t) = &terminal {
                let _ = nix::sys::termios::tcsetattr(std::io::stdin(), nix::sys::termios::SetArg::TCSANOW, t);
            }
            stop_own(&own);
            std::process::exit(128 + signal);
        }
    });
    terminated
}

/// Where the line history is kept: `$XDG_STATE_HOME/sluice/chat_history`, else
/// `~/.local/state/sluice/chat_history`; none without a home.
fn history_file() -> Option<PathBuf> {
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))?;
    Some(state.join("sluice").join("chat_history"))
}
