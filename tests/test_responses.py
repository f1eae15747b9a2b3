"""The Responses API (serve/_responses.py): the openai SDK's
``client.responses`` (a function tool forced by tool_choice, streamed and
not; text streamed and not; the follow-up that sends only the tool's output
with ``previous_response_id``, continuing the stored response's session, and
a second follow-up on the same response, which forks it), stored responses
per API key, kept across a restart, and the openai-agents SDK's default
(Responses) model running an agent with a function tool; on the tiny
random-weight Qwen3 whose template renders tools (tests/tool_models.py),
through a real server in each of its modes: one process, an engine process,
two front ends over one engine process."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from aoti_sessions.llm import LLM, RemoteLLM
from aoti_sessions.serve import create_app
from conftest import run_async
from serving import async_transport_for, running, running_front_ends, transport_for
from tool_models import tools_package

KEY, OTHER = "responses-key", "responses-other-key"


class Forecast(pydantic.BaseModel):
    sunny: bool

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
INSTRUCTIONS = "You answer questions about the weather."
QUESTION = "What is the weather in Paris for the next 3 days?"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(tools_package(), "cpu", threads=1, max_sessions=32) as m:
        yield m


@pytest.fixture(scope="module", params=["one-process", "engine-process", "two-front-ends"])
def mode(request: pytest.FixtureRequest) -> str:
    """How the server runs (as tests/test_serve.py's modes)."""
    return str(request.param)


@pytest.fixture(scope="module")
def server(mode: str, llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    options: dict[str, Any] = dict(api_keys=[KEY, OTHER], session_dir=tmp_path_factory.mktemp("responses"))
    if mode == "one-process":
        with running(create_app(llm, **options)) as url:
            yield url
        return
    with RemoteLLM(tools_package(), "cpu", threads=1, max_sessions=32) as remote:
        if mode == "two-front-ends":
            with running_front_ends(remote, 2, **options) as url:
                yield url
        else:
            with running(create_app(remote, **options)) as url:
                yield url


def _client(server: str, key: str = KEY) -> openai.OpenAI:
    # No retries: an error must reach the test. Requests alternate front ends where there are two.
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=transport_for(server), timeout=60))


@pytest.fixture
def client(server: str) -> Iterator[openai.OpenAI]:
    with _client(server) as c:
        yield c


def ask(client: openai.OpenAI, llm: LLM, **options: Any) -> Any:
    options.setdefault("instructions", INSTRUCTIONS)
    return client.responses.create(model=llm.name, temperature=0, **options)


def forced_call(client: openai.OpenAI, llm: LLM, **options: Any) -> Any:
    return ask(client, llm, input=QUESTION, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               parallel_tool_calls=False, max_output_tokens=200, **options)


def test_a_forced_function_call_streamed_and_not(client: openai.OpenAI, llm: LLM) -> None:
    """A random-weight model calls the function tool_choice names (the
    grammar holds it), as a function_call item with its call_id; streamed,
    the same call, in the Responses' event sequence."""
    done = forced_call(client, llm)
    assert done.object == "response" and done.status == "completed" and done.error is None, done
    [call] = done.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_"), call
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.tools[0].name == "get_weather" and done.instructions == INSTRUCTIONS and done.store is True

    events = list(forced_call(client, llm, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"], events
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    added, delta, arguments, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.status == "in_progress"
    assert delta.delta == arguments.arguments == call.arguments and delta.item_id == added.item.id
    assert item_done.item.arguments == call.arguments and item_done.item.status == "completed"
    final = completed.response
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", call.arguments)]
    assert final.output[0].call_id == item_done.item.call_id and final.usage.output_tokens == done.usage.output_tokens


def test_text_streamed_and_not(client: openai.OpenAI, llm: LLM) -> None:
    """Free text: one message item with its output_text, the same streamed
    (deltas, then the done events); stopped at max_output_tokens, incomplete."""
    done = ask(client, llm, input="Tell me a story.", max_output_tokens=12, store=False)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens", done
    [message] = done.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and done.output_text == message.content[0].text != ""
    events = list(ask(client, llm, input="Tell me a story.", max_output_tokens=12, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == len(kinds) - 8 and "".join(deltas) == done.output_text
    assert events[-4].text == events[-2].item.content[0].text == done.output_text
    assert events[-1].response.output_text == done.output_text
    with pytest.raises(openai.NotFoundError):  # (store false: nothing kept)
        client.responses.retrieve(done.id)


def _tool_output(call: Any, text: str = "sunny, 21 C") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.call_id, "output": text}


def _in_full(llm: LLM, client: openai.OpenAI, items: list[Any], **options: Any) -> Any:
    """The same turn sent whole (every item, no previous response): the reference."""
    options.setdefault("max_output_tokens", 8)
    return ask(client, llm, input=items, tools=[WEATHER], store=False, **options)


def _as_input(call: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}


def test_follow_ups_continue_and_fork_the_stored_session(client: openai.OpenAI, llm: LLM, server: str) -> None:
    """A follow-up with only the tool's output continues the first
    response's session (its prompt's tokens cached); a second follow-up on
    the same response forks it (cached too); each answers as the whole
    conversation sent afresh does; another key knows none of them."""
    first = forced_call(client, llm)
    [call] = first.output
    follow = ask(client, llm, previous_response_id=first.id, input=[_tool_output(call)], tools=[WEATHER],
                 max_output_tokens=8)
    history = [{"role": "user", "content": QUESTION}, _as_input(call)]
    fresh = _in_full(llm, client, [*history, _tool_output(call)])
    assert fresh.usage.input_tokens_details.cached_tokens == 0
    assert follow.usage.input_tokens == fresh.usage.input_tokens and follow.output_text == fresh.output_text
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2, (follow.usage, first.usage)
    assert follow.previous_response_id == first.id
    # A branch: another answer to the same call, forked from the first response's session.
    branch = ask(client, llm, previous_response_id=first.id, input=[_tool_output(call, "rain")], tools=[WEATHER],
                 max_output_tokens=8)
    assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2, branch.usage
    assert branch.output_text == _in_full(llm, client, [*history, _tool_output(call, "rain")]).output_text
    # The chain goes on from its latest response, in its session.
    user = {"role": "user", "content": "And tomorrow?"}
    third = ask(client, llm, previous_response_id=follow.id, input=[user], tools=[WEATHER], max_output_tokens=8)
    assert third.usage.input_tokens_details.cached_tokens >= follow.usage.input_tokens - 2, third.usage
    reply = [{"role": "assistant", "content": follow.output_text}] if follow.output_text else []
    whole = _in_full(llm, client, [*history, _tool_output(call), *reply, user])
    assert third.output_text == whole.output_text and third.usage.input_tokens == whole.usage.input_tokens
    # Stored, per key.
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    with _client(server, OTHER) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as lost:
            ask(other, llm, previous_response_id=first.id, input="hi", max_output_tokens=2)
        assert lost.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(first.id)
    client.responses.delete(branch.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(branch.id)
    with pytest.raises(openai.NotFoundError):
        ask(client, llm, previous_response_id=branch.id, input="hi", max_output_tokens=2)


def test_concurrent_follow_ups_each_answer_as_alone(client: openai.OpenAI, llm: LLM) -> None:
    """Follow-ups on one response sent at once (one continues its session,
    the others fork it or, while it is busy, start afresh) each answer as
    its whole conversation sent alone does."""
    first = forced_call(client, llm)
    [call] = first.output
    history = [{"role": "user", "content": QUESTION}, _as_input(call)]
    results = [f"{random.Random(seed).choice(['sunny', 'rain', 'snow'])}, {seed} C" for seed in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(results)) as pool:
        together = list(pool.map(lambda text: ask(client, llm, previous_response_id=first.id,
                                                  input=[_tool_output(call, text)], tools=[WEATHER],
                                                  max_output_tokens=6), results))
    alone = [_in_full(llm, client, [*history, _tool_output(call, text)], max_output_tokens=6) for text in results]
    assert [r.output_text for r in together] == [r.output_text for r in alone]
    assert [r.usage.input_tokens for r in together] == [r.usage.input_tokens for r in alone]
    assert max(r.usage.input_tokens_details.cached_tokens for r in together) >= first.usage.input_tokens - 2


def test_stored_responses_outlive_a_restart(llm: LLM, tmp_path: Path) -> None:
    """With a session dir, a stored response and its session are parked
    when the server stops; the next server on that dir follows it up with
    the session's cache."""
    with running(create_app(llm, api_key=KEY, session_dir=tmp_path)) as url, _client(url) as client:
        first = forced_call(client, llm)
    with running(create_app(llm, api_key=KEY, session_dir=tmp_path)) as url, _client(url) as client:
        assert client.responses.retrieve(first.id).output[0].arguments == first.output[0].arguments
        follow = ask(client, llm, previous_response_id=first.id, input=[_tool_output(first.output[0])],
                     tools=[WEATHER], max_output_tokens=4)
        assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2, follow.usage


def test_stored_responses_are_parked_at_their_ttl(llm: LLM, tmp_path: Path) -> None:
    """Unused for the TTL, a stored response leaves memory with its session:
    without a session dir it is gone (404); with one, it and its session
    come back from their files when followed up."""
    for folder in (None, tmp_path):
        with running(create_app(llm, api_key=KEY, session_dir=folder, session_ttl=0.4)) as url, \
                _client(url) as client:
            first = forced_call(client, llm)
            time.sleep(1.5)  # (the sweep runs every quarter TTL)
            if folder is None:
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(first.id)
                continue
            assert not any(s["id"] == first.id for s in client.get("/sessions", cast_to=object)["data"])
            follow = ask(client, llm, previous_response_id=first.id, input=[_tool_output(first.output[0])],
                         tools=[WEATHER], max_output_tokens=4)
            assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2, follow.usage


def test_stored_sessions_make_room_for_other_sessions(tmp_path: Path) -> None:
    """Sessions of stored responses are caches: on a server of 2 sessions,
    one held by a named chat session, each new response (and a stateless
    chat) gets one by parking the least recently used response's (closed
    without a session dir); the chat session stays, and a parked response is
    followed up from its file, with its cache."""
    with LLM(tools_package(), "cpu", threads=1, max_sessions=2) as small:
        for folder in (None, tmp_path):
            with running(create_app(small, api_key=KEY, session_dir=folder)) as url, _client(url) as client:
                chat = [{"role": "user", "content": "Hello"}]
                client.chat.completions.create(model=small.name, messages=chat, max_tokens=2,  # type: ignore[arg-type]
                                               extra_body={"session_id": "mine"})
                first = forced_call(client, small)
                forced_call(client, small)  # (the first's session parked to make room)
                assert client.chat.completions.create(model=small.name, messages=chat,  # type: ignore[arg-type]
                                                      max_tokens=2).choices[0].finish_reason == "length"
                sessions = {s["id"] for s in client.get("/sessions", cast_to=object)["data"]}
                assert sessions == {"mine"}, sessions
                follow = ask(client, small, previous_response_id=first.id, input=[_tool_output(first.output[0])],
                             tools=[WEATHER], max_output_tokens=4)
                cached = follow.usage.input_tokens_details.cached_tokens
                assert cached == 0 if folder is None else cached >= first.usage.input_tokens - 2, follow.usage
                again = client.chat.completions.create(model=small.name, messages=chat, max_tokens=2,  # type: ignore[arg-type]
                                                       extra_body={"session_id": "mine"})
                assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("change, field", [
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "bad name", "arguments": "{}"}]}, "input[0].name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "add"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"previous_response_id": "not an id"}, "previous_response_id"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"modalities": ["text"]}, "modalities"),
])
def test_bad_bodies_are_400s_naming_the_field(server: str, llm: LLM, change: dict[str, Any], field: str) -> None:
    body = {"model": llm.name, "input": QUESTION, "max_output_tokens": 4, **change}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      transport=transport_for(server)) as http:
        response = http.post("/v1/responses", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error" and error["message"], error


def test_an_agent_calls_its_tool_through_the_default_model(server: str, llm: LLM) -> None:
    """The openai-agents SDK's default model (Responses) runs an Agent whose
    tool_choice forces its @function_tool: the tool runs, its output goes
    back to the model, and the run ends with the model's answer; chained by
    previous_response_id, the second call reuses the first's session;
    streamed, the same run."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from agents.items import ToolCallOutputItem

    set_tracing_disabled(True)  # (nothing is sent anywhere but this server)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    # Its answer held to a schema (text.format): a random model's ends (the agent takes an incomplete one as failed).
    agent = Agent(name="weather", instructions=INSTRUCTIONS, model=llm.name, tools=[get_weather], output_type=Forecast,
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200,
                                               parallel_tool_calls=False))

    async def run(chained: bool, streamed: bool) -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60,
                                    http_client=httpx.AsyncClient(transport=async_transport_for(server), timeout=60))
        set_default_openai_client(client, use_for_tracing=False)
        if streamed:
            result = Runner.run_streamed(agent, QUESTION, max_turns=3, auto_previous_response_id=chained)
            kinds = [event.type async for event in result.stream_events()]
            assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        else:
            result = await Runner.run(agent, QUESTION, max_turns=3, auto_previous_response_id=chained)
        await client.close()
        return result

    for chained, streamed in [(False, False), (True, False), (True, True)]:
        before = len(asked)
        result = run_async(run(chained, streamed))
        assert len(asked) == before + 1 and asked[-1] in ("Paris", "Rome")
        outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
        assert outputs == [f"sunny in {asked[-1]}"]
        first, second = result.raw_responses
        answer = "".join(part.text for item in second.output if item.type == "message" for part in item.content)
        assert isinstance(result.final_output, Forecast)
        assert result.final_output == Forecast.model_validate_json(answer)
        assert second.usage.input_tokens > first.usage.input_tokens  # (the call and its output went back)
        if chained:
            assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2
        if (chained, streamed) == (True, False):
            reference = result.final_output
        elif streamed:
            assert result.final_output == reference
