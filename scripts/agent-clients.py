#!/usr/bin/env python3
"""The agent frameworks clients build on, against a running `sluice serve` whose synthetic model
carries Qwen3's chat template: LangChain (`bind_tools` with "any" and a named tool,
`with_structured_output` by json_schema and by function_calling, a two-step tool-calling agent,
the Responses API), LangGraph's prebuilt agent graph, litellm (a required call, a schema) and
instructor (TOOLS and JSON_SCHEMA modes). The weights are random: nothing but the grammar makes
the calls and the structured answers. A framework that is not installed is reported as skipped.
Usage:
    agent-clients.py BASE_URL API_KEY MODEL
Prints one line per check and ends with 'agent-clients: N passed, M failed, K skipped'."""

import os
import sys
import warnings
from typing import Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no download at import

import pydantic

base, key, model = sys.argv[1:4]
checks = []
skipped = []
# Thinking off, as llama-server takes it (chat_template_kwargs), for clients that pass extra_body on.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok' if ok else 'FAILED'}: {name} {detail}")


def framework(name, run):
    try:
        run()
    except ImportError as e:
        skipped.append(name)
        print(f"skipped: {name} ({e})")


class Weather(pydantic.BaseModel):
    """Weather in a city."""

    city: Literal["Paris", "Oslo"]


class Pet(pydantic.BaseModel):
    """A pet."""

    name: str = pydantic.Field(max_length=16)
    legs: int = pydantic.Field(ge=0, le=8)


def weather_tool(city: str) -> str:
    """Weather in a city: Paris or Oslo."""
    return f"sunny in {city}"


def langchain_tool():
    from langchain_core.tools import StructuredTool

    return StructuredTool.from_function(weather_tool, name="weather_tool", args_schema=Weather)


def langchain():
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base, api_key=key, model=model, max_retries=0, max_tokens=300, reasoning_effort="none")
    get_weather = langchain_tool()
    for choice in ["any", "weather_tool"]:
        msg = llm.bind_tools([get_weather, Pet], tool_choice=choice).invoke("Weather in Paris?")
        names = [c["name"] for c in msg.tool_calls]
        expected = names == ["weather_tool"] if choice != "any" else len(names) == 1
        check(f"langchain bind_tools {choice}", expected, repr(msg.tool_calls))
    for method in ["json_schema", "function_calling"]:
        pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet")
        check(f"langchain with_structured_output {method}", isinstance(pet, Pet), repr(pet))
    # Two steps: the forced call, the tool's result, then the answer.
    question = [HumanMessage("Weather in Paris?")]
    call = llm.bind_tools([get_weather], tool_choice="any").invoke(question)
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in call.tool_calls]
    answer = llm.bind_tools([get_weather]).invoke(question + [call] + results)
    check("langchain two-step agent", len(results) == 1 and answer.type == "ai", repr(answer.content)[:80])
    responses = ChatOpenAI(
        base_url=base, api_key=key, model=model, max_retries=0, max_tokens=300, use_responses_api=True,
        reasoning={"effort": "none"},
    )
    msg = responses.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    check("langchain responses api tool call", [c["name"] for c in msg.tool_calls] == ["weather_tool"], repr(msg.tool_calls))


def langgraph():
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(base_url=base, api_key=key, model=model, max_retries=0, max_tokens=200, reasoning_effort="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # moved to langchain.agents in LangGraph 1.0; still LangGraph's graph
        agent = create_react_agent(llm, [langchain_tool()])
    out = agent.invoke({"messages": [("user", "Weather in Paris?")]}, {"recursion_limit": 12})
    check("langgraph agent graph runs to an answer", out["messages"][-1].type == "ai", repr(out["messages"][-1].content)[:80])


def litellm_checks():
    import litellm

    common = dict(model=f"openai/{model}", api_base=base, api_key=key, max_tokens=300, num_retries=0, extra_body=NO_THINKING)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}]
    r = litellm.completion(messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice="required", **common)
    calls = r.choices[0].message.tool_calls or []
    check("litellm required tool call", [c.function.name for c in calls] == ["get_weather"], repr(r.choices[0]))
    r = litellm.completion(messages=[{"role": "user", "content": "A pet"}], response_format=Pet, **common)
    text = r.choices[0].message.content
    try:
        ok = r.choices[0].finish_reason != "stop" or bool(Pet.model_validate_json(text))
    except pydantic.ValidationError:
        ok = False
    check("litellm response_format", ok, repr(text))


def instructor_checks():
    import instructor
    import openai

    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    for mode in [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA]:
        patched = instructor.from_openai(client, mode=mode)
        pet = patched.chat.completions.create(
            model=model, response_model=Pet, max_retries=0, max_tokens=300, messages=[{"role": "user", "content": "A pet"}],
            extra_body=NO_THINKING,
        )
        check(f"instructor {mode.value}", isinstance(pet, Pet), repr(pet))


framework("langchain-openai", langchain)
framework("langgraph", langgraph)
framework("litellm", litellm_checks)
framework("instructor", instructor_checks)
failed = checks.count(False)
print(f"agent-clients: {len(checks) - failed} passed, {failed} failed, {len(skipped)} skipped")
sys.exit(1 if failed else 0)
