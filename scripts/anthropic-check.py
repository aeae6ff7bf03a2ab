#!/usr/bin/env python3
"""The official `anthropic` Python SDK against a running `sluice serve` (Messages API): create and
stream, greedy, with an API key sent as x-api-key; the streamed text equals the plain one;
structured output (output_config.format); a forced tool (tool_choice {type: tool}), plain and streamed (the SDK assembles the input from
input_json_delta events); a two-turn tool_result round trip; a stop sequence; count_tokens against
the usage of the same prompt; errors (a wrong key, a bad field). Nothing pushes the calls but the
grammar. Usage:
    anthropic-check.py BASE_URL API_KEY MODEL [tools-only]
BASE_URL is the OpenAI base (ending /v1); `tools-only` runs only the forced-tool checks (for every
template). Prints one line per check and ends with 'anthropic-check: N passed, M failed'."""

import json
import sys

import anthropic

base, key, model = sys.argv[1:4]
tools_only = len(sys.argv) > 4 and sys.argv[4] == "tools-only"
root = base.removesuffix("/v1")
client = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=300)
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok' if ok else 'FAILED'}: {name} {detail}")


weather = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
clock = {
    "name": "get_time",
    "description": "Time in a zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
no_thinking = {"type": "disabled"}

# A forced tool, plain: the named tool is called, with input of its schema. Room for the most
# verbose call markup of the templates (DeepSeek-V3.2's DSML call is about 190 tokens of the
# test models' vocabularies, which spell most of it a character a token).
# The SDK no longer offers sampling parameters; older clients send them, as extra_body does.
greedy = {"temperature": 0}
for temperature in (0.0, 1.0):
    forced = client.messages.create(
        model=model, max_tokens=400, messages=ask, tools=[weather, clock], extra_body={"temperature": temperature},
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, thinking=no_thinking,
    )
    uses = [b for b in forced.content if b.type == "tool_use"]
    check(
        f"forced tool (temperature {temperature})",
        forced.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
        and uses[0].input.get("city") in ("Paris", "Oslo"),
        repr(forced.content),
    )

# A forced tool, streamed: the SDK builds the input from the input_json_delta events. Parallel
# calls are Anthropic's default: the first call is whole, whatever follows it.
with client.messages.stream(
    model=model, max_tokens=200, messages=ask, tools=[weather], tool_choice={"type": "any"}, thinking=no_thinking,
    extra_body=greedy,
) as s:
    streamed = s.get_final_message()
uses = [b for b in streamed.content if b.type == "tool_use"]
check(
    "streamed forced tool",
    streamed.stop_reason in ("tool_use", "max_tokens") and len(uses) >= 1 and uses[0].input.get("city") in ("Paris", "Oslo"),
    repr(streamed.content),
)

if not tools_only:
    hello = [{"role": "user", "content": "Hello"}]
    plain = client.messages.create(model=model, max_tokens=8, messages=hello, extra_body=greedy, thinking=no_thinking)
    text = "".join(b.text for b in plain.content if b.type == "text")
    check(
        "create",
        plain.type == "message" and plain.role == "assistant" and plain.stop_reason in ("max_tokens", "end_turn")
        and plain.usage.output_tokens >= 1 and plain.id.startswith("msg_"),
        repr(text),
    )
    with client.messages.stream(model=model, max_tokens=8, messages=hello, extra_body=greedy, thinking=no_thinking) as s:
        streamed_text = "".join(s.text_stream)
        final = s.get_final_message()
    check("streamed text equals the plain one", streamed_text == text and final.stop_reason == plain.stop_reason, repr(streamed_text))

    # A stop sequence taken from the greedy answer ends it there, and is reported.
    stop = text.strip()[:2]
    if stop:
        stopped = client.messages.create(
            model=model, max_tokens=8, messages=hello, extra_body=greedy, thinking=no_thinking, stop_sequences=[stop]
        )
        stopped_text = "".join(b.text for b in stopped.content if b.type == "text")
        check(
            "stop sequence",
            stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop and stopped_text == text[: text.index(stop)],
            repr((stop, stopped_text)),
        )

    # Structured output (output_config.format): the answer parses and follows the schema.
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    shaped = client.messages.create(
        model=model, max_tokens=400, messages=[{"role": "user", "content": "A number and a flag"}], thinking=no_thinking,
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"temperature": 1},
    )
    try:
        answer = json.loads("".join(b.text for b in shaped.content if b.type == "text"))
        check("output_config.format", sorted(answer) == ["n", "ok"] and 0 <= answer["n"] <= 9, repr(answer))
    except ValueError:
        check("output_config.format", False, repr(shaped.content))

    # The tool's result, sent back in a second turn.
    forced = client.messages.create(
        model=model, max_tokens=200, messages=ask, tools=[weather], thinking=no_thinking, extra_body=greedy,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    use = next((b for b in forced.content if b.type == "tool_use"), None)
    if use is not None:
        turn2 = ask + [
            {"role": "assistant", "content": forced.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 18 C"}]},
        ]
        answer = client.messages.create(
            model=model, max_tokens=6, messages=turn2, tools=[weather], tool_choice={"type": "none"}, thinking=no_thinking
        )
        check("tool_result round trip", answer.role == "assistant" and not any(b.type == "tool_use" for b in answer.content))
    else:
        check("tool_result round trip", False, "no tool use to answer")

    # count_tokens counts the prompt the template renders: what create then reports as input.
    counted = client.messages.count_tokens(model=model, messages=hello, thinking=no_thinking)
    used = plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    check("count_tokens", counted.input_tokens == used and used > 0, f"{counted.input_tokens} vs {used}")

    try:
        anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=hello
        )
        check("a wrong key is refused", False)
    except anthropic.AuthenticationError as e:
        check("a wrong key is refused", e.status_code == 401 and e.body["error"]["type"] == "authentication_error")
    try:
        client.messages.create(model=model, max_tokens=4, messages=hello, extra_body={"temperature": 3})
        check("a bad field is refused", False)
    except anthropic.BadRequestError as e:
        check("a bad field is refused", e.body["error"]["type"] == "invalid_request_error" and "temperature" in e.message, e.message)

failed = checks.count(False)
print(f"anthropic-check: {len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
