#!/usr/bin/env python3
"""The official `openai` client against a running `sluice serve`: completions and chat, plain
and streamed, greedy, with an API key; the usage chunk, log probabilities, tool calls (required
and named, plain, streamed, and a round trip with the tool's result), a JSON schema answer and
`parse` with a pydantic model; the Responses API (plain, streamed, a tool round trip over
`previous_response_id`, `parse`; retrieve, input items, delete). Streamed text must equal the plain text. The served model is a
synthetic one with Qwen3's chat template; nothing pushes the calls but the grammar. Usage:
    openai-check.py BASE_URL API_KEY MODEL
Prints one line per check and ends with 'openai-check: N passed, M failed'."""

import json
import sys

import openai

base, key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok' if ok else 'FAILED'}: {name} {detail}")


c = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0)
check("completion", c.object == "text_completion" and c.usage.completion_tokens == 12, repr(c.choices[0].text))
streamed = "".join(
    ch.choices[0].text
    for ch in client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=12, temperature=0, stream=True
    )
)
check("streamed completion equals the plain one", streamed == c.choices[0].text, repr(streamed))

messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
check("chat", chat.choices[0].message.role == "assistant", repr(chat.choices[0].message.content))
parts = []
finish = None
for ch in client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, stream=True):
    parts.append(ch.choices[0].delta.content or "")
    finish = ch.choices[0].finish_reason or finish
check("streamed chat equals the plain one", "".join(parts) == chat.choices[0].message.content and finish == "length")

models = client.models.list()
check("models", [m.id for m in models.data] == [model])
try:
    openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    check("a wrong key is refused", False)
except openai.AuthenticationError as e:
    check("a wrong key is refused", e.status_code == 401)
try:
    client.completions.create(model=model, prompt="x" * 100000, max_tokens=4)
    check("an oversized prompt is refused", False)
except openai.BadRequestError as e:
    check("an oversized prompt is refused", e.code == "context_length_exceeded", str(e.code))

# A final chunk with the usage.
chunks = list(
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
)
check("include_usage", chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4, repr(chunks[-1].usage))

# Log probabilities: greedy picks the likeliest token, which heads its alternatives.
lp = client.chat.completions.create(
    model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
)
content = lp.choices[0].logprobs.content
check(
    "logprobs",
    len(content) == lp.usage.completion_tokens and all(t.top_logprobs[0].logprob == t.logprob for t in content),
)

# Tools: a required call is made whatever the random weights prefer.
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
ask = [{"role": "user", "content": "Weather in Paris?"}]
call_once = dict(tools=tools, tool_choice="required", max_tokens=200, temperature=0, reasoning_effort="none")
called = client.chat.completions.create(model=model, messages=ask, **call_once)
message = called.choices[0].message
call = message.tool_calls[0] if message.tool_calls else None
check(
    "tool call",
    called.choices[0].finish_reason == "tool_calls"
    and call is not None
    and call.function.name == "get_weather"
    and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo"),
    repr(message.tool_calls),
)
names, arguments = {}, {}
for ch in client.chat.completions.create(model=model, messages=ask, stream=True, **call_once):
    for d in ch.choices[0].delta.tool_calls or []:
        if d.function.name:
            names[d.index] = d.function.name
        arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
check(
    "streamed tool call equals the plain one",
    call is not None and names.get(0) == call.function.name and arguments.get(0) == call.function.arguments,
    repr(arguments),
)
if call is not None:
    back = ask + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 18 C"},
    ]
    answer = client.chat.completions.create(model=model, messages=back, tools=tools, tool_choice="none", max_tokens=6, temperature=0)
    check("tool round trip", answer.choices[0].message.role == "assistant" and not answer.choices[0].message.tool_calls)
else:
    check("tool round trip", False, "no call to answer")

# A JSON schema answer parses and follows the schema.
schema = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
structured = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "A number and a flag"}],
    max_tokens=400,
    temperature=1,
    seed=5,
    response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
)
try:
    value = json.loads(structured.choices[0].message.content)
    ok = sorted(value) == ["n", "ok"] and 0 <= value["n"] <= 9 and isinstance(value["ok"], bool)
except (ValueError, TypeError, KeyError) as e:
    ok = False
check("json_schema", ok, repr(structured.choices[0].message.content))

# A named function is the one called.
clock = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]},
    },
}
named = client.chat.completions.create(
    model=model, messages=ask, tools=tools + [clock], max_tokens=200, temperature=1, seed=3, reasoning_effort="none",
    tool_choice={"type": "function", "function": {"name": "get_time"}},
)
calls = named.choices[0].message.tool_calls or []
check("named tool choice", [c.function.name for c in calls] == ["get_time"], repr(calls))

# parse() with a pydantic model: the schema is enforced, the answer validates.
try:
    import pydantic

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        legs: int = pydantic.Field(ge=0, le=8)

    parsed = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A pet"}], response_format=Pet, max_tokens=300,
        temperature=1, seed=2, reasoning_effort="none",
    )
    choice = parsed.choices[0]
    check("chat parse", choice.finish_reason != "stop" or isinstance(choice.message.parsed, Pet), repr(choice.message.content))
    rparsed = client.responses.parse(
        model=model, input="A pet", text_format=Pet, max_output_tokens=300, temperature=1, reasoning={"effort": "none"}
    )
    check("responses parse", rparsed.status != "completed" or isinstance(rparsed.output_parsed, Pet), repr(rparsed.output_text))
except ImportError:
    check("chat parse", False, "pydantic is missing")

# The Responses API.
r = client.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0)
check("responses", r.status == "incomplete" and r.usage.output_tokens == 8, repr(r.output_text))
events = list(
    client.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True)
)
text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check("streamed responses equal the plain one", text == r.output_text and events[-1].type == "response.incomplete", repr(text))
rtools = [{"type": "function", "name": "get_weather", "parameters": tools[0]["function"]["parameters"]}]
first = client.responses.create(
    model=model, input="Weather in Paris?", tools=rtools, tool_choice="required", max_output_tokens=200, reasoning={"effort": "none"}
)
fcalls = [o for o in first.output if o.type == "function_call"]
check("responses tool call", len(fcalls) == 1 and fcalls[0].name == "get_weather", repr(first.output))
if fcalls:
    second = client.responses.create(
        model=model, previous_response_id=first.id, tools=rtools, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": fcalls[0].call_id, "output": "sunny"}],
    )
    check("responses tool round trip", second.usage.input_tokens > first.usage.input_tokens, repr(second.usage))
else:
    check("responses tool round trip", False, "no call to answer")

# Stored responses: retrieve, their input items, delete (then gone).
got = client.responses.retrieve(r.id)
check("responses retrieve", got.id == r.id and got.output_text == r.output_text, repr(got.output_text))
items = client.responses.input_items.list(r.id)
check("responses input_items", [i.type for i in items.data] == ["message"] and items.data[0].role == "user", repr(items.data))
client.responses.delete(r.id)
try:
    client.responses.retrieve(r.id)
    check("responses delete", False, "still retrievable")
except openai.NotFoundError:
    check("responses delete", True)

failed = checks.count(False)
print(f"openai-check: {len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
