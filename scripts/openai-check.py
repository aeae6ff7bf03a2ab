#!/usr/bin/env python3
"""The official `openai` client against a running `sluice serve`: completions and chat, plain
and streamed, greedy, with an API key; the usage chunk, log probabilities, tool calls (plain,
streamed, and a round trip with the tool's result) and a JSON schema answer. Streamed text must
equal the plain text. The served model is a synthetic one with Qwen3's chat template. Usage:
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

# Tools. The weights are random: biases make it call (token 264 is <tool_call>, 13 a newline,
# 261 <|im_end|> in the synthetic vocabulary); the chat template and its grammar write the call.
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
call_once = dict(
    tools=tools,
    tool_choice="required",
    max_tokens=200,
    temperature=0,
    frequency_penalty=2,
    logit_bias={"264": 95, "13": 99, "261": 100},
    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
)
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

failed = checks.count(False)
print(f"openai-check: {len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
