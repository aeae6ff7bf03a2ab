//! Hostile chat templates under `sluice serve`: templates that recurse without end, nest
//! deeper than any stack, loop for ever, double strings or ranges into gigabytes, or are
//! megabytes long. llama.cpp's Jinja engine runs them within sluice's bounds (vendor patch 0010:
//! nesting, steps, value sizes, time): at start such a template is refused with a warning and
//! chats are formatted as ChatML; a request that drives a template past a bound is answered 400;
//! the server stays up and ready either way.

use std::path::{Path, PathBuf};

mod common;
mod serving;
use common::sluice_command;
use serving::*;

/// A fixture model whose chat template is `template`.
fn model_with_template(dir: &Path, name: &str, template: &str) -> PathBuf {
    let text = dir.join(format!("{name}.jinja"));
    std::fs::write(&text, template).unwrap();
    let model = dir.join(format!("{name}.gguf"));
    let o = sluice_command()
        .args(["synth", "--out", model.to_str().unwrap(), "--chat-template", &format!("@{}", text.display())])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    model
}

/// A chat request of one user message.
fn chat(content: &str) -> String {
    serde_json::json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})
        .to_string()
}

/// Templates that no conversation can be rendered with: (what, template).
fn hostile_templates() -> Vec<(&'static str, String)> {
    vec![
        ("recursive macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}".into()),
        ("nesting deeper than a stack", format!("{{{{ {}1{} }}}}", "(".repeat(100_000), ")".repeat(100_000))),
        ("not not not ...", format!("{{{{ {}true }}}}", "not ".repeat(50_000))),
        ("nested loops", "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}".into()),
        // no statement in the body: every iteration and every item range() makes is a step
        (
            "nested empty loops",
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}ok".into(),
        ),
        ("string doubling", "{% set s = 'ab' %}{% for i in range(64) %}{% set s = s + s %}{% endfor %}{{ s }}".into()),
        ("a range of 2^40", "{% for i in range(1099511627776) %}{{ i }}{% endfor %}".into()),
        ("string repetition", "{{ 'x' * 10000000000 }}".into()),
        ("a huge literal", format!("{}{{{{ messages }}}}", "x".repeat(20 << 20))),
        ("a long chain of +", format!("{{{{ 1{} }}}}", " + 1".repeat(60_000))),
    ]
}

#[test]
fn hostile_templates_at_start_fall_back_to_chatml_and_the_server_answers() {
    let dir = tempfile::tempdir().unwrap();
    let mut table = Vec::new();
    // Emulated (qemu) runs take a sample: one of each bound (nesting, size, source length).
    let emulated = common::emulated();
    let sample = ["recursive macro", "string doubling", "a huge literal"];
    for (what, template) in hostile_templates().into_iter().filter(|(w, _)| !emulated || sample.contains(w)) {
        let model = model_with_template(dir.path(), &what.replace(' ', "-"), &template);
        let mut server = Server::start(dir.path(), &model, &[]);
        server.wait_note("READY=1");
        let log = server.log();
        assert!(
            log.contains("cannot be used") && log.contains("ChatML"),
            "{what}: no warning that the template was refused:\n{log}"
        );
        let r = server.request("POST", "/v1/chat/completions", Some(&chat("hello")));
        assert_eq!(r.status, 200, "{what}: {}", r.body);
        assert!(server.child.try_wait().unwrap().is_none(), "{what}: the server exited");
        let reason = log.lines().find(|l| l.contains("cannot be used")).unwrap_or_default().to_string();
        table.push(format!("{what}: ready, ChatML, 200 ({})", reason.split("cannot be used").nth(1).unwrap_or("")));
        server.stop();
    }
    println!("{}", table.join("\n"));
}

#[test]
fn sigterm_stops_a_server_rendering_a_hostile_template_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (_, template) = hostile_templates().into_iter().find(|(w, _)| *w == "nested empty loops").unwrap();
    let model = model_with_template(dir.path(), "loops", &template);
    let server = Server::start(dir.path(), &model, &[]);
    // Rendering its capability probes (seconds of empty loops) when the signal comes.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (status, _, notes, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(notes.iter().any(|n| n == "STOPPING=1"), "{notes:?}\n{log}");
    assert!(!log.contains("the engine did not stop within the drain bound"), "the render held the stop up:\n{log}");
}

#[test]
fn a_request_that_drives_the_template_past_its_bounds_is_refused_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    // Recursion as deep as the message is long: fine for a greeting, far too deep for 20,000
    // characters.
    let template = "{% macro spell(s) %}{% if s | length > 0 %}{{ s[0] }}{{ spell(s[1:]) }}{% endif %}{% endmacro %}\
                    {% for m in messages %}<|im_start|>{{ m.role }}\n{{ spell(m.content) }}<|im_end|>\n{% endfor %}\
                    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let model = model_with_template(dir.path(), "per-character", template);
    let mut server = Server::start(dir.path(), &model, &[]);
    server.wait_note("READY=1");
    assert!(!server.log().contains("cannot be used"), "the template renders a greeting:\n{}", server.log());
    let ok = server.request("POST", "/v1/chat/completions", Some(&chat("hello")));
    assert_eq!(ok.status, 200, "{}", ok.body);
    let deep = server.request("POST", "/v1/chat/completions", Some(&chat(&"a".repeat(20_000))));
    assert_api_error(&deep, 400, Some("messages"), "nests deeper than");
    let again = server.request("POST", "/v1/chat/completions", Some(&chat("hello again")));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(server.request("GET", "/health", None).json()["status"], "ready");
}

#[test]
fn a_template_that_inflates_every_prompt_is_refused_before_tokenizing() {
    let dir = tempfile::tempdir().unwrap();
    // 300 KB rendered whatever the request: past what 512 positions can hold.
    let template = "{{ ('a' * 100000) | replace('', 'bb') }}{% for m in messages %}{{ m.content }}{% endfor %}";
    let model = model_with_template(dir.path(), "inflating", template);
    let mut server = Server::start(dir.path(), &model, &["--ctx", "512"]);
    server.wait_note("READY=1");
    let r = server.request("POST", "/v1/chat/completions", Some(&chat("hello")));
    assert_api_error(&r, 400, Some("messages"), "rendered this request into a prompt of");
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded", "{}", r.body);
    let again = server.request("POST", "/v1/chat/completions", Some(&chat("hello again")));
    assert_eq!(again.status, 400, "{}", again.body);
    assert_eq!(server.request("GET", "/health", None).json()["status"], "ready");
}
