"""Agents over HTTP: a reasoning model's ``reasoning_content`` (whole and as
``delta.reasoning_content``, never in ``content``), tool calls read after
the reasoning, ``tool_choice`` required and ``response_format`` held after
it, ``chat_template_kwargs`` / ``reasoning_effort`` given to the template,
incoming ``reasoning_content`` accepted, and GPT-OSS's harmony format; each
server the one tools package (tool_models.py) with another family's chat
template (LLM(chat_template=...)), in this process, in an engine process,
and as two front ends over one (the template and formats travel to them);
and the command line's ``--chat-template`` and parsers."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

import chat_templates as templates
from aoti_sessions.llm import LLM, RemoteLLM
from aoti_sessions.serve import create_app
from serving import running, running_front_ends, transport_for
from test_serve import _cli_server
from test_tools import ADD, PARAMETERS, QUESTION, TOOLS
from tool_models import tools_package

KEY = "agents-key"
templates.harmony_vocabulary()


@contextmanager
def server_of(template: str, mode: str) -> Iterator[str]:
    """The tools package with ``template``, served in ``mode``."""
    package = tools_package()
    if mode == "one-process":
        with LLM(package, "cpu", threads=1, max_sessions=16, chat_template=template) as llm, \
                running(create_app(llm, api_key=KEY)) as url:
            yield url
        return
    with RemoteLLM(package, "cpu", threads=1, max_sessions=16, chat_template=template) as remote:
        if mode == "two-front-ends":
            with running_front_ends(remote, 2, api_key=KEY) as url:
                yield url
            return
        with running(create_app(remote, api_key=KEY)) as url:
            yield url


@pytest.fixture(scope="module", params=["one-process", "engine-process", "two-front-ends"])
def r1(request: pytest.FixtureRequest) -> Iterator[str]:
    """A thinking model's server (its generation prompt opens <think>; Hermes tool calls)."""
    with server_of(templates.R1, request.param) as url:
        yield url


@pytest.fixture(scope="module", params=["one-process", "engine-process", "two-front-ends"])
def harmony(request: pytest.FixtureRequest) -> Iterator[str]:
    """GPT-OSS's format (its markup special tokens, kept in the text: by the
    engine process, or with front ends by each front end)."""
    with server_of(templates.HARMONY, request.param) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=transport_for(url), timeout=60))


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      transport=transport_for(url)) as http:
        return http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8, **body})


def both_ways(url: str, **request: Any) -> tuple[Any, dict[str, Any]]:
    """The reply whole, and streamed (on a session of its own: the same
    tokens) as its content, reasoning, calls and finish reason."""
    with client(url) as c:
        whole = c.chat.completions.create(model="tiny-qwen3-tools", messages=QUESTION, **request)
        streamed: dict[str, Any] = {"content": "", "reasoning": "", "calls": [], "finish": None}
        for chunk in c.chat.completions.create(model="tiny-qwen3-tools", messages=QUESTION, stream=True, **request):
            for choice in chunk.choices:
                delta = choice.delta
                streamed["content"] += delta.content or ""
                streamed["reasoning"] += getattr(delta, "reasoning_content", None) or ""
                streamed["calls"] += [(d.index, d.function.name, d.function.arguments) for d in delta.tool_calls or []]
                streamed["finish"] = choice.finish_reason or streamed["finish"]
    return whole, streamed


def test_reasoning_comes_apart_from_the_answer(r1: str) -> None:
    """The reply starts inside the reasoning its prompt opened: the reasoning
    is reasoning_content (streamed as reasoning_content deltas, the same
    text), never content; with enable_thinking off there is none."""
    for seed in range(4):
        whole, streamed = both_ways(r1, max_tokens=40, temperature=1.0, seed=seed)
        message = whole.choices[0].message
        reasoning = getattr(message, "reasoning_content", None)
        assert reasoning and "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
        assert (streamed["reasoning"], streamed["content"]) == (reasoning, message.content or "")
    with client(r1) as c:
        off = c.chat.completions.create(model="tiny-qwen3-tools", messages=QUESTION, max_tokens=12, temperature=1.0,
                                        seed=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        none = c.chat.completions.create(model="tiny-qwen3-tools", messages=QUESTION, max_tokens=12, temperature=1.0,
                                         seed=0, reasoning_effort="none")  # (turns thinking off here too)
    for reply in (off, none):
        assert getattr(reply.choices[0].message, "reasoning_content", "x") is None and reply.choices[0].message.content
    assert off.usage is not None and none.usage is not None and off.usage.prompt_tokens == none.usage.prompt_tokens


def test_required_calls_and_schemas_are_held_after_the_reasoning(r1: str) -> None:
    """tool_choice required and a json_schema, on a model that reasons
    first: the reasoning comes back as reasoning, then valid calls (streamed
    the same) or valid JSON."""
    called = answered = 0
    for seed in (3, 4, 10):  # (the random model closes its reasoning in time for some seeds: 4 and 10 here)
        whole, streamed = both_ways(r1, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                    max_tokens=120, temperature=1.0, seed=seed)
        choice = whole.choices[0]
        assert getattr(choice.message, "reasoning_content", None), choice
        calls = [(i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls or [])]
        assert streamed["calls"] == calls and streamed["finish"] == choice.finish_reason
        if choice.finish_reason == "tool_calls":
            called += 1
            assert len(calls) == 1 and choice.message.content is None
            jsonschema.validate(json.loads(calls[0][2]), PARAMETERS[calls[0][1]])
        else:
            assert choice.finish_reason == "length" and not calls  # (still reasoning)
    schema = ADD["function"]["parameters"]
    with client(r1) as c:
        for seed in (0, 1, 4):  # (0 and 4 close it in time)
            done = c.chat.completions.create(
                model="tiny-qwen3-tools", messages=QUESTION, max_tokens=120, temperature=1.0, seed=seed,
                response_format={"type": "json_schema", "json_schema": {"name": "add", "schema": schema}})
            if done.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(done.choices[0].message.content or ""), schema)
                answered += 1
            else:
                assert not done.choices[0].message.content  # (still reasoning)
    assert called >= 1 and answered >= 1


def test_an_assistant_turn_comes_back_with_its_reasoning(r1: str) -> None:
    with client(r1) as c:
        first = c.chat.completions.create(model="tiny-qwen3-tools", messages=QUESTION, max_tokens=16, temperature=0,
                                          extra_body={"session_id": "agents-follow"})
        message = first.choices[0].message
        follow = [*QUESTION, {"role": "assistant", "content": message.content or "",
                              "reasoning_content": getattr(message, "reasoning_content", None) or ""},
                  {"role": "user", "content": "And tomorrow?"}]
        again = c.chat.completions.create(model="tiny-qwen3-tools", messages=follow,  # type: ignore[arg-type]
                                          max_tokens=4, temperature=0, extra_body={"session_id": "agents-follow"})
    assert again.choices[0].finish_reason in ("stop", "length")
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("change, field", [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "Hi", "reasoning_content": "hm"}]}, "messages[0]"),
])
def test_bad_reasoning_requests_are_400s(r1: str, change: dict[str, Any], field: str) -> None:
    response = post(r1, change)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


def test_harmony_calls_reasoning_and_effort(harmony: str) -> None:
    """GPT-OSS's format: a required call comes back on its own (streamed the
    same), whatever reasoning came first as reasoning_content; a reply that
    is not harmony at all is its content; reasoning_effort reaches the
    template (its system message says it)."""
    called = 0
    for seed in range(3):
        whole, streamed = both_ways(harmony, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=1.0,
                                    seed=seed)
        choice = whole.choices[0]
        calls = [(i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls or [])]
        assert streamed["calls"] == calls and streamed["finish"] == choice.finish_reason
        assert streamed["reasoning"] == (getattr(choice.message, "reasoning_content", None) or "")
        if choice.finish_reason == "tool_calls":
            called += 1
            assert len(calls) == 1 and "<|" not in (choice.message.content or "")
            jsonschema.validate(json.loads(calls[0][2]), PARAMETERS[calls[0][1]])
    assert called >= 1
    free, streamed = both_ways(harmony, max_tokens=12, temperature=1.0, seed=0)
    assert streamed["content"] == (free.choices[0].message.content or "")
    tokens = []
    for effort in ("minimal", "high"):
        response = post(harmony, {"reasoning_effort": effort})
        assert response.status_code == 200, response.text
        tokens.append(response.json()["usage"]["prompt_tokens"])
    assert tokens[0] != tokens[1]


def test_cli_chat_template_and_parsers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``aoti-sessions serve --chat-template FILE --reasoning-parser NAME``:
    the reasoning comes back apart; a template that cannot render, a parser
    unknown, a file missing: exit status 2 at start, saying why. (In one
    process: the engine process and front ends take the same options, the
    fixtures above.)"""
    from aoti_sessions.__main__ import main

    package = tools_package()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    for flags, said in ([["--chat-template", str(bad)], "chat_template: cannot render a user's message"],
                        [["--chat-template", str(tmp_path / "none.jinja")], "--chat-template: [Errno 2]"],
                        [["--tool-call-parser", "nope"], "tool_parser: unknown format 'nope'"]):
        with pytest.raises(SystemExit) as stopped:
            main(["serve", str(package), "--no-engine-process", *flags])
        assert stopped.value.code == 2 and said in capsys.readouterr().err
    template = tmp_path / "r1.jinja"
    template.write_text(templates.R1)
    with _cli_server(package, "cpu", tmp_path, "serve", signal.SIGTERM, "--no-engine-process", "--chat-template",
                     str(template), "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes") as http:
        reply = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 6}).json()
        assert reply["choices"][0]["message"]["reasoning_content"], reply
