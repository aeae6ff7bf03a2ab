//! `sluice serve` keeps conversations: a request that starts as an earlier one did computes only
//! what is new (counted in `usage` and `/metrics`) and answers as if it had computed it all;
//! several slots keep several conversations (and `--reuse any` keeps any shared prefix); slots
//! saved in the state directory answer after a restart, and a saved slot that is damaged, truncated or another model's is recomputed with a
//! warning; the ledger plans every slot's KV cache and refuses a slot count that does not fit.

mod common;
mod serving;

use std::path::Path;

use serde_json::{json, Value};
use serving::{synth, Server};

use common::sluice_command;

/// The first turn of two conversations.
const FIRST: [&str; 2] = [
    "The quick brown fox jumps over the lazy dog while the farmer sleeps under the old tree",
    "A small boat sails across the quiet lake toward the mountains at the end of the day",
];

fn complete(server: &Server, prompt: &str, extra: Value) -> Value {
    let mut body = json!({ "prompt": prompt, "max_tokens": 6, "temperature": 0 });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let r = server.request("POST", "/v1/completions", Some(&body.to_string()));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// The next turn of a conversation: what was sent, the answer, and more.
fn next_turn(prompt: &str, answer: &Value) -> String {
    format!("{prompt}{} and then", text(answer))
}

/// Prompt batches of 8 tokens: a slot keeps whole batches, so the short test prompts keep some.
const BATCH: u64 = 8;

/// Whether `answer` kept the whole batches of the earlier prompt `before` (its last token may
/// tokenize otherwise once text follows it).
fn kept_the_batches_of(answer: &Value, before: &Value) -> bool {
    let (kept, had) = (cached(answer), before["usage"]["prompt_tokens"].as_u64().unwrap());
    kept % BATCH == 0 && kept > 0 && kept <= had && kept + BATCH + 1 >= had
}

#[test]
fn a_continued_conversation_computes_only_what_is_new_and_answers_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--slots", "2", "--ctx", "512", "--batch", "8"]);
    server.wait_note("READY=1");
    let a1 = complete(&server, FIRST[0], json!({}));
    assert_eq!(cached(&a1), 0, "nothing to reuse on a first request");
    let b1 = complete(&server, FIRST[1], json!({}));
    assert_eq!(cached(&b1), 0, "another conversation takes the other slot");
    let a2_prompt = next_turn(FIRST[0], &a1);
    let a2 = complete(&server, &a2_prompt, json!({}));
    assert!(kept_the_batches_of(&a2, &a1), "the first turn's prompt is kept: {a2} after {a1}");
    let fresh = complete(&server, &a2_prompt, json!({ "cache_prompt": false }));
    assert_eq!(cached(&fresh), 0, "cache_prompt false computes the whole prompt");
    assert_eq!(text(&fresh), text(&a2), "a reused prefix must not change the answer");
    let b2 = complete(&server, &next_turn(FIRST[1], &b1), json!({}));
    assert!(kept_the_batches_of(&b2, &b1), "the other conversation kept its slot: {b2}");

    // Streamed, with usage: the same answer and count.
    let body = json!({ "prompt": a2_prompt, "max_tokens": 6, "temperature": 0, "stream": true,
        "stream_options": { "include_usage": true } });
    let r = server.request("POST", "/v1/completions", Some(&body.to_string()));
    let chunks: Vec<Value> = serving::sse_data(&r.body).iter().filter_map(|d| serde_json::from_str(d).ok()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, text(&a2));
    assert!(cached(chunks.last().unwrap()) > 0, "{}", r.body);

    let reused = server.metric("sluice_prompt_tokens_reused_total");
    let expected = [&a2, &b2].iter().map(|v| cached(v)).sum::<u64>() + cached(chunks.last().unwrap());
    assert_eq!(reused, expected as f64);
    let status = server.request("GET", "/status", None).json();
    let slots = status["slots"].as_array().unwrap();
    assert_eq!(slots.len(), 2, "{status}");
    assert!(slots.iter().all(|s| s["tokens"].as_u64().unwrap() > 0 && s["busy"] == false), "{status}");
    assert!(server.request("GET", "/metrics", None).body.contains("sluice_slot_tokens{slot=\"1\"}"));
    let (status, ..) = server.stop();
    assert!(status.success());
}

/// Starts a server on `model` with saved slots in `state`, sends `prompt` and stops it; returns
/// the answer and the log.
fn once(dir: &Path, model: &Path, state: &Path, prompt: &str) -> (Value, String) {
    let mut server =
        Server::start(dir, model, &["--state-dir", state.to_str().unwrap(), "--ctx", "512", "--batch", "8"]);
    server.wait_note("READY=1");
    let answer = complete(&server, prompt, json!({}));
    let (status, _, _, log) = server.stop();
    assert!(status.success(), "{log}");
    (answer, log)
}

/// The saved slot's state file in `state`.
fn saved_state(state: &Path) -> std::path::PathBuf {
    let dir = state.join("slots");
    let kv: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kv"))
        .collect();
    assert_eq!(kv.len(), 1, "one saved slot: {kv:?}");
    kv[0].clone()
}

#[test]
fn saved_slots_answer_after_a_restart_and_damaged_or_foreign_ones_are_recomputed() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let state = dir.path().join("state");
    let (first, log) = once(dir.path(), &model, &state, FIRST[0]);
    assert!(log.contains("slot 0 saved"), "{log}");
    let second = next_turn(FIRST[0], &first);

    let (restored, log) = once(dir.path(), &model, &state, &second);
    assert!(log.contains("slot 0: ") && log.contains("tokens read back from"), "{log}");
    assert!(kept_the_batches_of(&restored, &first), "{restored}");

    // The same turn computed in full (the saved slot now holds it: a damaged copy of it).
    let kv = saved_state(&state);
    let mut bytes = std::fs::read(&kv).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&kv, &bytes).unwrap();
    let (recomputed, log) = once(dir.path(), &model, &state, &second);
    assert!(log.contains("the saved slot's state is damaged (checksum mismatch)"), "{log}");
    assert_eq!(cached(&recomputed), 0);
    assert_eq!(text(&recomputed), text(&restored), "a restored slot must answer as a computed one");

    let kv = saved_state(&state);
    let bytes = std::fs::read(&kv).unwrap();
    std::fs::write(&kv, &bytes[..bytes.len() / 3]).unwrap();
    let (truncated, log) = once(dir.path(), &model, &state, &second);
    assert!(log.contains("bytes where the header says"), "{log}");
    assert_eq!((cached(&truncated), text(&truncated)), (0, text(&restored)));

    // Another model (another seed) with the same state directory: its slots are not this one's.
    let other = dir.path().join("other.gguf");
    let o = sluice_command().args(["synth", "--out", other.to_str().unwrap(), "--seed", "9"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (_, log) = once(dir.path(), &other, &state, &second);
    assert!(log.contains("saved for another model, context shape or format version; ignoring it"), "{log}");
    assert!(!log.contains("tokens read back"), "{log}");
}

#[test]
fn the_ledger_plans_every_slot_and_refuses_slots_that_do_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let plan = |slots: &str, board: &str| {
        sluice_command()
            .args(["--board", board, "plan", "-m", model.to_str().unwrap(), "--ctx", "1024", "--cache-mb", "0"])
            .args(["--slots", slots, "--json"])
            .output()
            .unwrap()
    };
    let kv = |o: &std::process::Output| -> (u64, u64, String) {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let line = v["lines"].as_array().unwrap().iter().find(|l| l["item"] == "kv_cache").unwrap().clone();
        (line["bytes"].as_u64().unwrap(), v["total"].as_u64().unwrap(), line["basis"].as_str().unwrap().to_string())
    };
    let (one, one_total, _) = kv(&plan("1", "qemu-aarch64"));
    let (four, four_total, basis) = kv(&plan("4", "qemu-aarch64"));
    assert_eq!(four, 4 * one, "each slot has a KV cache of its own");
    assert!(basis.contains("4 slots of 1024 positions"), "{basis}");
    let budget_mib = (one_total + (four_total - one_total) / 2) >> 20;
    let board = dir.path().join("tiny.toml");
    std::fs::write(&board, format!("name = \"tiny\"\n[memory]\nbudget_mib = {budget_mib}\n")).unwrap();
    let o = plan("4", board.to_str().unwrap());
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("slots (--slots ") && err.contains("in the serve settings file"), "{err}");
}

/// Prompts of four clients.
const CLIENTS: [&str; 4] = [
    FIRST[0],
    FIRST[1],
    "Under the bridge the river runs fast and cold after the rain",
    "The old clock in the hall struck twelve as the guests arrived",
];

#[test]
fn several_clients_at_once_share_decodes_and_one_leaving_ends_only_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--slots", "4", "--ctx", "512", "--batch", "8"]);
    server.wait_note("READY=1");
    let start = std::sync::Barrier::new(CLIENTS.len());
    let answers: Vec<Value> = std::thread::scope(|s| {
        let clients: Vec<_> = CLIENTS
            .iter()
            .map(|p| {
                let (server, start) = (&server, &start);
                s.spawn(move || {
                    start.wait();
                    complete(server, p, json!({ "max_tokens": 48 }))
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (a, p) in answers.iter().zip(CLIENTS) {
        let finish = a["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(["length", "stop"].contains(&finish) && a["usage"]["completion_tokens"].as_u64() > Some(0), "{p}: {a}");
    }
    assert!(server.metric("sluice_shared_decodes_total") > 0.0, "no decode carried several requests");
    let alone = answers.iter().zip(CLIENTS).filter(|(a, p)| {
        let solo = complete(&server, p, json!({ "max_tokens": 48, "cache_prompt": false }));
        text(&solo) == text(a)
    });
    println!("answers beside others equal to the same prompt alone: {} of {}", alone.count(), CLIENTS.len());

    // Three streamed clients; one leaves after its first chunk: the others get all their tokens.
    let body = |p: &str| json!({ "prompt": p, "max_tokens": 160, "temperature": 0, "stream": true });
    let cancelled_before = server.metric("sluice_generations_cancelled_total");
    let mut streams: Vec<_> = CLIENTS[..3]
        .iter()
        .map(|p| {
            std::io::BufReader::new(serving::send(server.addr, "POST", "/v1/completions", Some(&body(p).to_string())))
        })
        .collect();
    assert_eq!(serving::read_head(&mut streams[1]).0, 200);
    assert!(serving::read_chunk(&mut streams[1]).is_some());
    drop(streams.remove(1));
    for s in streams {
        let r = serving::read_response(s.into_inner());
        assert_eq!(r.status, 200);
        let (text, finish) = serving::streamed_text(&r.body, false);
        assert!(["length", "stop"].contains(&finish.as_str()), "a client beside the one that left: {finish} {text}");
    }
    let cancelled = server.metric("sluice_generations_cancelled_total") - cancelled_before;
    assert_eq!(cancelled, 1.0, "only the client that left is cancelled");
}

#[test]
fn reuse_any_keeps_the_whole_last_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let mut server = Server::start(dir.path(), &model, &["--ctx", "512", "--reuse", "any"]);
    server.wait_note("READY=1");
    let a1 = complete(&server, FIRST[0], json!({}));
    let a2 = complete(&server, &next_turn(FIRST[0], &a1), json!({}));
    let (had, kept) = (a1["usage"]["prompt_tokens"].as_u64().unwrap(), cached(&a2));
    // The last prompt is kept whole (in whole batches of 512 nothing of it would be), and as much
    // of the answer as tokenizes the same when sent back (the random fixture's answers are byte
    // soup, which comes back as other text).
    assert!(kept >= had && had < 512, "kept {kept} of a {had}-token prompt: {a2}");
}
