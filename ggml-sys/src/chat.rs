//! llama.cpp's chat layer (`common/chat.h`, what llama-server runs), through `common_shim.cpp`: a
//! model's Jinja chat templates applied to OpenAI messages, tools and options, and generated
//! text parsed back into content, reasoning and tool calls by the parser the template's family
//! handler chose.

use std::ffi::{c_char, CStr, CString};
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Model, Result};

#[repr(C)]
struct RawTemplates {
    _private: [u8; 0],
}

#[repr(C)]
struct RawParser {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn sluice_string_free(s: *mut c_char);
    fn sluice_chat_templates_init(
        model: *const sys::llama_model,
        source: *const c_char,
        bos: *const c_char,
        eos: *const c_char,
    ) -> *mut RawTemplates;
    fn sluice_chat_templates_free(t: *mut RawTemplates);
    fn sluice_chat_set_work_limits(max_depth: usize, max_steps: u64, max_value: usize, max_ms: i64);
    fn sluice_chat_stop_all_work();
    fn sluice_chat_templates_apply(
        t: *const RawTemplates,
        inputs_json: *const c_char,
        parser: *mut *mut RawParser,
    ) -> *mut c_char;
    fn sluice_chat_parser_free(p: *mut RawParser);
    fn sluice_chat_parse(p: *const RawParser, text: *const c_char, len: usize, partial: bool) -> *mut c_char;
}

/// The chat layer's answer for `call`: the JSON it returned, or the exception it threw.
fn take_json<T: serde::de::DeserializeOwned>(call: &'static str, raw: *mut c_char) -> Result<T> {
    let raw = made(call, raw)?.as_ptr();
    // SAFETY: the shim returned a NUL-terminated string from malloc, freed right after the copy.
    let text = unsafe { CStr::from_ptr(raw) }.to_string_lossy().into_owned();
    // SAFETY: raw came from the shim's malloc and is freed once.
    unsafe { sluice_string_free(raw) };
    serde_json::from_str(&text).map_err(|e| Error::Chat { call, message: format!("unreadable result: {e}") })
}

/// The object the shim's `call` made: `raw`, or the exception it threw (or that it made nothing).
pub(crate) fn made<T>(call: &'static str, raw: *mut T) -> Result<NonNull<T>> {
    chat_caught(call)?;
    NonNull::new(raw).ok_or(Error::Chat { call, message: "returned nothing".into() })
}

/// [`crate::shim::caught`], as a chat error (not a malformed model).
pub(crate) fn chat_caught(call: &'static str) -> Result<()> {
    crate::shim::caught(call).map_err(|e| match e {
        Error::Exception { call, message } => Error::Chat { call, message },
        e => e,
    })
}

/// The bounds of one template parse or render (vendor patch 0010, llama.cpp's Jinja engine):
/// nesting of statements, expressions, calls and values (a recursive macro overflows no stack),
/// steps (statements executed, loop iterations, items made), the largest string, array or
/// object, and the time. Real templates use a few dozen levels, thousands of statements and well
/// under a second; a template past a bound is an error, which `serve` answers as for a template
/// that does not parse.
pub mod template_bounds {
    /// Levels of nesting.
    pub const DEPTH: usize = 1000;
    /// Steps: statements and expressions executed, loop iterations, items of arrays and objects
    /// made.
    pub const STEPS: u64 = 10_000_000;
    /// Bytes of a string (the rendered prompt among them), items of an array or object.
    pub const VALUE: usize = 16 << 20;
    /// Milliseconds of one parse (with the capability probes it renders) or one render.
    pub const TIME_MS: i64 = 2_000;
}

/// Bounds the next template call of this thread (see [`template_bounds`]).
fn bound_template_work() {
    use template_bounds::*;
    // SAFETY: sets plain thread-local values.
    unsafe { sluice_chat_set_work_limits(DEPTH, STEPS, VALUE, TIME_MS) };
}

/// Stops every template parse and render of this process, on any thread, at its next step: an
/// error as for a template past its bounds. For a process that is stopping, so that no render
/// holds it up.
pub fn stop_template_work() {
    // SAFETY: sets a process-wide atomic flag.
    unsafe { sluice_chat_stop_all_work() };
}

fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|e| Error::TextNul(e.nul_position()))
}

/// A model's chat templates, parsed by llama.cpp's Jinja engine: its default template and its
/// `tool_use` variant when the file has one; ChatML when it has none.
pub struct ChatTemplates {
    raw: NonNull<RawTemplates>,
}

// SAFETY: the templates are immutable after creation and used from one thread at a time (not
// Sync); nothing in them refers to the thread that made them.
unsafe impl Send for ChatTemplates {}

impl ChatTemplates {
    /// The templates stored in `model` (`tokenizer.chat_template`, `tokenizer.chat_template.tool_use`).
    pub fn of_model(model: &Model) -> Result<ChatTemplates> {
        bound_template_work();
        // SAFETY: live model; a null source asks for the model's own templates.
        let raw = unsafe {
            sluice_chat_templates_init(model.raw().cast_const(), std::ptr::null(), std::ptr::null(), std::ptr::null())
        };
        Self::wrap(raw)
    }

    /// A template from its Jinja `source`, for `model`'s vocabulary, or with `bos` / `eos` as
    /// the text of the tokens the template may print when `model` is `None`.
    pub fn from_source(model: Option<&Model>, source: &str, bos: &str, eos: &str) -> Result<ChatTemplates> {
        let (source, bos, eos) = (c_string(source)?, c_string(bos)?, c_string(eos)?);
        let model = model.map_or(std::ptr::null(), |m| m.raw().cast_const());
        bound_template_work();
        // SAFETY: the strings are NUL-terminated and live for the call; model is null or live.
        let raw = unsafe { sluice_chat_templates_init(model, source.as_ptr(), bos.as_ptr(), eos.as_ptr()) };
        Self::wrap(raw)
    }

    fn wrap(raw: *mut RawTemplates) -> Result<ChatTemplates> {
        made("common_chat_templates_init", raw).map(|raw| ChatTemplates { raw })
    }

    /// Renders `inputs` into a prompt, with the grammar, stops and parser its generation needs.
    /// Messages, tools or options the template's family cannot take are [`Error::Chat`].
    pub fn apply(&self, inputs: &ChatInputs) -> Result<(ChatPrompt, ChatParser)> {
        let json = serde_json::to_string(inputs).map_err(|e| Error::Chat {
            call: "common_chat_templates_apply",
            message: format!("inputs not serializable: {e}"),
        })?;
        let json = c_string(&json)?;
        let mut parser: *mut RawParser = std::ptr::null_mut();
        bound_template_work();
        // SAFETY: live templates; json is NUL-terminated; parser is a valid out-pointer that the
        // shim sets only when it returns a result.
        let raw = unsafe { sluice_chat_templates_apply(self.raw.as_ptr(), json.as_ptr(), &mut parser) };
        let prompt: ChatPrompt = take_json("common_chat_templates_apply", raw)?;
        let parser = ChatParser { raw: made("common_chat_templates_apply", parser)? };
        Ok((prompt, parser))
    }
}

impl Drop for ChatTemplates {
    fn drop(&mut self) {
        // SAFETY: raw came from sluice_chat_templates_init and is freed once.
        unsafe { sluice_chat_templates_free(self.raw.as_ptr()) };
    }
}

/// Whether and how the model may call tools (OpenAI's `tool_choice`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// The model must call one.
    Required,
    /// The model must answer in text.
    None,
}

/// How thinking is returned (llama.cpp's `reasoning_format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub enum ReasoningFormat {
    /// Left in the content as the model wrote it.
    #[serde(rename = "none")]
    None,
    /// Split into `reasoning_content`.
    #[default]
    #[serde(rename = "auto")]
    Split,
}

/// What a chat request gives the template.
#[derive(Debug, Clone, Serialize)]
pub struct ChatInputs {
    /// OpenAI messages (`role`, `content` text or parts, `tool_calls`, `tool_call_id`, `reasoning_content`, ...).
    pub messages: Value,
    /// OpenAI tools (`[{"type": "function", "function": {...}}]`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    /// Whether tools may, must or must not be called.
    pub tool_choice: ToolChoice,
    /// Whether several tool calls may come in one answer.
    pub parallel_tool_calls: bool,
    /// A JSON schema the answer must follow (turned into a grammar by the template's handler).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<Value>,
    /// Whether a thinking model thinks.
    pub enable_thinking: bool,
    /// Where thinking goes.
    pub reasoning_format: ReasoningFormat,
    /// Whether tool calls in the answer are parsed out of the content.
    pub parse_tool_calls: bool,
    /// Extra variables for the template (`chat_template_kwargs`, `reasoning_effort`).
    pub kwargs: Map<String, Value>,
    /// The time the template sees (Unix seconds); `None`: now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub now: Option<i64>,
    /// Whether the prompt ends with the start of the assistant's turn.
    pub add_generation_prompt: bool,
}

impl ChatInputs {
    /// Inputs for `messages` with every option at its default.
    pub fn new(messages: Value) -> ChatInputs {
        ChatInputs {
            messages,
            tools: None,
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: false,
            json_schema: None,
            enable_thinking: true,
            reasoning_format: ReasoningFormat::Split,
            parse_tool_calls: false,
            kwargs: Map::new(),
            now: None,
            add_generation_prompt: true,
        }
    }
}

/// A lazy grammar's trigger, as llama.cpp's `common_grammar_trigger`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrammarTrigger {
    /// Token, word, pattern or full pattern (llama.cpp's `common_grammar_trigger_type`).
    #[serde(rename = "type")]
    pub kind: i32,
    /// The word or pattern.
    pub value: String,
    /// The token, for a token trigger.
    pub token: i32,
}

/// A rendered chat prompt and what its generation needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatPrompt {
    /// The prompt text (control tokens as text: tokenize it with special tokens parsed).
    pub prompt: String,
    /// The output format the template's handler chose (llama.cpp's name for it).
    pub format: String,
    /// A GBNF grammar the answer must follow (tool calls, JSON schema); empty: none.
    pub grammar: String,
    /// Whether the grammar applies only once a trigger appears.
    pub grammar_lazy: bool,
    /// What wakes a lazy grammar.
    pub grammar_triggers: Vec<GrammarTrigger>,
    /// Special tokens whose text the parser needs to see in the output.
    pub preserved_tokens: Vec<String>,
    /// Stop sequences the format adds.
    pub additional_stops: Vec<String>,
    /// The start of the assistant's turn the template wrote at the end of the prompt.
    pub generation_prompt: String,
    /// The tag that opens thinking (`<think>`), if the format has one.
    pub thinking_start_tag: String,
    /// The tags that close thinking.
    pub thinking_end_tags: Vec<String>,
    /// Whether the template has no tool-call syntax of its own, so that tools were offered and
    /// are parsed in the generic JSON form (`{"tool_calls": [...]}`).
    pub generic_tools: bool,
}

/// Parses one generation's text into a message, as the template's family writes it.
pub struct ChatParser {
    raw: NonNull<RawParser>,
}

// SAFETY: the parser is immutable after creation and used from one thread at a time (not Sync).
unsafe impl Send for ChatParser {}

impl ChatParser {
    /// The message in `text`; `partial` while the generation goes on (an unfinished tool call
    /// is then returned as far as it goes, never guessed).
    pub fn parse(&self, text: &str, partial: bool) -> Result<ParsedMessage> {
        // SAFETY: live parser; text is valid for text.len() bytes (not NUL-terminated: the shim
        // takes the length).
        let raw = unsafe { sluice_chat_parse(self.raw.as_ptr(), text.as_ptr().cast(), text.len(), partial) };
        take_json("common_chat_parse", raw)
    }
}

impl Drop for ChatParser {
    fn drop(&mut self) {
        // SAFETY: raw came from sluice_chat_templates_apply and is freed once.
        unsafe { sluice_chat_parser_free(self.raw.as_ptr()) };
    }
}

/// One tool call of a parsed message.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text (partial while streaming).
    pub arguments: String,
    /// The id the model gave it, if it gives ids.
    pub id: String,
}

/// A generation's text, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ParsedMessage {
    /// The answer.
    pub content: String,
    /// The thinking.
    pub reasoning_content: String,
    /// The tool calls.
    pub tool_calls: Vec<ToolCall>,
}
