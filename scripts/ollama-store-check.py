#!/usr/bin/env python3
"""Home Assistant's and Open WebUI's model handling, through the official `ollama` Python
client, against a running `sluice serve` whose store the test filled and whose pulls go to a
registry the test serves on loopback. Home Assistant: the model it was set up with is not
listed, so it pulls it (progress streamed), finds it listed, then chats with it streamed. Open
WebUI: lists the tags, chats with another stored model (which is loaded in place of the first),
shows a stored model, lists what is running. Then a stored model is deleted, and the served one cannot be. Usage:
    ollama-store-check.py ROOT_URL SERVED PULLED STORED
Prints one line per check and ends with 'ollama-store-check: N passed, M failed'."""

import json
import sys
import urllib.request

import ollama

root, served, pulled, stored = sys.argv[1:5]
client = ollama.Client(host=root, timeout=300)
checks = []
greedy = {"temperature": 0, "num_predict": 8}
hello = [{"role": "user", "content": "Hello"}]


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok' if ok else 'FAILED'}: {name} {detail}")


def names():
    return [m.model for m in client.list().models]


def running():
    return [m.model for m in client.ps().models]


# Home Assistant's Ollama integration.
check("the model to pull is not listed", pulled not in names(), repr(names()))
progress = list(client.pull(pulled, stream=True))
statuses = [p.status for p in progress]
files = [p for p in progress if p.digest and p.total]
check("the pull streams Ollama's progress",
      statuses[0] == "pulling manifest" and statuses[-1] == "success" and files
      and all(p.completed is not None and p.completed <= p.total for p in files)
      and any(p.completed == p.total for p in files), repr(statuses))
check("the pulled model is listed", pulled in names(), repr(names()))
chunks = list(client.chat(model=pulled, messages=hello, stream=True, options=greedy))
text = "".join(c.message.content or "" for c in chunks)
check("a streamed chat with the pulled model", chunks[-1].done and chunks[-1].model == pulled and text != "", repr(text))
check("the pulled model runs", running() == [pulled], repr(running()))

# Open WebUI.
listed = names()
shown = client.show(stored)
check("show of a stored model not loaded", shown.details.family and "completion" in (shown.capabilities or [])
      and running() == [pulled], repr(shown.details))
check("the tags list every stored model", all(n in listed for n in (pulled, stored)), repr(listed))
answer = client.chat(model=stored, messages=hello, options=greedy)
check("a chat with a second stored model", answer.done and answer.model == stored and answer.message.content != "",
      repr(answer.message.content))
check("the second model is loaded and the first is not", running() == [stored], repr(running()))
# Open WebUI's OpenAI connection: /v1/models lists the stored models, and a chat naming one
# loads it.
models_page = json.loads(urllib.request.urlopen(root + "/v1/models").read())
openai_ids = [m["id"] for m in models_page["data"]]
request = urllib.request.Request(root + "/v1/chat/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": pulled, "messages": hello, "max_tokens": 8,
                                                  "temperature": 0}).encode())
reply = json.loads(urllib.request.urlopen(request).read())
check("an OpenAI chat naming a model /v1/models lists loads it",
      pulled in openai_ids and reply["choices"][0]["message"]["content"] != "" and running() == [pulled],
      repr((openai_ids, reply.get("model"), running())))
back = client.generate(model=served, prompt="Hello", options=greedy)
check("the model served first comes back", back.done and running() == [served + ":latest"] or running() == [served],
      repr(running()))

# Deleting.
client.delete(pulled)
check("a deleted model is no longer listed", pulled not in names(), repr(names()))
try:
    client.delete(served)
    check("the served model cannot be deleted", False)
except ollama.ResponseError as e:
    check("the served model cannot be deleted", e.status_code == 400 and "being served" in e.error, e.error)

print(f"ollama-store-check: {sum(checks)} passed, {len(checks) - sum(checks)} failed")
sys.exit(0 if all(checks) else 1)
