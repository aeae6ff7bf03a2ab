#!/usr/bin/env python3
"""The official `ollama` Python client and LangChain's ChatOllama against a running
`sluice serve` (Ollama's API on the same port), with an API key as a bearer token: chat and
generate, plain and streamed (the streamed text equals the plain one), `format` with a JSON
schema (the answer parses and follows it), tools offered and a tool round trip, `think`, list,
show, ps, version, pull (of the served model, and of one no host serves: an error), delete of
the served model (refused); ChatOllama invoke, stream
and bind_tools; then the requests Home Assistant's Ollama integration sends, in its order. Usage:
    ollama-check.py BASE_URL API_KEY MODEL [tools]
BASE_URL is the OpenAI base (ending /v1); `tools` checks only the tool calls, on a model whose
weights always open one. Prints one line per check and ends with
'ollama-check: N passed, M failed'."""

import json
import sys

import httpx
import ollama

base, key, model = sys.argv[1:4]
root = base.removesuffix("/v1")
headers = {"Authorization": f"Bearer {key}"}
client = ollama.Client(host=root, headers=headers, timeout=300)
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok' if ok else 'FAILED'}: {name} {detail}")


greedy = {"temperature": 0, "num_predict": 8}
hello = [{"role": "user", "content": "Hello"}]


def tool_calls_mode():
    """On a model whose weights always open a tool call: the calls come back whole, with object
    arguments, through the client, streamed, LangChain's bind_tools and Home Assistant's flow."""
    from typing import Literal

    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                           "required": ["city"]},
        },
    }
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    opts = {"temperature": 0, "num_predict": 200}
    plain = client.chat(model=model, messages=ask, tools=[weather], think=False, options=opts)
    calls = plain.message.tool_calls or []
    check("a tool call", len(calls) >= 1 and calls[0].function.name == "get_weather"
          and calls[0].function.arguments.get("city") in ("Paris", "Oslo"), repr(plain.message))
    chunks = list(client.chat(model=model, messages=ask, tools=[weather], think=False, options=opts, stream=True))
    streamed = [c for ch in chunks for c in (ch.message.tool_calls or [])]
    check("a streamed tool call", [c.function.arguments for c in streamed] == [c.function.arguments for c in calls], repr(streamed))

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Weather in a city."""
        return "rain"

    llm = ChatOllama(model=model, base_url=root, client_kwargs={"headers": headers}, temperature=0, num_predict=200, reasoning=False)
    bound = llm.bind_tools([get_weather]).invoke("Weather in Oslo?")
    check("ChatOllama bind_tools call", [c["name"] for c in bound.tool_calls][:1] == ["get_weather"]
          and bound.tool_calls[0]["args"].get("city") in ("Paris", "Oslo"), repr(bound.tool_calls))

    light = {
        "type": "function",
        "function": {"name": "HassTurnOn", "description": "Turns on a device",
                     # An enum: the client passes a property's type, description and enum on, not maxLength.
                     "parameters": {"type": "object", "properties": {"name": {"type": "string", "enum": ["kitchen light", "hall light"]}},
                                    "required": ["name"]}},
    }
    turn = [{"role": "system", "content": "You control a home."}, {"role": "user", "content": "Turn on the kitchen light"}]
    ha_chunks = list(client.chat(model=f"{model}:latest", messages=turn, tools=[light], stream=True, keep_alive="-1",
                                 think=False, options={"num_ctx": 8192, "temperature": 0, "num_predict": 200}))
    ha_calls = [c for ch in ha_chunks for c in (ch.message.tool_calls or [])]
    check("Home Assistant's streamed call", len(ha_calls) >= 1 and ha_calls[0].function.name == "HassTurnOn"
          and ha_calls[0].function.arguments.get("name") in ("kitchen light", "hall light"), repr(ha_calls))
    turn += [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": c.function.name, "arguments": c.function.arguments}} for c in ha_calls]},
             {"role": "tool", "content": json.dumps({"success": True})}]
    after = list(client.chat(model=model, messages=turn, tools=[light], stream=True, think=False, options={"num_predict": 8}))
    check("Home Assistant's tool result answered", after[-1].done, repr(after[-1]))


if len(sys.argv) > 4 and sys.argv[4] == "tools":
    tool_calls_mode()
    failed = checks.count(False)
    print(f"ollama-check: {len(checks) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)

# Names: the served id, `id:latest` (as Open WebUI sends it) and the listed name all reach it.
listed = client.list()
names = [m.model for m in listed.models]
check("list", len(names) == 1 and names[0].startswith(model) and listed.models[0].details.format == "gguf", repr(names))

plain = client.chat(model=model, messages=hello, options=greedy, think=False)
check(
    "chat",
    plain.done and plain.done_reason == "length" and plain.eval_count == 8 and plain.prompt_eval_count > 0,
    repr(plain.message.content),
)
parts = [c.message.content for c in client.chat(model=f"{model}:latest", messages=hello, options=greedy, think=False, stream=True)]
check("streamed chat equals the plain one", "".join(parts) == plain.message.content and len(parts) >= 2, repr(parts))

gen = client.generate(model=model, prompt="Hello", options=greedy, think=False)
check("generate", gen.done and gen.eval_count == 8, repr(gen.response))
gparts = [c.response for c in client.generate(model=model, prompt="Hello", options=greedy, think=False, stream=True)]
check("streamed generate equals the plain one", "".join(gparts) == gen.response, repr(gparts))
raw = client.generate(model=model, prompt="The quick brown fox", raw=True, options=greedy)
check("raw generate", raw.done and raw.eval_count == 8, repr(raw.response))

schema = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
formatted = client.chat(
    model=model, messages=[{"role": "user", "content": "A number and a flag"}], format=schema, think=False,
    options={"temperature": 1, "seed": 5, "num_predict": 400},
)
try:
    answer = json.loads(formatted.message.content)
    check("format with a schema", sorted(answer) == ["n", "ok"] and 0 <= answer["n"] <= 9, formatted.message.content)
except ValueError:
    check("format with a schema", False, repr(formatted.message.content))

weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
offered = client.chat(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[weather], think=False, options=greedy)
calls = offered.message.tool_calls or []
check(
    "tools offered",
    offered.done and all(c.function.name == "get_weather" and isinstance(c.function.arguments, dict) for c in calls),
    repr(offered.message),
)
round_trip = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "rain, 7 C", "tool_name": "get_weather"},
]
answered = client.chat(model=model, messages=round_trip, tools=[weather], think=False, options=greedy)
check("tool round trip", answered.done and answered.message.role == "assistant", repr(answered.message.content))

thought = client.chat(model=model, messages=hello, think=True, options={"temperature": 0, "num_predict": 24})
check("think", thought.done and (thought.message.thinking or "") + (thought.message.content or "") != "", repr(thought.message.thinking))

shown = client.show(model)
check("show", shown.details.family and shown.details.quantization_level and "completion" in (shown.capabilities or []), repr(shown.details))
running = client.ps()
check("ps", len(running.models) == 1 and running.models[0].expires_at is not None and running.models[0].context_length > 0, repr(running.models))
version = httpx.get(f"{root}/api/version", headers=headers).json()["version"]
check("version", all(p.isdigit() for p in version.split(".")), version)
check("pull of the served model", client.pull(model).status == "success")
try:
    client.pull("llama3:8b")
    check("pull of a model no host serves fails", False)
except ollama.ResponseError as e:
    # Nothing reaches a registry from the tests: the pull fails, with the host's error.
    check("pull of a model no host serves fails", e.status_code in (404, 502) and e.error != "", e.error)
try:
    client.chat(model="llama3:8b", messages=hello)
    check("another model is not found", False)
except ollama.ResponseError as e:
    check("another model is not found", e.status_code == 404 and "not found" in e.error, e.error)
try:
    client.delete(model)
    check("delete of the served model is refused", False)
except ollama.ResponseError as e:
    check("delete of the served model is refused", e.status_code == 400 and "being served" in e.error, e.error)
try:
    ollama.Client(host=root, headers={"Authorization": "Bearer wrong"}).list()
    check("a wrong key is refused", False)
except ollama.ResponseError as e:
    check("a wrong key is refused", e.status_code == 401, e.error)

from langchain_core.tools import tool  # noqa: E402
from langchain_ollama import ChatOllama  # noqa: E402

llm = ChatOllama(model=model, base_url=root, client_kwargs={"headers": headers}, temperature=0, num_predict=8, reasoning=False)
invoked = llm.invoke("Hello")
check("ChatOllama invoke", invoked.content == plain.message.content, repr(invoked.content))
streamed = "".join(c.content for c in llm.stream("Hello"))
check("ChatOllama stream", streamed == invoked.content, repr(streamed))


@tool
def get_weather(city: str) -> str:
    """Weather in a city."""
    return "rain"


bound = llm.bind_tools([get_weather]).invoke("Weather in Oslo?")
check("ChatOllama bind_tools", all(c["name"] == "get_weather" and isinstance(c["args"], dict) for c in bound.tool_calls), repr(bound))

# Home Assistant's Ollama integration: the models it may use, what is loaded, then a streamed
# chat with its tools, keep_alive and num_ctx, and the tool's result sent back.
ha = ollama.AsyncClient(host=root, headers=headers, timeout=300)


async def home_assistant():
    tags = await ha.list()
    loaded = await ha.ps()
    system = {"role": "system", "content": "You are a voice assistant for Home Assistant."}
    turn = [system, {"role": "user", "content": "Turn on the kitchen light"}]
    light = {
        "type": "function",
        "function": {
            "name": "HassTurnOn",
            "description": "Turns on a device",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": []},
        },
    }
    chunks = []
    async for c in await ha.chat(
        model=f"{model}:latest", messages=turn, tools=[light], stream=True, keep_alive="-1", think=False,
        options={"num_ctx": 8192, "temperature": 0, "num_predict": 12},
    ):
        chunks.append(c)
    text = "".join(c.message.content or "" for c in chunks)
    turn += [
        {"role": "assistant", "content": text, "tool_calls": [{"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}}]},
        {"role": "tool", "content": json.dumps({"success": True})},
    ]
    after = [c async for c in await ha.chat(model=model, messages=turn, tools=[light], stream=True, keep_alive="-1", think=False, options={"num_ctx": 8192, "num_predict": 8})]
    return tags, loaded, chunks, after


import asyncio  # noqa: E402

tags, loaded, chunks, after = asyncio.run(home_assistant())
check(
    "Home Assistant's sequence",
    len(tags.models) == 1 and len(loaded.models) == 1 and chunks[-1].done and after[-1].done and after[-1].done_reason in ("stop", "length"),
    f"{len(chunks)} + {len(after)} chunks",
)

failed = checks.count(False)
print(f"ollama-check: {len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
