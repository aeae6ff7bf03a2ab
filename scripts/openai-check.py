#!/usr/bin/env python3
"""The official `openai` client against a running `sluice serve`: completions and chat, plain
and streamed, greedy, with an API key. Streamed text must equal the plain text. Usage:
    openai-check.py BASE_URL API_KEY MODEL
Prints one line per check and ends with 'openai-check: N passed, M failed'."""

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

failed = checks.count(False)
print(f"openai-check: {len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
