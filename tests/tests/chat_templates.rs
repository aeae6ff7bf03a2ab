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
const TEMPLATES: [(&str, &str, &str); 7] = [
    ("Qwen-Qwen3-0.6B", "", "<|im_end|>"),
    ("Qwen3.5-4B", "", "<|im_end|>"),
    ("openai-gpt-oss-120b", "<|startoftext|>", "<|return|>"),
    ("deepseek-ai-DeepSeek-V3.1", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("DeepSeek-V3.2", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
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
            let (streamed, whole) = stream_in_pieces(parser_for(&templates, &r.request), &r.output, &case);
            assert_eq!(streamed.unparsed_pieces, 0, "{case}: a partial parse failed");
            streamed.assert_adds_up_to(&whole, &case);
            assert!(whole.tool_calls.iter().all(|c| c.id.starts_with("call_")), "{case}: ids as streamed");
            if streamed.call_deltas > whole.tool_calls.len() {
                split_calls += 1;
            }
        }
    }
    assert!(split_calls >= 3, "tool calls arrive across several deltas in most formats ({split_calls})");
}

/// What a stream's deltas add up to.
#[derive(Default)]
struct Streamed {
    content: String,
    reasoning: String,
    /// Each call's name and arguments.
    calls: Vec<(String, String)>,
    /// How many deltas carried calls.
    call_deltas: usize,
    /// How many partial parses failed (the server sends nothing for those).
    unparsed_pieces: usize,
}

impl Streamed {
    fn add(&mut self, d: sluice::serve::deltas::MessageDelta, case: &str) {
        self.content.push_str(&d.content);
        self.reasoning.push_str(&d.reasoning);
        for c in d.tool_calls {
            self.call_deltas += 1;
            if let Some(name) = c.name {
                assert_eq!(c.index, self.calls.len(), "{case}: a new call comes next");
                assert!(c.id.is_some(), "{case}: a new call has an id");
                self.calls.push((name, String::new()));
            }
            self.calls[c.index].1.push_str(&c.arguments);
        }
    }

    /// Asserts that the deltas add up to `whole`.
    fn assert_adds_up_to(&self, whole: &ggml_sys::ParsedMessage, case: &str) {
        assert_eq!(
            (self.content.as_str(), self.reasoning.as_str()),
            (whole.content.as_str(), whole.reasoning_content.as_str()),
            "{case}: streamed text"
        );
        // Arguments compared as JSON where they are JSON (the whole answer's may be spaced
        // otherwise), else as text.
        let json = |calls: &[(String, String)]| -> Vec<(String, serde_json::Value)> {
            calls
                .iter()
                .map(|(name, args)| {
                    (name.clone(), serde_json::from_str(args).unwrap_or_else(|_| serde_json::json!(args)))
                })
                .collect()
        };
        let expected: Vec<(String, String)> =
            whole.tool_calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
        assert_eq!(json(&self.calls), json(&expected), "{case}: streamed tool calls");
    }
}

/// `output` streamed through `parser` one to three characters at a time, as a generation
/// grows: what the deltas add up to, and the whole message the stream ends with.
fn stream_in_pieces(parser: ggml_sys::ChatParser, output: &str, case: &str) -> (Streamed, ggml_sys::ParsedMessage) {
    let mut stream = MessageStream::new(parser, "call");
    let mut streamed = Streamed::default();
    let chars: Vec<char> = output.chars().collect();
    let mut at = 0;
    for step in (1..=3).cycle() {
        if at >= chars.len() {
            break;
        }
        let end = (at + step).min(chars.len());
        let piece: String = chars[at..end].iter().collect();
        match stream.push(&piece) {
            Ok(d) => streamed.add(d, case),
            Err(_) => streamed.unparsed_pieces += 1,
        }
        at = end;
    }
    let (last, whole) = stream.finish("");
    streamed.add(last, case);
    (streamed, whole)
}

/// A small model's malformed markup (the format's own tool-call and thinking markers, then JSON
/// that never closes, or nothing) does not parse in the template's format: the answer is its
/// plain text, and the stream must send it too (it sent nothing before: Open WebUI and Home
/// Assistant showed empty replies). On every template, with tools offered.
#[test]
fn answers_that_do_not_parse_stream_what_the_whole_answer_holds() {
    let mut fell_back = Vec::new();
    for (name, bos, eos) in TEMPLATES {
        let source = read(&dir().join("templates").join(format!("{name}.jinja")));
        let templates = ChatTemplates::from_source(None, &source, bos, eos).unwrap();
        let (prompt, _) = templates.apply(&inputs_for("tools")).unwrap();
        let mut markers: Vec<String> = prompt.preserved_tokens.clone();
        markers.extend(prompt.grammar_triggers.iter().map(|t| t.value.clone()).filter(|v| !v.is_empty()));
        markers.push(prompt.thinking_start_tag.clone());
        let mut unparsed = 0;
        for marker in &markers {
            for tail in ["{{{{{{", "{\"name\": \"get_weather\", \"arguments\": {\"ci", ""] {
                let output = format!("Let me see. {marker}{tail}");
                let case = format!("{name} / {output:?}");
                if parser_for(&templates, "tools").parse(&output, false).is_err() {
                    unparsed += 1;
                }
                let (streamed, whole) = stream_in_pieces(parser_for(&templates, "tools"), &output, &case);
                streamed.assert_adds_up_to(&whole, &case);
                let kept = whole.content.len() + whole.reasoning_content.len();
                assert!(kept > 0 || !whole.tool_calls.is_empty(), "{case}: the answer lost its text: {whole:?}");
            }
        }
        fell_back.push((name, unparsed, 3 * markers.len()));
    }
    println!("outputs that do not parse, by template: {fell_back:?}");
    // The formats whose parsers refuse malformed markup (the others read it as content).
    assert!(fell_back.iter().filter(|(_, n, _)| *n > 0).count() >= 3, "too few fell back: {fell_back:?}");
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
        // leaves out of answered turns, and DeepSeek-V3.2's history writes an answered turn's
        // `<think>` as `</think>` (the two share the `<`); every other template's next prompt
        // starts with the last.
        let dropped = match name {
            "Qwen3.5-4B" => "<think>\n".len(),
            "DeepSeek-V3.2" => "think>".len(),
            _ => 0,
        };
        for w in prompts.windows(2) {
            let shared = w[0].bytes().zip(w[1].bytes()).take_while(|(a, b)| a == b).count();
            assert_eq!(w[0].len() - shared, dropped, "{name}: the next turn rewrites the last one's prompt: {kept:?}");
        }
    }
}
