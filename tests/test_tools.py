"""Tool calling (aoti_sessions.llm.runtime._tools and the server's tools fields): the
Hermes / Qwen ``<tool_call>`` format parsed whole and streamed, tools
rendered by the model's own chat template, and tool_choice "required" or
a named function held to calls of the offered tools by the grammar, on an
exported random-weight tiny Qwen3 whose template renders tools
(tests/tool_models.py); through the server with the openai SDK, streamed
and not, with the follow-up turn that carries the tool's result."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from aoti_sessions.llm import LLM, SamplingParams, ToolCall, ToolCallStream, parse_tool_calls, tool_call_constraint
from aoti_sessions.serve import create_app
from llm_models import llm_package
from serving import running
from tool_models import tools_package

KEY = "tools-key"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


# -- the format ---------------------------------------------------------------
REPLY = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
         '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> <tool_call>not json</tool_call>'
         ' <tool_call>{"arguments": {}}</tool_call> a < b <tool_c')


def test_parse_whole_reply() -> None:
    text, calls = parse_tool_calls(REPLY)
    assert calls == [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("add", '{"a": 1, "b": 2}')]
    # Blocks that are not calls stay text, as written; so does a start that never became a call.
    assert text == ("Let me look. \n <tool_call>not json</tool_call> <tool_call>{\"arguments\": {}}</tool_call>"
                    " a < b <tool_c")
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {}}") == (
        "<tool_call>{\"name\": \"f\", \"arguments\": {}}", [])  # never closed: text


@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_random_pieces_equals_whole(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(REPLY)), rng.randint(1, 40)))
    stream = ToolCallStream()
    out: list[Any] = []
    for a, b in zip([0, *cuts], [*cuts, len(REPLY)]):
        out += stream.push(REPLY[a:b])
    out += stream.finish()
    text, calls = parse_tool_calls(REPLY)
    assert "".join(p for p in out if isinstance(p, str)) == text
    assert [p for p in out if isinstance(p, ToolCall)] == calls
    assert stream.calls == 2


# -- the model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(tools_package(), "cpu", threads=1, max_sessions=64) as m:
        yield m


def test_the_template_renders_tools_and_their_results(llm: LLM) -> None:
    assert llm.tool_format == "hermes"
    text = llm.chat_prompt(QUESTION, TOOLS).text
    assert json.dumps(WEATHER) in text and json.dumps(ADD) in text
    assert "get_weather" not in llm.chat_prompt(QUESTION).text
    follow = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
    text = llm.chat_prompt(follow, TOOLS).text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    with pytest.raises(ValueError, match="tools go with chat messages"):
        llm.prepare("plain text", TOOLS)


def test_a_model_whose_template_renders_no_tools_refuses_them() -> None:
    with LLM(llm_package("qwen3", max_cache_len=128), "cpu", threads=1) as plain:
        assert plain.tool_format is None
        with pytest.raises(ValueError, match="renders no tools"):
            plain.chat_prompt(QUESTION, TOOLS)


def check_calls(text: str, only: str | None = None) -> list[ToolCall]:
    rest, calls = parse_tool_calls(text)
    assert calls and not rest.strip(), text
    for call in calls:
        assert only is None or call.name == only
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    return calls


def test_required_and_named_calls_hold_for_a_random_model(llm: LLM) -> None:
    """tool_choice "required" (one call, or several) and a named function:
    every sampled reply is nothing but calls of the offered tools with
    arguments valid against their parameters; batched together with free
    rows, each equals its solo run."""
    prompt = llm.chat_prompt(QUESTION, TOOLS)
    # (The LLM's own format: its markup written as the tokenizer's tokens, <tool_call> one of them here.)
    held = llm.reply_format.tool_constraint
    assert held(TOOLS) == tool_call_constraint(TOOLS, format=llm.reply_format.tools) != tool_call_constraint(TOOLS)
    cases = [(held(TOOLS, parallel=False), None, 1), (held(TOOLS, "add"), "add", None),
             (held(TOOLS, "get_weather", parallel=False), "get_weather", 1)]
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, constraint=c)
              for seed in range(8) for c, _, _ in cases]
    free = [SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i) for i in range(3)]
    alone = []
    for p in [*params, *free]:
        with llm.new_session() as s:
            c = s.generate(prompt, p)
            alone.append((c.text, c.finish_reason))
    sessions = [llm.new_session() for _ in [*params, *free]]
    generations = [s.start(prompt, p) for s, p in zip(sessions, [*params, *free])]
    together = []
    for g in generations:
        for _ in iter(g.step, None):  # (read as it comes)
            pass
        together.append((g.completion().text, g.completion().finish_reason))
    for s in sessions:
        s.close()
    assert together == alone
    ended = 0
    for (text, reason), p in zip(alone, params):
        _, only, count = cases[params.index(p) % len(cases)]
        if reason == "stop":  # (a run of several calls may reach max_tokens)
            calls = check_calls(text, only)
            assert count is None or len(calls) == count
            ended += 1
        else:
            assert count is None, text  # one call always ends
    assert ended >= 2 * len(params) // 3


# -- the server ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[str]:
    with running(create_app(llm, api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def test_tool_calls_through_the_server(client: openai.OpenAI, server: str, llm: LLM) -> None:
    """The openai SDK's tools, tool_choice required and named, streamed and
    not (the same seed: the same calls), then the follow-up turn with the
    tool's result on the same session."""
    def ask(stream: bool, choice: Any, seed: int, messages: list[Any] = QUESTION) -> Any:
        return client.chat.completions.create(model=llm.name, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                              tool_choice=choice, parallel_tool_calls=False, max_tokens=200,
                                              temperature=1.0, seed=seed, stream=stream,
                                              extra_body={"session_id": f"tools-{seed}"})
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "add"}}, "required"]):
        done = ask(False, choice, seed)
        choice0 = done.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, done
        calls = choice0.message.tool_calls
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
        name = calls[0].function.name
        assert name == "add" or not isinstance(choice, dict)
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS[name])
        # Streamed, on a fresh session: the same call in one tool_calls delta.
        with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            http.delete(f"/v1/sessions/tools-{seed}")
        streamed = ask(True, choice, seed)
        deltas, reasons, text = [], [], []
        for chunk in streamed:
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                text.append(c.delta.content or "")
                reasons.append(c.finish_reason)
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
            [(0, name, calls[0].function.arguments)]
        assert "".join(text) == "" and reasons[-1] == "tool_calls"
        # The tool's result goes back: the next turn renders it and answers (free text, no call asked).
        follow = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": deltas[0].id, "type": "function", "function": {"name": name,
                                                                  "arguments": deltas[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": deltas[0].id, "content": "sunny"}]
        again = client.chat.completions.create(model=llm.name, messages=follow, tools=TOOLS,  # type: ignore[arg-type]
                                               max_tokens=8, temperature=0, extra_body={"session_id": f"tools-{seed}"})
        assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("change, field", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
])
def test_bad_tool_requests_are_400s(server: str, llm: LLM, change: dict[str, Any], field: str) -> None:
    body = {"model": llm.name, "messages": QUESTION, "max_tokens": 4, **change}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text
