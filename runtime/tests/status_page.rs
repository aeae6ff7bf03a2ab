//! The pages in a real headless browser (Debian's chromium; the tests are skipped with a message
//! where it is not installed). The status page at `/status.html` draws one heat-map cell per layer
//! and expert of the fixture, shows a non-zero decode speed after a request, and logs nothing to
//! the console; with an API key the page itself is open but its data is not. The chat page at `/`,
//! driven by Selenium, streams answers, carries a conversation, stops and starts anew.

use std::path::Path;
use std::process::Command;

mod common;
mod serving;
use common::sluice_command;
use serving::Server;

/// The fixture's shape: the heat map has this many rows and columns.
const LAYERS: usize = 3;
const EXPERTS: usize = 8;

fn fixture(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("status.gguf");
    let o = sluice_command()
        .args(["synth", "--out", p.to_str().unwrap(), "--layers", "3", "--experts", "8", "--seed", "11"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    p
}

/// The browser, or `None` (with the reason printed) where there is none.
fn chromium() -> Option<String> {
    let path = std::env::var("SLUICE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if Path::new(&path).is_file() {
        Some(path)
    } else {
        eprintln!("SKIPPED: no headless browser at {path} (apt-get install chromium; make test installs it where apt is reachable)");
        None
    }
}

/// What the browser made of `url`: the DOM once the page's scripts ran, its console lines, and
/// a screenshot's bytes.
struct Rendered {
    dom: String,
    console: Vec<String>,
    png: Vec<u8>,
}

fn render(browser: &str, url: &str, dir: &Path) -> Rendered {
    let run = |extra: &[&str], profile: &str| {
        let o = Command::new(browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=6000",
                "--window-size=1200,900",
            ])
            .arg(format!("--user-data-dir={}", dir.join(profile).display()))
            .args(extra)
            .arg(url)
            .output()
            .expect("run chromium");
        assert!(o.status.success(), "chromium failed: {}", String::from_utf8_lossy(&o.stderr));
        o
    };
    let dumped = run(&["--dump-dom"], "profile-dom");
    let console =
        String::from_utf8_lossy(&dumped.stderr).lines().filter(|l| l.contains(":CONSOLE")).map(String::from).collect();
    let shot = dir.join("status.png");
    run(&[&format!("--screenshot={}", shot.display())], "profile-shot");
    Rendered { dom: String::from_utf8_lossy(&dumped.stdout).into_owned(), console, png: std::fs::read(shot).unwrap() }
}

/// The text of the element with id `id` in `dom`.
fn element_text<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id} in {dom}"));
    let rest = &dom[start..];
    let open = rest.find('>').unwrap() + 1;
    let close = rest[open..].find('<').unwrap();
    &rest[open..open + close]
}

#[test]
fn the_status_page_draws_the_heat_map_and_the_speed_without_console_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--ctx", "256"]);
    server.wait_note("READY=1");
    // The end-of-sequence token biased away, so the generation decodes all its tokens.
    let r = server.request(
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"The board","max_tokens":12,"temperature":0,"logit_bias":{"2":-100}}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let status = server.request("GET", "/status", None).json();
    assert_eq!(status["heat"]["layers"], LAYERS as u64, "{status}");
    assert_eq!(status["heat"]["experts"], EXPERTS as u64, "{status}");
    let routed: u64 = status["heat"]["counts"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).sum();
    assert!(routed > 0, "the request routed tokens: {status}");

    let page = server.request("GET", "/status.html", None);
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").is_some_and(|t| t.starts_with("text/html")));
    let policy = page.header("content-security-policy").unwrap_or_default();
    assert!(policy.contains("default-src 'none'") && policy.contains("connect-src 'self'"), "{policy}");
    assert!(
        !page.body.contains("src=\"http") && !page.body.contains("href=\"http"),
        "the page loads nothing from elsewhere"
    );

    let Some(browser) = chromium() else { return };
    let shown = render(&browser, &format!("http://{}/status.html", server.addr), dir.path());
    assert!(shown.console.is_empty(), "console messages: {:#?}", shown.console);
    let cells = shown.dom.matches("class=\"cell\"").count();
    assert_eq!(cells, LAYERS * EXPERTS, "one cell per (layer, expert)");
    for (l, e) in [(0, 0), (LAYERS - 1, EXPERTS - 1)] {
        assert!(shown.dom.contains(&format!("data-layer=\"{l}\" data-expert=\"{e}\"")), "cell ({l}, {e})");
    }
    let toks: f64 = element_text(&shown.dom, "toks").parse().unwrap();
    assert!(toks > 0.0, "decode speed shown: {toks}");
    assert_eq!(element_text(&shown.dom, "state"), "ready");
    assert!(element_text(&shown.dom, "hit").ends_with('%'), "hit rate shown");
    assert_eq!(element_text(&shown.dom, "busy"), "0 of 1", "the slots shown");
    assert!(shown.png.starts_with(b"\x89PNG"), "a screenshot");
}

#[test]
fn with_an_api_key_the_page_is_open_and_its_data_needs_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture(dir.path());
    let mut server = Server::start_with_env(dir.path(), &model, &["--ctx", "256"], &[("SLUICE_API_KEY", "s3cret")]);
    server.wait_note("READY=1");
    assert_eq!(server.request("GET", "/status.html", None).status, 200);
    assert_eq!(server.request("GET", "/", None).status, 200, "the chat page is open too");
    let refused = server.request("GET", "/status", None);
    assert_eq!(refused.status, 401, "{}", refused.body);
    let addr = server.addr;
    let stream = serving::send_raw(
        addr,
        format!("GET /status HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    let granted = serving::read_response(stream);
    assert_eq!(granted.status, 200, "{}", granted.body);
    assert_eq!(granted.json()["state"], "ready");

    let Some(browser) = chromium() else { return };
    let shown = render(&browser, &format!("http://{addr}/status.html"), dir.path());
    assert!(shown.dom.contains("id=\"keyform\" style=\"display: block;\""), "the page asks for the key");
    assert_eq!(element_text(&shown.dom, "toks"), "-", "and shows no data without it");
    let chat = render(&browser, &format!("http://{addr}/"), dir.path());
    assert!(chat.dom.contains("id=\"keyform\" style=\"display: block;\""), "the chat page asks for the key");
}

#[test]
fn the_chat_page_streams_answers_carries_turns_and_stops_in_a_browser() {
    if chromium().is_none() || !Path::new("/usr/bin/chromedriver").is_file() {
        eprintln!("SKIPPED: the chat page needs chromium and chromium-driver (make test installs them where apt is reachable)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = serving::synth_talkative(dir.path());
    let shot = dir.path().join("chat.png");
    let args = [shot.to_str().unwrap()];
    if let Some(out) = serving::client_script_with(dir.path(), &model, "chat-page-check.py", "selenium", &args) {
        assert!(out.contains("chat-page-check: 7 passed, 0 failed"), "{out}");
        assert!(std::fs::read(&shot).unwrap().starts_with(b"\x89PNG"), "a screenshot");
        if let Ok(keep) = std::env::var("SLUICE_CHAT_SCREENSHOT") {
            std::fs::copy(&shot, keep).unwrap();
        }
    }
}
