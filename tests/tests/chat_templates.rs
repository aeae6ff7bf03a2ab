//! The chat templates released inside current MoE GGUFs, rendered by llama.cpp's chat layer from
//! OpenAI requests, against prompts written by hand from each model's documented format.
//!
//! `tests/chat/templates/` holds the templates as their models ship them (copies from llama.cpp's
//! `models/templates`), `tests/chat/requests/` the requests (plain, thinking off, with tools, and
//! a tool round trip), `tests/chat/expected/<template>/<request>.txt` the prompts.

use std::path::{Path, PathBuf};

use ggml_sys::ChatTemplates;
use sluice::serve::deltas::MessageStream;
use sluice::serve::job::PromptInput;
use sluice::serve::openai::chat_request;

/// Each template with the text of its model's BOS and EOS tokens.
const TEMPLATES: [(&str, &str, &str); 6] = [
    ("Qwen-Qwen3-0.6B", "", "<|im_end|>"),
    ("Qwen3.5-4B", "", "<|im_end|>"),
    ("openai-gpt-oss-120b", "<|startoftext|>", "<|return|>"),
    ("deepseek-ai-DeepSeek-V3.1", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("GLM-4.6", "", "<|endoftext|>"),
    ("LFM2-8B-A1B", "<|startoftext|>", "<|im_end|>"),
];
const REQUESTS: [&str; 4] = ["plain", "no_thinking", "tools", "tool_round_trip"];
/// 2026-01-15 12:00 UTC: the date templates print (the same date in every time zone within 11 hours).
const NOW: i64 = 1_768_478_400;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("chat")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The template inputs of a request file, as the server makes them, at [`NOW`]. Every test
/// renders at the same time: llama.cpp's `strftime_now` formats through `std::localtime`, whose
/// shared buffer tests rendering in parallel would otherwise race on with different times.
fn inputs_for(request: &str) -> ggml_sys::ChatInputs {
    let body = read(&dir().join("requests").join(format!("{request}.json")));
    let r = chat_request(body.as_bytes(), "m").unwrap_or_else(|e| panic!("{request}: {}", e.message));
    let PromptInput::Chat(mut inputs) = r.prompt else { panic!("{request}: not a chat") };
    inputs.now = Some(NOW);
    *inputs
}

#[test]
fn real_templates_render_the_documented_prompts() {
    let mut failures = Vec::new();
    for (name, bos, eos) in TEMPLATES {
        let source = read(&dir().join("templates").join(format!("{name}.jinja")));
        let templates = ChatTemplates::from_source(None, &source, bos, eos).unwrap_or_else(|e| panic!("{name}: {e}"));
        for request in REQUESTS {
            let (prompt, _) =
                templates.apply(&inputs_for(request)).unwrap_or_else(|e| panic!("{name} / {request}: {e}"));
            let expected = read(&dir().join("expected").join(name).join(format!("{request}.txt")));
            if prompt.prompt != expected {
                failures
                    .push(format!("{name} / {request}:\n--- expected\n{expected}\n--- rendered\n{}\n", prompt.prompt));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} prompts differ:\n{}",
        failures.len(),
        TEMPLATES.len() * REQUESTS.len(),
        failures.join("\n")
    );
}

/// A recorded answer of a model in its own format, and what it must parse into.
#[derive(serde::Deserialize)]
struct Recorded {
    request: String,
    output: String,
    content: String,
    reasoning_content: String,
    tool_calls: Vec<ExpectedCall>,
}

#[derive(serde::Deserialize, Debug, PartialEq)]
struct ExpectedCall {
    name: String,
    arguments: serde_json::Value,
}

/// The parser each template's family gives a request.
fn parser_for(templates: &ChatTemplates, request: &str) -> ggml_sys::ChatParser {
    templates.apply(&inputs_for(request)).unwrap().1
}

fn calls(calls: &[(String, String)]) -> Vec<ExpectedCall> {
    calls
        .iter()
        .map(|(name, args)| ExpectedCall {
            name: name.clone(),
            arguments: serde_json::from_str(args).unwrap_or_else(|e| panic!("arguments {args:?}: {e}")),
        })
        .collect()
}

#[test]
fn recorded_answers_parse_into_content_reasoning_and_tool_calls_whole_and_streamed() {
    let mut split_calls = 0;
    for (name, bos, eos) in TEMPLATES {
        let source = read(&dir().join("templates").join(format!("{name}.jinja")));
        let templates = ChatTemplates::from_source(None, &source, bos, eos).unwrap();
        let recorded: Vec<Recorded> =
            serde_json::from_str(&read(&dir().join("outputs").join(format!("{name}.json")))).unwrap();
        for r in recorded {
            let case = format!("{name} / {}", r.request);
            // Whole.
            let m =
                parser_for(&templates, &r.request).parse(&r.output, false).unwrap_or_else(|e| panic!("{case}: {e}"));
            let got: Vec<(String, String)> =
                m.tool_calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
            // Whitespace around the thinking and the answer is the format's, as llama-server keeps it.
            assert_eq!(
                (m.content.trim(), m.reasoning_content.trim(), calls(&got)),
                (r.content.as_str(), r.reasoning_content.as_str(), r.tool_calls),
                "{case}: whole answer"
            );
            // Streamed a few characters at a time: the deltas add up to the whole answer.
            let mut stream = MessageStream::new(parser_for(&templates, &r.request), "call");
            let (mut content, mut reasoning) = (String::new(), String::new());
            let mut streamed: Vec<(String, String)> = Vec::new();
            let mut call_deltas = 0;
            let mut add = |d: sluice::serve::deltas::MessageDelta| {
                content.push_str(&d.content);
                reasoning.push_str(&d.reasoning);
                for c in d.tool_calls {
                    call_deltas += 1;
                    if let Some(name) = c.name {
                        assert_eq!(c.index, streamed.len(), "{case}: a new call comes next");
                        assert!(c.id.is_some(), "{case}: a new call has an id");
                        streamed.push((name, String::new()));
                    }
                    streamed[c.index].1.push_str(&c.arguments);
                }
            };
            let chars: Vec<char> = r.output.chars().collect();
            let mut at = 0;
            for step in (1..=3).cycle() {
                if at >= chars.len() {
                    break;
                }
                let end = (at + step).min(chars.len());
                let piece: String = chars[at..end].iter().collect();
                add(stream.push(&piece).unwrap_or_else(|e| panic!("{case}: partial parse: {e}")));
                at = end;
            }
            let (last, whole) = stream.finish("").unwrap();
            add(last);
            assert_eq!(
                (content.as_str(), reasoning.as_str()),
                (whole.content.as_str(), whole.reasoning_content.as_str()),
                "{case}: streamed text"
            );
            let expected: Vec<(String, String)> =
                whole.tool_calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
            assert_eq!(calls(&streamed), calls(&expected), "{case}: streamed tool calls");
            assert!(whole.tool_calls.iter().all(|c| c.id.starts_with("call_")), "{case}: ids as streamed");
            if call_deltas > whole.tool_calls.len() {
                split_calls += 1;
            }
        }
    }
    assert!(split_calls >= 3, "tool calls arrive across several deltas in most formats ({split_calls})");
}

/// The messages of a three-turn chat after `turns` user turns (each answered but the last).
fn chat_after(turns: usize) -> ggml_sys::ChatInputs {
    let mut messages = vec![serde_json::json!({ "role": "system", "content": "You are a helpful assistant." })];
    for t in 1..=turns {
        messages.push(serde_json::json!({ "role": "user", "content": format!("Question {t}: what comes next?") }));
        if t < turns {
            messages.push(serde_json::json!({ "role": "assistant", "content": format!("Answer {t}: the next part.") }));
        }
    }
    let body = serde_json::json!({ "model": "m", "messages": messages }).to_string();
    let r = chat_request(body.as_bytes(), "m").unwrap_or_else(|e| panic!("{}", e.message));
    let PromptInput::Chat(mut inputs) = r.prompt else { panic!("not a chat") };
    inputs.now = Some(NOW);
    *inputs
}

/// How much of a turn's prompt the next turn's prompt starts with, per template: a slot keeps
/// no more than that (and, for exactness, only its whole prompt batches). The templates append
/// (the answer, which a slot computes again, and the next question) and render the earlier
/// turns the same, so a conversation's history is kept; Qwen3.5 drops the `<think>` its
/// generation prompt opened. Printed for the docs.
#[test]
fn each_turn_s_prompt_starts_with_the_whole_prompt_of_the_turn_before() {
    for (name, bos, eos) in TEMPLATES {
        let source = read(&dir().join("templates").join(format!("{name}.jinja")));
        let templates = ChatTemplates::from_source(None, &source, bos, eos).unwrap();
        let prompts: Vec<String> = (1..=3).map(|t| templates.apply(&chat_after(t)).unwrap().0.prompt).collect();
        let kept: Vec<String> = prompts
            .windows(2)
            .map(|w| {
                let shared = w[0].bytes().zip(w[1].bytes()).take_while(|(a, b)| a == b).count();
                format!("{shared} of {} bytes", w[0].len())
            })
            .collect();
        println!("{name}: turn 2 keeps {}, turn 3 keeps {}", kept[0], kept[1]);
        // Qwen3.5's generation prompt opens the thinking block (`<think>\n`), which its history
        // leaves out of answered turns; every other template's next prompt starts with the last.
        let dropped = if name == "Qwen3.5-4B" { "<think>\n".len() } else { 0 };
        for w in prompts.windows(2) {
            let shared = w[0].bytes().zip(w[1].bytes()).take_while(|(a, b)| a == b).count();
            assert_eq!(w[0].len() - shared, dropped, "{name}: the next turn rewrites the last one's prompt: {kept:?}");
        }
    }
}
