// The parts of llama.cpp's common/ that sluice uses (what llama-server and llama.cpp's lookup
// decoding run), behind a narrow C interface: the model's Jinja chat templates applied to OpenAI
// messages, tools and options; generated text parsed back into content, reasoning and tool
// calls; common's sampler (grammar, lazy grammar triggers, penalties, top-k/top-p/min-p,
// temperature, seed); and the n-gram cache that drafts tokens from the context.
//
// Requests and results cross as JSON text, so the interface stays a handful of functions. Every
// entry point catches what common throws (bad templates, bad schemas, bad grammars) and records
// it in the per-thread record shim.cpp keeps (shim.h); the Rust side turns it into an error with
// `caught`. What common would GGML_ASSERT on is checked here first.

#include "chat-peg-parser.h"
#include "chat.h"
#include "common.h"
#include "jinja/work.h"
#include "json-schema-to-grammar.h"
#include "llama.h"
#include "ngram-cache.h"
#include "sampling.h"
#include "shim.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

char * dup_string(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out == nullptr) {
        throw std::bad_alloc();
    }
    std::memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
    return out;
}

// The longest chat template source sluice parses (its parse tree is as deep as its longest
// chain of operators, and it is lexed and kept whole): real templates are tens of KiB.
constexpr size_t MAX_TEMPLATE_BYTES = 256 * 1024;

void check_template_size(const char * source, const char * what) {
    const size_t n = source == nullptr ? 0 : std::strlen(source);
    if (n > MAX_TEMPLATE_BYTES) {
        throw std::length_error(std::string(what) + " is " + std::to_string(n) + " bytes; sluice parses templates of up to " +
                                std::to_string(MAX_TEMPLATE_BYTES) + " bytes");
    }
}

std::vector<llama_token> tokenize_tag(const llama_vocab * vocab, const std::string & tag) {
    return common_tokenize(vocab, tag, /* add_special */ false, /* parse_special */ true);
}

// The object a generic tool call is written as, for templates that have no tool-call syntax of
// their own (ChatML, or a template that never renders tool calls).
const std::string GENERIC_CALLS_START = "{\"tool_calls\": ";

// What a template without tool calls is told about the request's tools, in its system message.
std::string generic_tools_instructions(const common_json & tools, bool required, bool parallel) {
    std::string out = "You can call these tools (each one's arguments follow its JSON schema):\n";
    for (const auto & tool : tools) {
        out += tool.at("function").dump() + "\n";
    }
    out += required ? "You must call " : "To call ";
    out += parallel ? "one or more of them" : "one of them";
    out += required ? ": answer" : ", answer";
    out += " with only a JSON object {\"tool_calls\": [{\"name\": \"<tool name>\", \"arguments\": {...}}]}";
    out += parallel ? "." : " holding one call.";
    out += " Tool results come back to you as {\"tool_response\": ...} messages.";
    return out;
}

// The messages of a chat with tools, rewritten for a template without tool calls: the tools and
// how to call them in the system message, an assistant's calls as the JSON it was asked to write,
// and tool results as user messages (consecutive ones together, so user and assistant still take
// turns for the templates that insist on it).
common_json generic_tool_messages(const common_json & messages, const common_json & tools, bool required, bool parallel) {
    common_json out = common_json::array();
    const std::string instructions = generic_tools_instructions(tools, required, parallel);
    const auto is_system = [](const common_json & m) {
        const std::string role = m.value("role", std::string());
        return role == "system" || role == "developer";
    };
    if (messages.empty() || !is_system(messages.at(static_cast<size_t>(0)))) {
        out.push_back(common_json{ { "role", "system" }, { "content", instructions } });
    }
    for (size_t i = 0; i < messages.size(); ++i) {
        const auto & m = messages.at(i);
        const std::string role = m.value("role", std::string());
        common_json msg = m;
        if (i == 0 && is_system(m)) {
            const std::string text = m.contains("content") && m.at("content").is_string() ? m.at("content").get<std::string>() : "";
            msg["role"] = "system";
            msg["content"] = text.empty() ? instructions : text + "\n\n" + instructions;
        } else if (role == "assistant" && m.contains("tool_calls") && m.at("tool_calls").is_array()) {
            common_json calls = common_json::array();
            for (const auto & c : m.at("tool_calls")) {
                const auto & f = c.at("function");
                common_json args = f.at("arguments");
                if (args.is_string()) {
                    args = common_json::parse(args.get<std::string>());
                }
                calls.push_back({ { "name", f.at("name") }, { "arguments", args } });
            }
            const std::string text = m.contains("content") && m.at("content").is_string() ? m.at("content").get<std::string>() : "";
            const std::string call_text = common_json{ { "tool_calls", calls } }.dump();
            msg.erase("tool_calls");
            msg["content"] = text.empty() ? call_text : text + "\n" + call_text;
        } else if (role == "tool") {
            common_json result = { { "tool_response", { { "tool_call_id", m.value("tool_call_id", std::string()) },
                                                        { "content", m.value("content", common_json()) } } } };
            if (!out.empty() && out.back().value("role", std::string()) == "user" && out.back().value("sluice_tool", false)) {
                out.back()["content"] = out.back()["content"].get<std::string>() + "\n" + result.dump();
                continue;
            }
            msg = { { "role", "user" }, { "content", result.dump() }, { "sluice_tool", true } };
        }
        out.push_back(msg);
    }
    for (size_t i = 0; i < out.size(); ++i) {
        out[i].erase("sluice_tool");
    }
    return out;
}

// Whether the templates write tool calls of their own: their capabilities say so, or a handler
// made a call grammar for a required call (LFM2's handler does for a template whose rendering
// the capability probe cannot see calls in). A template that cannot render the request with
// tools at all has none.
bool has_tool_syntax(const common_chat_templates * tmpls, const common_chat_templates_inputs & inputs) {
    const auto caps = common_chat_templates_get_caps(tmpls);
    const auto native = caps.find("supports_tool_calls");
    if (native != caps.end() && native->second) {
        return true;
    }
    auto probe = inputs;
    probe.tool_choice = COMMON_CHAT_TOOL_CHOICE_REQUIRED;
    probe.json_schema.clear();
    try {
        return !common_chat_templates_apply(tmpls, probe).grammar.empty();
    } catch (const std::exception &) {
        return false;
    }
}

// The optional thinking block of `params`' format, as its handler names the tags.
common_peg_parser thinking_block(common_chat_peg_builder & p, const common_chat_params & params, bool extract) {
    if (!extract || params.thinking_start_tag.empty() || params.thinking_end_tags.empty()) {
        return p.eps();
    }
    const std::string start = string_strip(params.thinking_start_tag);
    const std::string end   = string_strip(params.thinking_end_tags.front());
    return p.optional(p.optspace(start) + p.reasoning(p.until(end)) + p.optspace(end));
}

// Replaces the parser and grammar of `params` with `body` after the generation prompt and the
// optional thinking block; the grammar waits for `trigger` when it is not empty.
void constrain(common_chat_params & params, const common_chat_templates_inputs & inputs,
               const std::function<common_peg_parser(common_chat_peg_builder &)> & body, const std::string & trigger) {
    const bool extract = inputs.reasoning_format != COMMON_REASONING_FORMAT_NONE;
    const auto arena = build_chat_peg_parser([&](common_chat_peg_builder & p) {
        const std::string start = string_strip(params.thinking_start_tag);
        return p.prefix(params.generation_prompt, start) << (thinking_block(p, params, extract) + body(p) + p.end());
    });
    params.parser       = arena.save();
    params.format       = COMMON_CHAT_FORMAT_PEG_NATIVE;
    params.grammar_lazy = !trigger.empty();
    params.grammar      = build_grammar([&](const common_grammar_builder & builder) {
        arena.build_grammar(builder, params.grammar_lazy);
    });
    params.grammar_triggers.clear();
    if (params.grammar_lazy) {
        params.grammar_triggers.push_back({ COMMON_GRAMMAR_TRIGGER_TYPE_WORD, trigger });
    }
}

// A response_format schema the template's handler made no grammar for: the answer is that JSON
// (after the thinking block), as llama.cpp's own handlers write it.
void constrain_to_schema(common_chat_params & params, const common_chat_templates_inputs & inputs) {
    const auto schema = common_json::parse(inputs.json_schema);
    constrain(params, inputs, [&](common_chat_peg_builder & p) {
        return p.space() + p.content(p.schema(p.json(), "response-format-schema", schema)) + p.space();
    }, "");
}

// Generic tool calls for a template without its own: the answer is {"tool_calls": [...]} (the
// only answer when a call is required; otherwise the response_format's JSON or the call, or text
// with the call, if any, after it).
void constrain_to_generic_calls(common_chat_params & params, const common_chat_templates_inputs & inputs,
                                const common_json & tools) {
    const bool required = inputs.tool_choice == COMMON_CHAT_TOOL_CHOICE_REQUIRED;
    const bool schema   = !inputs.json_schema.empty();
    constrain(params, inputs, [&](common_chat_peg_builder & p) {
        auto calls = p.standard_json_tools(GENERIC_CALLS_START, "}", tools, inputs.parallel_tool_calls, true, "name",
                                           "arguments", /* array_wrapped */ true);
        if (required) {
            return p.space() + calls + p.space();
        }
        if (schema) {
            const auto response = p.content(p.schema(p.json(), "response-format-schema", common_json::parse(inputs.json_schema)));
            return p.space() + p.choice({ calls, response }) + p.space();
        }
        return p.optional(p.content(p.until(GENERIC_CALLS_START))) + p.optional(calls + p.space());
    }, required || schema ? "" : GENERIC_CALLS_START);
}

}  // namespace

// A model's chat templates (default and tool_use), parsed.
struct sluice_chat_templates {
    common_chat_templates_ptr tmpls;
};

// How one generation's text is parsed back into a message: the format and PEG parser the
// template's handler chose, with the request's reasoning and tool-call settings.
struct sluice_chat_parser {
    common_chat_parser_params params;
};

// common's sampler for one generation.
struct sluice_sampler {
    common_sampler * smpl = nullptr;
    ~sluice_sampler() {
        if (smpl != nullptr) {
            common_sampler_free(smpl);
        }
    }
};

extern "C" {

void sluice_string_free(char * s) {
    std::free(s);
}

// The templates of `model` (tokenizer.chat_template and tokenizer.chat_template.tool_use; chatml
// when it has none), or of `source` when it is not NULL (then `model` may be NULL, and `bos` /
// `eos` name the tokens the template may print). NULL after an exception.
struct sluice_chat_templates * sluice_chat_templates_init(const struct llama_model * model, const char * source,
                                                          const char * bos, const char * eos) {
    try {
        if (model == nullptr && (source == nullptr || source[0] == '\0')) {
            throw std::invalid_argument("a chat template needs a model or a template source");
        }
        if (source != nullptr && source[0] != '\0') {
            check_template_size(source, "the chat template");
        } else {
            check_template_size(llama_model_chat_template(model, nullptr), "the model's chat template (tokenizer.chat_template)");
            check_template_size(llama_model_chat_template(model, "tool_use"),
                                "the model's tool-use chat template (tokenizer.chat_template.tool_use)");
        }
        auto t = std::make_unique<sluice_chat_templates>();
        t->tmpls = common_chat_templates_init(model, source ? source : "", bos ? bos : "", eos ? eos : "");
        return t.release();
    }
    SLUICE_CATCH(nullptr)
}

// Bounds this thread's next template parses and renders (see jinja/work.h); `max_ms` counts
// from this call.
void sluice_chat_set_work_limits(size_t max_depth, uint64_t max_steps, size_t max_value, int64_t max_ms) {
    jinja::work_limits limits;
    limits.max_depth = max_depth;
    limits.max_steps = max_steps;
    limits.max_value = max_value;
    limits.max_ms = max_ms;
    jinja::set_work_limits(limits);
}

// Stops every template parse and render of the process at its next step (see jinja/work.h).
void sluice_chat_stop_all_work() {
    jinja::work_stop_all();
}

void sluice_chat_templates_free(struct sluice_chat_templates * t) {
    delete t;
}

// Applies the templates to `inputs_json`:
//   {"messages": [OpenAI messages], "tools": [OpenAI tools]?, "tool_choice": "auto"|"none"|"required",
//    "parallel_tool_calls": bool, "json_schema": {schema}?, "enable_thinking": bool,
//    "reasoning_format": "none"|"auto"|"deepseek"|"deepseek-legacy", "parse_tool_calls": bool,
//    "kwargs": {name: value}, "now": unix seconds?, "add_generation_prompt": bool}
// Returns the result as JSON (freed with sluice_string_free):
//   {"prompt", "format", "grammar", "grammar_lazy", "grammar_triggers": [{"type", "value", "token"}],
//    "preserved_tokens", "additional_stops", "generation_prompt", "thinking_start_tag",
//    "thinking_end_tags", "generic_tools": bool}
// and the parser for the generation's text in *parser. NULL after an exception.
//
// Two things no answer goes without: tools on a template with no tool-call syntax are offered and
// parsed in a generic JSON form ("generic_tools": true), and a json_schema the template's handler
// made no grammar for is enforced by one built here (after the thinking block).
char * sluice_chat_templates_apply(const struct sluice_chat_templates * t, const char * inputs_json,
                                   struct sluice_chat_parser ** parser) {
    try {
        const auto in = common_json::parse(inputs_json);
        common_chat_templates_inputs inputs;
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(in.value("tool_choice", std::string("auto")));
        inputs.messages = common_chat_msgs_parse_oaicompat(in.at("messages"));
        if (in.contains("tools")) {
            inputs.tools = common_chat_tools_parse_oaicompat(in.at("tools"));
        }
        inputs.parallel_tool_calls = in.value("parallel_tool_calls", false);
        if (in.contains("json_schema")) {
            inputs.json_schema = in.at("json_schema").dump();
        }
        inputs.enable_thinking = in.value("enable_thinking", true);
        inputs.reasoning_format = common_reasoning_format_from_name(in.value("reasoning_format", std::string("auto")));
        inputs.add_generation_prompt = in.value("add_generation_prompt", true);
        if (in.contains("now")) {
            inputs.now = std::chrono::system_clock::time_point(std::chrono::seconds(in.at("now").get<long long>()));
        }
        if (in.contains("kwargs")) {
            for (const auto & kv : in.at("kwargs").items()) {
                inputs.chat_template_kwargs[kv.key()] = kv.value().dump();
            }
        }
        const bool generic_tools = !inputs.tools.empty() && inputs.tool_choice != COMMON_CHAT_TOOL_CHOICE_NONE &&
                                   !has_tool_syntax(t->tmpls.get(), inputs);
        if (generic_tools) {
            inputs.messages = common_chat_msgs_parse_oaicompat(generic_tool_messages(
                in.at("messages"), in.at("tools"), inputs.tool_choice == COMMON_CHAT_TOOL_CHOICE_REQUIRED,
                inputs.parallel_tool_calls));
            inputs.tools.clear();
        }
        common_chat_params params = common_chat_templates_apply(t->tmpls.get(), inputs);
        if (generic_tools) {
            constrain_to_generic_calls(params, inputs, in.at("tools"));
        } else if (!inputs.json_schema.empty() && params.grammar.empty()) {
            constrain_to_schema(params, inputs);
        }

        auto p = std::make_unique<sluice_chat_parser>();
        p->params = common_chat_parser_params(params);
        p->params.reasoning_format = inputs.reasoning_format;
        p->params.parse_tool_calls = in.value("parse_tool_calls", !inputs.tools.empty() || generic_tools);
        if (!params.parser.empty()) {
            p->params.parser.load(params.parser);
        }

        common_json triggers = common_json::array();
        for (const auto & trigger : params.grammar_triggers) {
            common_json t = common_json::object();
            t["type"] = static_cast<int>(trigger.type);
            t["value"] = trigger.value;
            t["token"] = static_cast<int>(trigger.token);
            triggers.push_back(t);
        }
        common_json out = common_json::object();
        out["prompt"] = params.prompt;
        out["format"] = std::string(common_chat_format_name(params.format));
        out["grammar"] = params.grammar;
        out["grammar_lazy"] = params.grammar_lazy;
        out["grammar_triggers"] = triggers;
        out["preserved_tokens"] = params.preserved_tokens;
        out["additional_stops"] = params.additional_stops;
        out["generation_prompt"] = params.generation_prompt;
        out["thinking_start_tag"] = params.thinking_start_tag;
        out["thinking_end_tags"] = params.thinking_end_tags;
        out["generic_tools"] = generic_tools;
        char * json = dup_string(out.dump());
        *parser = p.release();
        return json;
    }
    SLUICE_CATCH(nullptr)
}

void sluice_chat_parser_free(struct sluice_chat_parser * p) {
    delete p;
}

// Parses generated `text` (`len` bytes; `partial` while more may follow) into
//   {"content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]}
// (freed with sluice_string_free). NULL after an exception.
char * sluice_chat_parse(const struct sluice_chat_parser * p, const char * text, size_t len, bool partial) {
    try {
        const common_chat_msg msg = common_chat_parse(std::string(text, len), partial, p->params);
        common_json calls = common_json::array();
        for (const auto & call : msg.tool_calls) {
            common_json c = common_json::object();
            c["name"] = call.name;
            c["arguments"] = call.arguments;
            c["id"] = call.id;
            calls.push_back(c);
        }
        common_json out = common_json::object();
        out["content"] = msg.content;
        out["reasoning_content"] = msg.reasoning_content;
        out["tool_calls"] = calls;
        return dup_string(out.dump_safe());
    }
    SLUICE_CATCH(nullptr)
}

// common's sampler for `model`, from `params_json`:
//   {"temperature", "top_k", "top_p", "min_p", "penalty_last_n", "penalty_repeat", "penalty_freq",
//    "penalty_present", "seed", "logit_bias": [[token, bias]], "grammar", "grammar_kind": "user"|"output"|"tools", "grammar_lazy",
//    "grammar_triggers": [{"type", "value", "token"}], "generation_prompt", "thinking_start_tag",
//    "thinking_end_tags": [...], "thinking_budget": tokens?}
// A thinking budget closes the thinking block (with the first end tag) once it has that many tokens.
// A temperature of 0 chooses the highest logit (the lowest id on ties). NULL after an exception.
struct sluice_sampler * sluice_sampler_init(const struct llama_model * model, const char * params_json) {
    try {
        const auto in = common_json::parse(params_json);
        const llama_vocab * vocab = llama_model_get_vocab(model);
        common_params_sampling sp;
        sp.no_perf = true;
        sp.temp = in.value("temperature", 0.0f);
        sp.top_k = in.value("top_k", 0);
        sp.top_p = in.value("top_p", 1.0f);
        sp.min_p = in.value("min_p", 0.0f);
        sp.penalty_last_n = in.value("penalty_last_n", 64);
        sp.penalty_repeat = in.value("penalty_repeat", 1.0f);
        sp.penalty_freq = in.value("penalty_freq", 0.0f);
        sp.penalty_present = in.value("penalty_present", 0.0f);
        sp.seed = in.value("seed", 0u);
        if (in.contains("logit_bias")) {
            for (const auto & b : in.at("logit_bias")) {
                const int token = b.at(static_cast<size_t>(0)).get<int>();
                if (token < 0 || token >= llama_vocab_n_tokens(vocab)) {
                    throw std::invalid_argument("logit_bias: token " + std::to_string(token) +
                                                " is not in the vocabulary (0 to " +
                                                std::to_string(llama_vocab_n_tokens(vocab) - 1) + ")");
                }
                sp.logit_bias.push_back({ token, b.at(static_cast<size_t>(1)).get<float>() });
            }
        }
        if (sp.temp <= 0.0f) {
            // Greedy: only the penalties and the temperature-0 filter, which keeps the first
            // highest logit in id order (no sort before it, so ties go to the lowest id).
            sp.samplers = { COMMON_SAMPLER_TYPE_PENALTIES, COMMON_SAMPLER_TYPE_TEMPERATURE };
        } else {
            sp.samplers = { COMMON_SAMPLER_TYPE_PENALTIES, COMMON_SAMPLER_TYPE_TOP_K, COMMON_SAMPLER_TYPE_TOP_P,
                            COMMON_SAMPLER_TYPE_MIN_P, COMMON_SAMPLER_TYPE_TEMPERATURE };
        }
        const std::string grammar = in.value("grammar", std::string());
        if (!grammar.empty()) {
            const std::string kind = in.value("grammar_kind", std::string("user"));
            const common_grammar_type type = kind == "tools"  ? COMMON_GRAMMAR_TYPE_TOOL_CALLS :
                                             kind == "output" ? COMMON_GRAMMAR_TYPE_OUTPUT_FORMAT :
                                                                COMMON_GRAMMAR_TYPE_USER;
            sp.grammar = common_grammar(type, grammar);
            sp.grammar_lazy = in.value("grammar_lazy", false);
            if (in.contains("grammar_triggers")) {
                for (const auto & t : in.at("grammar_triggers")) {
                    const int type = t.at("type").get<int>();
                    if (type < COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN || type > COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL) {
                        throw std::invalid_argument("unknown grammar trigger type " + std::to_string(type));
                    }
                    common_grammar_trigger trigger;
                    trigger.type = static_cast<common_grammar_trigger_type>(type);
                    trigger.value = t.value("value", std::string());
                    trigger.token = t.value("token", static_cast<int>(LLAMA_TOKEN_NULL));
                    if (trigger.type == COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN &&
                        (trigger.token < 0 || trigger.token >= llama_vocab_n_tokens(vocab))) {
                        throw std::invalid_argument("grammar trigger token " + std::to_string(trigger.token) +
                                                    " is not in the vocabulary");
                    }
                    sp.grammar_triggers.push_back(trigger);
                }
            }
        }
        sp.generation_prompt = in.value("generation_prompt", std::string());
        // A lazy (tool-call) grammar must not wake inside a thinking block: common's reasoning
        // budget sampler, unlimited unless the request sets a budget, tracks the block as
        // llama-server arranges it.
        const std::string think_start = in.value("thinking_start_tag", std::string());
        const auto think_ends = in.value("thinking_end_tags", std::vector<std::string>());
        sp.reasoning_budget_tokens = in.value("thinking_budget", -1);
        if ((sp.grammar_lazy || sp.reasoning_budget_tokens >= 0) && !think_start.empty() && !think_ends.empty()) {
            sp.reasoning_budget_start = tokenize_tag(vocab, think_start);
            for (const auto & end : think_ends) {
                sp.reasoning_budget_end.push_back(tokenize_tag(vocab, end));
            }
            sp.reasoning_budget_forced = sp.reasoning_budget_end.front();
        }
        auto s = std::make_unique<sluice_sampler>();
        s->smpl = common_sampler_init(model, sp);
        if (s->smpl == nullptr) {
            throw std::runtime_error("the sampler could not be created (is the grammar valid?)");
        }
        return s.release();
    }
    SLUICE_CATCH(nullptr)
}

void sluice_sampler_free(struct sluice_sampler * s) {
    delete s;
}

// Feeds a token the model did not generate (a prompt token) to the penalties' history.
void sluice_sampler_accept_prompt(struct sluice_sampler * s, llama_token token) {
    try {
        common_sampler_accept(s->smpl, token, /* is_generated */ false);
    }
    SLUICE_CATCH()
}

// Chooses the token for output `idx` of the last decode of `ctx` and accepts it (grammar,
// penalties). LLAMA_TOKEN_NULL after an exception.
llama_token sluice_sampler_sample(struct sluice_sampler * s, struct llama_context * ctx, int32_t idx) {
    try {
        const llama_token token = common_sampler_sample(s->smpl, ctx, idx);
        common_sampler_accept(s->smpl, token, /* is_generated */ true);
        return token;
    }
    SLUICE_CATCH(LLAMA_TOKEN_NULL)
}

// The context of one generation (prompt and accepted tokens) and its n-gram statistics, as
// llama.cpp's lookup decoding keeps them.
struct sluice_ngram_draft {
    std::vector<llama_token> inp;
    common_ngram_cache context;
    common_ngram_cache dynamic;
    common_ngram_cache statik;
};

struct sluice_ngram_draft * sluice_ngram_draft_new(void) {
    try {
        return new sluice_ngram_draft();
    }
    SLUICE_CATCH(nullptr)
}

void sluice_ngram_draft_free(struct sluice_ngram_draft * d) {
    delete d;
}

// Appends `n` tokens to the context and counts the n-grams they end.
void sluice_ngram_draft_add(struct sluice_ngram_draft * d, const llama_token * tokens, size_t n) {
    try {
        d->inp.insert(d->inp.end(), tokens, tokens + n);
        common_ngram_cache_update(d->context, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, d->inp, (int) n, false);
    }
    SLUICE_CATCH()
}

// Drafts up to `max` tokens to follow the context (fewer, or none, when the statistics are not
// confident); returns how many were written to `out`.
size_t sluice_ngram_draft_make(struct sluice_ngram_draft * d, llama_token * out, size_t max) {
    try {
        if (d->inp.empty() || max == 0) {
            return 0;
        }
        std::vector<llama_token> draft = { d->inp.back() };
        common_ngram_cache_draft(d->inp, draft, (int) max, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, d->context, d->dynamic,
                                 d->statik);
        const size_t n = std::min(max, draft.size() - 1);
        std::copy(draft.begin() + 1, draft.begin() + 1 + n, out);
        return n;
    }
    SLUICE_CATCH(0)
}

}  // extern "C"
