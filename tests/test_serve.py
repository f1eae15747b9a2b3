"""The OpenAI-compatible server: a real uvicorn server over a real compiled
tiny Qwen3 package (on the CPU, and on a GPU where there is one), driven by
the ``openai`` client and httpx, checked against the eager transformers model."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
import torch
import transformers

import aoti_sessions as ais
from aoti_sessions.errors import EngineProcessError, SessionBusyError, SessionClosedError
from aoti_sessions.llm import LLM, Constraint, RemoteLLM
from aoti_sessions.serve._cli import compute_threads
from aoti_sessions.serve import create_app
from conftest import on_threads
from llm_models import hf_model_dir
from serving import SERVER_CONTEXT, llm, package  # noqa: F401 (llm, package: fixtures)
from serving import metrics, running, running_front_ends, transport_for, wait_until

KEY = "test-key-4f1c"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = SERVER_CONTEXT
TOKENS = 12  # per turn
CONVERSATIONS = {
    "a": ["Hello, how are you today?", "Please tell me a story about a small robot."],
    "b": ["The weather is nice, the sun is shining.", "Numbers like one, two, three appear often."],
}


@pytest.fixture(scope="module", params=["one-process", "engine-process", "two-front-ends"])
def mode(request: pytest.FixtureRequest) -> str:
    """How the server runs: in this process with its LLM, with the LLM in an
    engine process of its own (what the CLI runs), or as two front ends over
    one engine process sharing one registry (serve --api-workers 2), each
    request of a test going to the other front end than the one before.
    Every test of the server holds for all three."""
    return str(request.param)


@pytest.fixture(scope="module")
def served(mode: str, llm: LLM, package: Path, device: str) -> Iterator[LLM | RemoteLLM]:
    """What the server serves: ``llm``, or the same package in an engine process."""
    if mode == "one-process":
        yield llm
        return
    with RemoteLLM(package, device, threads=1, max_sessions=16) as remote:
        yield remote


@pytest.fixture(scope="module")
def server(served: LLM | RemoteLLM, mode: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    session_dir = tmp_path_factory.mktemp("sessions")
    if mode == "two-front-ends":
        with running_front_ends(served, 2, api_key=KEY, session_dir=session_dir) as url:
            yield url
        return
    with running(create_app(served, api_key=KEY, session_dir=session_dir)) as url:
        yield url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers=AUTH, timeout=60, transport=transport_for(server)) as client:
        yield client


@pytest.fixture
def client(server: str) -> Iterator[openai.OpenAI]:
    # No retries: a 409 or 429 must reach the test, not be retried away.
    with httpx.Client(transport=transport_for(server), timeout=60) as transport, \
            openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60, http_client=transport) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> Any:
    """The eager transformers model's greedy chat turn: messages -> text."""
    folder = hf_model_dir("qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    eos = model.generation_config.eos_token_id

    def turn(messages: list[dict[str, str]], max_tokens: int = TOKENS) -> str:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        if eos in out:
            out = out[:out.index(eos)]
        return str(tokenizer.decode(out, skip_special_tokens=True))

    return turn


def chat(client: openai.OpenAI, llm: LLM, messages: list[dict[str, str]], session: str | None = None,
         **kwargs: Any) -> Any:
    extra = {"session_id": session} if session else None
    return client.chat.completions.create(model=llm.name, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=kwargs.pop("max_tokens", TOKENS),
                                          temperature=kwargs.pop("temperature", 0), extra_body=extra, **kwargs)


def converse(client: openai.OpenAI, llm: LLM, turns: list[str], session: str,
             log: list[tuple[str, float]] | None = None) -> list[str]:
    """A conversation's turns on ``session``, each streamed (chunk arrival
    times go to ``log``); every turn resends the whole history, as OpenAI's
    API wants."""
    messages: list[dict[str, str]] = []
    replies = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        stream = chat(client, llm, messages, session, stream=True)
        pieces = []
        for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            if log is not None:
                log.append((session, time.monotonic()))
        replies.append("".join(pieces))
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error body of a response that must have ``status``."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "code"} <= set(error) and error["message"], error
    return dict(error)


def test_models_and_health(client: openai.OpenAI, server: str, llm: LLM) -> None:
    assert [m.id for m in client.models.list()] == [llm.name]
    assert client.models.retrieve(llm.name).id == llm.name
    with httpx.Client(base_url=server) as anonymous:  # /health needs no key
        assert anonymous.get("/health").json() == {"status": "ok"}


def test_interleaved_sessions_match_alone_and_transformers(client: openai.OpenAI, llm: LLM, reference: Any) -> None:
    log: list[tuple[str, float]] = []
    names = sorted(CONVERSATIONS)
    together = on_threads(2, "cpu", lambda i: converse(client, llm, CONVERSATIONS[names[i]], f"mix-{names[i]}", log))
    alone = [converse(client, llm, CONVERSATIONS[n], f"alone-{n}") for n in names]
    assert together == alone
    # The two streams overlapped: chunks of one arrived between chunks of the other.
    order = [s for s, _ in sorted(log, key=lambda e: e[1])]
    first_b, last_a = order.index("mix-b"), len(order) - 1 - order[::-1].index("mix-a")
    assert first_b < last_a, order
    for name, replies in zip(names, together):
        messages: list[dict[str, str]] = []
        for user, reply in zip(CONVERSATIONS[name], replies):
            messages.append({"role": "user", "content": user})
            assert reply == reference(messages), (name, len(messages))
            messages.append({"role": "assistant", "content": reply})


def test_follow_up_turn_prefills_only_new_tokens(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    first = chat(client, llm, messages, "follow-up")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the weather?"}]
    before = metrics(http)
    second = chat(client, llm, messages, "follow-up")
    after = metrics(http)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt is in the cache (and its reply, as far as the
    # template writes it back the same way); only the rest is prefilled.
    assert cached >= first.usage.prompt_tokens
    prefilled = after["aoti_sessions_prefilled_tokens_total"] - before["aoti_sessions_prefilled_tokens_total"]
    assert prefilled == second.usage.prompt_tokens - cached
    assert after["aoti_sessions_cached_prompt_tokens_total"] - before["aoti_sessions_cached_prompt_tokens_total"] \
        == cached
    assert after["aoti_sessions_prompt_tokens_total"] - before["aoti_sessions_prompt_tokens_total"] \
        == second.usage.prompt_tokens
    assert after["aoti_sessions_generated_tokens_total"] - before["aoti_sessions_generated_tokens_total"] \
        == second.usage.completion_tokens


def test_a_reply_sent_back_as_its_text_keeps_the_ids_generated(http: httpx.Client, llm: LLM) -> None:
    """A second turn sent as messages, the first reply as its text (one that
    encodes to other ids than the ones generated), reuses everything the
    session holds (the prompt made here, in the server's process, keeps its
    text: the session, in an engine process too, keeps its own ids for the
    reply) and answers as a fresh session given the same ids."""
    from test_chat_history import FIRST, SEEDS, TOKENS, whole_reply

    s = llm.new_session()  # (the turns as the server gives them: one found here)
    one, seed, messages = whole_reply(llm, s, [FIRST], {"role": "user", "content": "And the weather?"},
                                      itertools.chain([SEEDS["qwen3"]], itertools.count()))
    two = s.generate(messages, max_tokens=TOKENS, temperature=0, ignore_eos=True)
    assert two.cached_tokens == one.prompt_tokens + one.completion_tokens - 1
    with llm.new_session() as fresh:
        expected = fresh.generate(list(s.tokens[:two.prompt_tokens]), max_tokens=TOKENS, temperature=0,
                                  ignore_eos=True)
    s.close()

    def turn(messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
        response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": TOKENS,
                                                           "ignore_eos": True, "session_id": "own-ids", **params})
        assert response.status_code == 200, response.text
        return dict(response.json())

    assert turn([FIRST], temperature=1.5, seed=seed)["choices"][0]["message"]["content"] == one.text
    second = turn(messages, temperature=0)
    assert second["usage"]["prompt_tokens"] == two.prompt_tokens
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == two.cached_tokens
    assert second["choices"][0]["message"]["content"] == expected.text


def test_stream_equals_non_stream(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Once upon a time there was a little robot."}]
    for options in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_p": 0.9}):
        whole = chat(client, llm, messages, max_tokens=20, **options)
        chunks = list(chat(client, llm, messages, max_tokens=20, stream=True,
                           stream_options={"include_usage": True}, **options))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [whole.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    prompt = "The quick brown fox"
    whole_text = client.completions.create(model=llm.name, prompt=prompt, max_tokens=15, temperature=0)
    streamed = client.completions.create(model=llm.name, prompt=prompt, max_tokens=15, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole_text.choices[0].text
    assert whole_text.usage.completion_tokens <= 15


def test_capacity_429_until_a_session_is_deleted(package: Path, device: str) -> None:
    with LLM(package, device, max_sessions=2) as small, running(create_app(small)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client, \
            httpx.Client(base_url=url) as http:
        hello = [{"role": "user", "content": "Hello"}]
        chat(client, small, hello, "one", max_tokens=2)
        chat(client, small, hello, "two", max_tokens=2)
        for session in ("three", None):  # a new named session, and a throwaway one
            with pytest.raises(openai.RateLimitError) as raised:
                chat(client, small, hello, session, max_tokens=2)
            assert raised.value.response.headers["Retry-After"] == "1"
            assert raised.value.body["code"] == "capacity"  # type: ignore[index]
        error_of(http.post("/v1/sessions/two/fork"), 429)
        assert {s["id"] for s in http.get("/v1/sessions").json()["data"]} == {"one", "two"}
        assert http.delete("/v1/sessions/one").json() == {"id": "one", "object": "session.deleted", "deleted": True}
        assert chat(client, small, hello, "three", max_tokens=2).choices[0].finish_reason
        # Without --session-dir, save and load say so.
        assert "--session-dir" in error_of(http.post("/v1/sessions/two/save", json={"name": "x"}), 400)["message"]
        error_of(http.post("/v1/sessions/load", json={"name": "x"}), 400)


def _session_bytes(package: Path, device: str, history: dict[str, list[dict[str, str]]]) -> dict[str, int]:
    """Device bytes each conversation's session holds after its first turn
    (the pages its tokens take), measured on an unbounded server."""
    with LLM(package, device) as probe, running(create_app(probe)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client, \
            httpx.Client(base_url=url) as http:
        pool = probe.engine.pool
        assert pool is not None
        sizes = {}
        for name, messages in history.items():
            chat(client, probe, messages, name)
            tokens = http.get(f"/v1/sessions/{name}").json()["tokens"]
            sizes[name] = -(-tokens // pool["page_size"]) * pool["page_bytes"]
        return sizes


def test_memory_budget_moves_idle_sessions_to_host(package: Path, device: str, reference: Any) -> None:
    history = {name: [{"role": "user", "content": text}]
               for name, text in zip(("e1", "e2", "e3"), (*CONVERSATIONS["a"], CONVERSATIONS["b"][0]))}
    sizes = _session_bytes(package, device, history)
    # Room for all three but a byte: the third one's last page evicts the least recently used.
    with LLM(package, device, memory_budget=sum(sizes.values()) - 1) as small, running(create_app(small)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client, \
            httpx.Client(base_url=url) as http:
        for name, messages in history.items():
            messages.append({"role": "assistant", "content": chat(client, small, messages, name).choices[0]
                             .message.content})
        counts = metrics(http)
        assert counts["aoti_sessions_evictions_total"] >= 1
        assert counts['aoti_sessions_sessions{state="offloaded"}'] == 1
        assert counts['aoti_sessions_sessions{state="resident"}'] == 2
        assert counts["aoti_sessions_session_host_bytes"] == sizes["e1"]
        assert not http.get("/v1/sessions/e1").json()["resident"]  # the least recently used
        # The offloaded conversation comes back and goes on as if it had stayed.
        messages = history["e1"] + [{"role": "user", "content": CONVERSATIONS["b"][1]}]
        second = chat(client, small, messages, "e1")
        assert second.choices[0].message.content == reference(messages)
        assert second.usage.prompt_tokens_details.cached_tokens >= len(small.chat_tokens(history["e1"][:1]))
        assert metrics(http)["aoti_sessions_restores_total"] >= 1


def _long_prompt(client: openai.OpenAI, llm: LLM, max_tokens: int) -> list[dict[str, str]]:
    """A prompt whose greedy reply runs to ``max_tokens`` (a random model may
    otherwise stop early at its end-of-turn token)."""
    for text in CONVERSATIONS["a"] + CONVERSATIONS["b"]:
        messages = [{"role": "user", "content": text}]
        if chat(client, llm, messages, max_tokens=max_tokens).choices[0].finish_reason == "length":
            return messages
    raise AssertionError("every prompt's greedy reply stops early")


def test_disconnect_stops_the_generation(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    max_tokens = CONTEXT - 64
    messages = _long_prompt(client, llm, max_tokens)
    before = metrics(http)
    body = {"model": llm.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "session_id": "hang-up"}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 4:
                break  # leaving the block closes the connection mid-stream
    wait_until(lambda: not http.get("/v1/sessions/hang-up").json()["busy"], what="the generation to stop")
    after = metrics(http)
    assert after["aoti_sessions_cancelled_generations_total"] == before["aoti_sessions_cancelled_generations_total"] + 1
    generated = after["aoti_sessions_generated_tokens_total"] - before["aoti_sessions_generated_tokens_total"]
    # Cut short (how far it got before the server saw the hang-up depends on
    # the machine's load: a loaded 2-core CI machine got past half of it).
    assert 3 <= generated < max_tokens, generated
    tokens = http.get("/v1/sessions/hang-up").json()["tokens"]
    time.sleep(0.2)
    assert http.get("/v1/sessions/hang-up").json()["tokens"] == tokens  # nothing runs on
    # The session serves the next request.
    assert chat(client, llm, messages, "hang-up", max_tokens=2).choices[0].finish_reason
    # Not streaming: a client that gives up waiting stops the generation too.
    before = metrics(http)
    with httpx.Client(base_url=http.base_url, headers=AUTH, timeout=0.05) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/chat/completions", json={**body, "stream": False, "session_id": "gave-up"})
    wait_until(lambda: not http.get("/v1/sessions/gave-up").json()["busy"], what="the generation to stop")
    after = metrics(http)
    assert after["aoti_sessions_cancelled_generations_total"] == before["aoti_sessions_cancelled_generations_total"] + 1
    generated = after["aoti_sessions_generated_tokens_total"] - before["aoti_sessions_generated_tokens_total"]
    # Cut short (on an H100, at about 1 ms a token, after 290-320 of the 448).
    assert generated < max_tokens, generated


def test_busy_session_gets_409(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    messages = _long_prompt(client, llm, CONTEXT - 64)
    stream = chat(client, llm, messages, "busy", max_tokens=CONTEXT - 64, stream=True)
    next(iter(stream))
    with pytest.raises(openai.ConflictError) as raised:
        chat(client, llm, messages, "busy", max_tokens=2)
    assert raised.value.body["code"] == "session_busy"  # type: ignore[index]
    stream.close()
    wait_until(lambda: not http.get("/v1/sessions/busy").json()["busy"], what="the session to be free")
    assert chat(client, llm, messages, "busy", max_tokens=2).choices[0].finish_reason


def test_save_then_load_continues_identically(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Please tell me a story about a small robot."}]
    reply = chat(client, llm, messages, "saved").choices[0].message.content
    saved = http.post("/v1/sessions/saved/save", json={"name": "saved.session"}).json()
    assert saved["object"] == "session.saved" and saved["bytes"] > 0
    loaded = http.post("/v1/sessions/load", json={"name": "saved.session", "session_id": "loaded"}).json()
    assert loaded["id"] == "loaded"
    assert loaded["tokens"] == http.get("/v1/sessions/saved").json()["tokens"]
    error_of(http.post("/v1/sessions/load", json={"name": "saved.session", "session_id": "loaded"}), 409)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "What did the robot paint?"}]
    original, restored = (chat(client, llm, messages, s) for s in ("saved", "loaded"))
    assert restored.choices[0].message.content == original.choices[0].message.content
    assert restored.usage.prompt_tokens_details.cached_tokens == original.usage.prompt_tokens_details.cached_tokens > 0
    # Fork: the copy answers as the original would.
    fork = http.post("/v1/sessions/saved/fork").json()["id"]
    assert http.get(f"/v1/sessions/{fork}").json()["tokens"] == http.get("/v1/sessions/saved").json()["tokens"]
    reset = http.post(f"/v1/sessions/{fork}/reset").json()
    assert reset["tokens"] == 0
    assert http.delete(f"/v1/sessions/{fork}").status_code == 200


BAD_BODIES: list[tuple[str, Any, str | None]] = [  # (what, body or raw bytes, the field named)
    ("malformed JSON", b'{"messages": [', None),
    ("not an object", b"[1, 2]", None),
    ("unknown field", {"bogus": 1}, "bogus"),
    ("max_tokens as a string", {"max_tokens": "5"}, "max_tokens"),
    ("temperature as a string", {"temperature": "hot"}, "temperature"),
    ("stream as a number", {"stream": 1}, "stream"),
    ("messages as a string", {"messages": "hello"}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens"),
    ("zero max_completion_tokens", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("huge max_tokens", {"max_tokens": 10**9}, "max_tokens"),
    ("temperature out of range", {"temperature": 3}, "temperature"),
    ("no choices", {"n": 0}, "n"),
    ("17 choices", {"n": 17}, "n"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("21 top_logprobs", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("logprobs as a number", {"logprobs": 3}, "logprobs"),
    ("a presence penalty past 2", {"presence_penalty": 2.5}, "presence_penalty"),
    ("a frequency penalty below -2", {"frequency_penalty": -3}, "frequency_penalty"),
    ("a repetition penalty of 0", {"repetition_penalty": 0}, "repetition_penalty"),
    ("min_p past 1", {"min_p": 1.5}, "min_p"),
    ("a logit_bias keyed by a word", {"logit_bias": {"hello": 1}}, "logit_bias"),
    ("a logit_bias past 100", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("a logit_bias token outside the vocabulary", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("a negative stop token id", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("seed past 64 bits", {"seed": 2**64}, "seed"),
    ("huge top_k", {"top_k": 2**40}, "top_k"),
    ("17 stop strings", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("an empty stop string", {"stop": ["ok", ""]}, "stop"),
    ("a stop string of 257 characters", {"stop": "x" * 257}, "stop"),
    ("an unknown response_format", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("json_schema without its schema", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("a schema the grammar engine refuses", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ("tools on a model whose template renders none", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("a schema name with a space", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a b", "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
]


def test_bad_requests_get_openai_errors_and_leave_sessions_intact(client: openai.OpenAI, http: httpx.Client,
                                                                  llm: LLM, server: str, reference: Any) -> None:
    messages = [{"role": "user", "content": CONVERSATIONS["b"][0]}]
    reply = chat(client, llm, messages, "intact").choices[0].message.content
    tokens = http.get("/v1/sessions/intact").json()["tokens"]
    good = {"model": llm.name, "messages": messages, "max_tokens": 4, "session_id": "intact"}
    for what, change, field in BAD_BODIES:
        if isinstance(change, bytes):
            response = http.post("/v1/chat/completions", content=change, headers={"Content-Type": "application/json"})
        else:
            response = http.post("/v1/chat/completions", json={**good, **change})
        error = error_of(response, 400)
        assert error["type"] == "invalid_request_error", what
        assert error.get("param") == field, (what, error)
    error = error_of(http.post("/v1/chat/completions", json={**good, "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found"
    too_long = {"model": llm.name, "prompt": list(range(1, CONTEXT + 8)), "max_tokens": 1, "session_id": "intact"}
    assert error_of(http.post("/v1/completions", json=too_long), 400)["param"] == "prompt"
    error_of(http.post("/v1/completions", json={**too_long, "prompt": [llm.spec.vocab_size]}), 400)
    error_of(http.post("/v1/chat/completions", json=good, headers={"X-Session-ID": "../etc"}), 400)
    error_of(http.post("/v1/chat/completions", json=good, headers={"X-Session-ID": "other"}), 400)
    error_of(http.post("/v1/chat/completions", json={**good, "session_id": "no/slash"}), 400)
    # Unknown sessions: 404 wherever one must exist.
    for method, path, body in (("GET", "/v1/sessions/nobody", None), ("DELETE", "/v1/sessions/nobody", None),
                               ("POST", "/v1/sessions/nobody/reset", None), ("POST", "/v1/sessions/nobody/fork", None),
                               ("POST", "/v1/sessions/nobody/save", {"name": "nobody"})):
        assert error_of(http.request(method, path, json=body), 404)["code"] == "session_not_found"
    # File names: nothing but a plain name inside --session-dir.
    for name in ("../escape", "/etc/passwd", "a/b", "a\\b", ".hidden", "..", ".", "", "a\x00b", "-rf", "x" * 300):
        assert error_of(http.post("/v1/sessions/intact/save", json={"name": name}), 400)["param"] == "name"
        assert error_of(http.post("/v1/sessions/load", json={"name": name}), 400)["param"] == "name"
    assert error_of(http.post("/v1/sessions/load", json={"name": "missing.session"}), 404)["code"] == "file_not_found"
    error_of(http.post("/v1/sessions/intact/save", json={"name": "x", "path": "/tmp/x"}), 400)
    # Keys: missing or wrong is a 401 everywhere but /health.
    with httpx.Client(base_url=server) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("GET", "/v1/sessions/intact"), ("DELETE", "/v1/sessions/intact")):
                response = anonymous.request(method, path, headers=headers, json=good if method == "POST" else None)
                assert error_of(response, 401)["code"] == "invalid_api_key"
        assert anonymous.get("/health").status_code == 200
    with openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            chat(stranger, llm, messages, "intact")
    assert error_of(http.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"
    assert error_of(http.get("/v1/nothing"), 404)["code"] == "not_found"
    # None of it touched the session: the conversation goes on as it would have.
    assert http.get("/v1/sessions/intact").json()["tokens"] == tokens
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": CONVERSATIONS["b"][1]}]
    assert chat(client, llm, messages, "intact").choices[0].message.content == reference(messages)
    counts = metrics(http)
    assert counts['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="401"}'] >= 3
    assert counts['aoti_sessions_requests_total{endpoint="/v1/sessions/{session_id}",status="404"}'] >= 2
    assert counts['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= len(BAD_BODIES)


def test_metrics_show_sessions_and_latencies(http: httpx.Client, client: openai.OpenAI, llm: LLM,
                                            served: LLM | RemoteLLM) -> None:
    chat(client, llm, [{"role": "user", "content": "Hello"}], "metered", max_tokens=4)
    counts = metrics(http)
    stats = served.stats()
    assert counts['aoti_sessions_sessions{state="resident"}'] == stats["resident_sessions"]
    assert counts['aoti_sessions_sessions{state="offloaded"}'] == stats["offloaded_sessions"]
    assert counts["aoti_sessions_named_sessions"] == len(http.get("/v1/sessions").json()["data"])
    assert counts["aoti_sessions_throwaway_sessions"] == 0  # closed when their requests ended
    assert counts["aoti_sessions_time_to_first_token_seconds_count"] >= 1
    assert counts["aoti_sessions_inter_token_latency_seconds_count"] >= 3
    assert counts['aoti_sessions_time_to_first_token_seconds_bucket{le="+Inf"}'] \
        == counts["aoti_sessions_time_to_first_token_seconds_count"]
    # The time to first token's second part, once per first token (the first
    # part once per started generation, some of which ended before a token).
    ttft = counts["aoti_sessions_time_to_first_token_seconds_count"]
    assert counts["aoti_sessions_start_to_first_token_seconds_count"] == ttft
    assert counts["aoti_sessions_time_to_start_seconds_count"] >= ttft
    assert 0 < counts["aoti_sessions_start_to_first_token_seconds_sum"] \
        < counts["aoti_sessions_time_to_first_token_seconds_sum"]
    assert counts["aoti_sessions_session_device_bytes"] == stats["device_bytes"] > 0
    assert "aoti_sessions_evictions_total" in counts
    # The step loop's: every generated token came from a step's decode row or
    # a prefill's last chunk; its time split by phase.
    assert counts["aoti_sessions_steps_total"] >= 4
    assert counts["aoti_sessions_decode_rows_total"] >= 3
    assert counts["aoti_sessions_prefill_rows_total"] >= counts["aoti_sessions_prefill_calls_total"] >= 1
    phases = [counts[f'aoti_sessions_step_seconds_total{{phase="{p}"}}'] for p in ("wait", "queue", "text")]
    assert all(x >= 0 for x in phases) and phases[1] > 0
    assert 0 < counts["aoti_sessions_step_engine_seconds_total"] <= phases[1]  # (a part of queueing)
    assert 0 < counts["aoti_sessions_step_queue_cpu_seconds_total"]
    assert 0 < counts["aoti_sessions_batch_seconds_total"]
    # The engine's graphs, as Engine.stats counts them (read after the scrape: no fewer).
    assert 0 <= counts["aoti_sessions_graph_captures_total"] <= stats["graph_captures"]
    assert 0 <= counts["aoti_sessions_graph_replays_total"] <= stats["graph_replays"]


def test_cli_serves_and_import_needs_no_fastapi(package: Path, device: str, tmp_path: Path) -> None:
    # `import aoti_sessions` (and the serve package) leave FastAPI unloaded.
    probe = "import sys, aoti_sessions, aoti_sessions.serve; print('fastapi' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
    # Without FastAPI the command says what to install.
    blocked = ("import sys; sys.modules['fastapi'] = None; from aoti_sessions.__main__ import main; "
               f"sys.exit(main(['serve', {str(package)!r}]))")
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert result.returncode == 2 and "aoti-sessions[serve]" in result.stderr, result.stderr
    # The real command: a server on a free port, with a key, stopped with
    # Ctrl+C (SIGINT to its process group: the engine process too), then
    # with SIGTERM; the sessions it held are served on by the next start.
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "session_id": "cli",
            "temperature": 0}
    log = tmp_path / "first.log"
    with _cli_server(package, device, tmp_path, "first", signal.SIGINT, "--stats-interval", "0.5",
                     "--served-model-name", "cli-model", "--allowed-origins", "https://app.example") as http:
        reply = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "cli-req-1"}).json()
        assert reply["usage"]["completion_tokens"] <= 3 and reply["session_id"] == "cli"
        assert reply["model"] == "cli-model"
        assert http.post("/v1/sessions/cli/save", json={"name": "cli"}).status_code == 200
        assert (tmp_path / "sessions" / "cli").is_file()
        assert http.get("/v1/models", headers={"Authorization": "Bearer no"}).status_code == 401
        made = http.get("/v1/models", headers={"X-Request-Id": "bad id 7q"}).headers["x-request-id"]
        assert http.options("/v1/models", headers={"Origin": "https://app.example", "Authorization": "",
                                                   "Access-Control-Request-Method": "GET"}).status_code == 200
        # Each line with its time and level; a request's with its id (the one it sent, or one made for it).
        stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
        wait_until(lambda: re.search(stamp + r"INFO aoti_sessions\.serve: stats: [1-9]\d* requests", log.read_text(),
                                     re.M), what="a stats line")
        wait_until(lambda: re.search(stamp + rf'INFO uvicorn\.access \[{made}\]: \S+ - "GET /v1/models HTTP/1\.1" 200',
                                     log.read_text(), re.M), what="the access line")
    started = log.read_text()
    assert re.search(stamp + r'INFO uvicorn\.access \[cli-req-1\]: \S+ - "POST /v1/chat/completions HTTP/1\.1" 200',
                     started, re.M), started
    assert "bad id 7q" not in started and "[" + made + "]" in started
    assert f" on {device}" in started and ", 1 CPU thread for its kernels" in started, started
    assert "limits: sessions 3, session state 0.1 GiB" in started, started
    assert "sampling defaults from the package's generation config (a request's own values take precedence): " \
           "greedy (do_sample is not set)\n" in started, started
    assert "parked 1 sessions in" in started and (tmp_path / "sessions" / ".live" / "cli").is_file(), started
    follow = {**body, "messages": [*body["messages"], reply["choices"][0]["message"], {"role": "user", "content": "Go on"}]}
    with _cli_server(package, device, tmp_path, "second", signal.SIGTERM) as http:
        again = http.post("/v1/chat/completions", json=follow).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
    assert "parked 1 sessions in" in (tmp_path / "second.log").read_text()


@contextlib.contextmanager
def _cli_server(package: Path, device: str, tmp_path: Path, name: str, stop: int,
                *extra: str) -> Iterator[httpx.Client]:
    """``aoti-sessions serve`` on a free port (log: NAME.log; ``extra``: more
    of its options), stopped with ``stop`` sent to its process group."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AOTI_SESSIONS_API_KEY": KEY}
    with (tmp_path / f"{name}.log").open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port),
                                    "--device", device, "--max-sessions", "3", "--memory-budget", "64MiB",
                                    "--session-dir", str(tmp_path / "sessions"), "--threads", "1", *extra],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=60) as http:
                def up() -> bool:
                    assert process.poll() is None, (tmp_path / f"{name}.log").read_text()
                    try:
                        return http.get("/health").status_code == 200
                    except httpx.TransportError:
                        return False
                wait_until(up, timeout=120, what="the server to start")
                yield http
        finally:
            os.killpg(process.pid, stop)
            assert process.wait(60) is not None


def test_cli_threads_default_and_refusals() -> None:
    """On a CPU device the model's kernels leave one CPU to the server (at
    least one thread); on CUDA torch's default stays; 0 threads is refused."""
    cpus = len(os.sched_getaffinity(0))
    assert compute_threads(None, "cpu") == max(1, cpus - 1)
    assert compute_threads(None, "cuda:0") is None
    assert compute_threads(3, "cpu") == 3 and compute_threads(2, "cuda") == 2
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", "x.pt2", "--threads", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--threads: must be at least 1, got 0" in result.stderr, result.stderr


def test_cli_refuses_a_model_folder_and_a_taken_port_before_loading(package: Path) -> None:
    """serve given what export takes (a saved transformers folder, a hub id)
    says the export command that makes a package of it; given a taken port it
    says so before the model loads (no line of the loaded model, at once);
    --version says what runs."""
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", *args], capture_output=True, text=True,
                              timeout=120)

    folder = hf_model_dir("qwen3")
    result = serve(str(folder))
    assert result.returncode == 2, result.stderr
    assert f"{folder} is a saved transformers model" in result.stderr
    assert f"aoti-sessions export {folder} -o model.pt2" in result.stderr
    result = serve("Qwen/Qwen3-0.6B")
    assert result.returncode == 2 and "aoti-sessions export Qwen/Qwen3-0.6B -o model.pt2" in result.stderr, result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(str(package), "--port", str(port), "--no-engine-process")
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "give another --port" in result.stderr
    assert " on cpu" not in result.stderr and "limits:" not in result.stderr  # (the model was never loaded)
    version = subprocess.run([sys.executable, "-m", "aoti_sessions", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith(f"aoti-sessions {ais.__version__} ("), version.stdout
    assert f"torch {torch.__version__}" in version.stdout


def test_engine_process_failures_are_clean(package: Path, device: str, tmp_path: Path) -> None:
    """A package the engine process cannot load raises its error here; an
    engine process that dies ends the streams in flight with an error event,
    answers 503 to later requests and says so on /health, and closing the
    RemoteLLM after that is quiet."""
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a package")
    with pytest.raises(Exception, match="bad.pt2") as raised:
        RemoteLLM(bad, device)
    assert type(raised.value).__module__.startswith("aoti_sessions")
    remote = RemoteLLM(package, device, threads=1)
    try:
        with running(create_app(remote)) as url, httpx.Client(base_url=url, timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": CONTEXT - 64,
                    "temperature": 0, "ignore_eos": True, "stream": True, "session_id": "doomed"}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                os.kill(remote.pid or 0, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest and "engine process ended" in rest[-1] and rest[-1] != "data: [DONE]", rest[-3:]
            assert http.get("/health").status_code == 503 and not remote.alive
            assert metrics(http)["aoti_sessions_engine_up"] == 0  # /metrics answers all the same
            again = http.post("/v1/chat/completions", json={**body, "stream": False, "session_id": "after"})
            assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable", again.text
    finally:
        remote.close()
    with pytest.raises(EngineProcessError):
        remote.new_session()


def test_remote_llm_matches_llm_and_refuses_cleanly(package: Path, device: str, llm: LLM) -> None:
    """RemoteLLM's sessions give an LLM's text and counts; a busy session and a
    closed LLM are refused with the runtime's own errors."""
    prompt = [{"role": "user", "content": "Tell me about the sea."}]
    with llm.new_session() as local:
        want = local.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    remote = RemoteLLM(package, device, threads=1)
    with remote:
        # Busy while a generation runs: one long enough that it cannot end
        # before the second start (12 tokens can, on a loaded machine).
        busy = remote.new_session()
        long = busy.start(prompt, max_tokens=CONTEXT - 64, ignore_eos=True)
        with pytest.raises(SessionBusyError):
            busy.start(prompt, max_tokens=1)
        long.close()
        assert not busy.busy
        busy.close()
        session = remote.new_session()
        g = session.start(prompt, max_tokens=12, temperature=0, ignore_eos=True)
        pieces = []
        while (piece := g.step()) is not None:
            pieces.append(piece)
        assert "".join(pieces) == want.text and g.finish_reason == want.finish_reason == "length"
        assert (g.prompt_tokens, g.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
        assert session.token_count == want.prompt_tokens + want.completion_tokens - 1
        child = session.fork()
        assert child.token_count == session.token_count and remote.stats()["live_sessions"] == 2
        with pytest.raises(ValueError, match="token ids must be ints"):
            child.start([10**9])
        running_on = child.start("More", max_tokens=CONTEXT - 64, ignore_eos=True)
    with pytest.raises(SessionClosedError):  # ended by the close, like an LLM's
        while running_on.step() is not None:
            pass
    with pytest.raises(SessionClosedError, match="closed"):
        remote.new_session()


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


def test_structured_output_holds_to_the_schema(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    """response_format through the server: the openai SDK's ``.parse()`` with a
    Pydantic model, a streamed json_schema and json_object, sampled from the
    random-weight model: every reply is JSON valid against its schema."""
    messages = [{"role": "user", "content": "Who is it? Reply in JSON."}]
    for seed in range(3):
        done = client.chat.completions.parse(model=llm.name, messages=messages,  # type: ignore[arg-type]
                                             response_format=Person, max_tokens=60, temperature=1.0, seed=seed)
        person = done.choices[0].message.parsed
        assert isinstance(person, Person) and done.choices[0].finish_reason == "stop", done
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=llm.name, messages=messages, max_tokens=60, temperature=1.0, seed=7, stream=True,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)
    body = {"model": llm.name, "messages": messages, "max_tokens": 60, "temperature": 1.0,
            "response_format": {"type": "json_object"}}
    # Any object: its strings are unbounded (this model's run past 60 tokens), so the reply is held
    # to what the LLM itself generates with the same constraint and seed (tests/test_grammar.py checks
    # that such replies which end are objects).
    for seed in range(2):
        reply = http.post("/v1/chat/completions", json={**body, "seed": seed}).json()["choices"][0]
        with llm.new_session() as s:
            want = s.generate(llm.chat_tokens(messages), max_tokens=60, temperature=1.0, seed=seed,
                              constraint=Constraint.json_object())
        assert reply["message"]["content"] == want.text and reply["message"]["content"].startswith("{"), reply
        assert reply["finish_reason"] == want.finish_reason


def test_logprobs_sampling_fields_and_choices(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    """Logprobs in the openai SDK's own types (chat and completions, streamed
    and not), equal to the LLM's own, each token's bytes its text's; the
    penalties, min_p, logit_bias and stop_token_ids as the LLM runs them; n
    choices (forks of the prompt's session) that differ when sampling and
    each equal their solo runs with seed + index, greedy ones equal, the
    prompt counted once, no session left open, a named session keeping the
    first choice."""
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    with llm.new_session() as s:
        want = s.generate(messages, max_tokens=6, temperature=0, logprobs=3)
    assert want.logprobs is not None
    done = chat(client, llm, messages, max_tokens=6, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert all(isinstance(c, openai.types.chat.ChatCompletionTokenLogprob) for c in content)
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
        [v for e in want.logprobs for _, v in e.top], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.token == bytes(c.bytes).decode(errors="replace") for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode(errors="replace") == done.choices[0].message.content
    stream = chat(client, llm, messages, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    # (Its prompt comes from the prefix cache, the first request's: fed from another chunking, its
    # logits equal to float rounding.)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)

    prompt = "The quick brown fox"
    with llm.new_session() as s:
        text_want = s.generate(prompt, max_tokens=6, temperature=0, logprobs=2)
    assert text_want.logprobs is not None
    completion = client.completions.create(model=llm.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in text_want.logprobs], abs=1e-5)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert all(t in top and 2 <= len(top) <= 3 for t, top in zip(logprobs.tokens, logprobs.top_logprobs))
    pieces = list(client.completions.create(model=llm.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    assert [t for p in pieces if p.choices and p.choices[0].logprobs for t in p.choices[0].logprobs.tokens or []] \
        == logprobs.tokens
    assert [o for p in pieces if p.choices and p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset or []] \
        == logprobs.text_offset

    # The sampling fields, as the LLM runs them; a stop token id ends the reply before it.
    fields = {"min_p": 0.05, "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3,
              "logit_bias": {str(want.token_ids[1]): 4.0, "7": -100}}
    reply = http.post("/v1/chat/completions", json={"model": llm.name, "messages": messages, "max_tokens": 8,
                                                    "temperature": 0.9, "seed": 3, **fields}).json()
    with llm.new_session() as s:
        same = s.generate(messages, max_tokens=8, temperature=0.9, seed=3, **{
            **fields, "logit_bias": {int(k): v for k, v in fields["logit_bias"].items()}})
    assert reply["choices"][0]["message"]["content"] == same.text, reply
    stopped = http.post("/v1/chat/completions", json={"model": llm.name, "messages": messages, "max_tokens": 8,
                                                      "temperature": 0, "stop_token_ids": [want.token_ids[2]]}).json()
    assert stopped["usage"]["completion_tokens"] == 2 and stopped["choices"][0]["finish_reason"] == "stop", stopped

    # n choices.
    def resident() -> float:  # (the prefix cache's kept sessions aside: the stateless requests')
        counts = metrics(http)
        return sum(v for k, v in counts.items() if k.startswith("aoti_sessions_sessions{")) \
            - counts["aoti_sessions_prefix_cache_entries"]

    open_before = resident()
    sampled = chat(client, llm, messages, n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1, texts
    solos = [chat(client, llm, messages, temperature=1.0, seed=11 + i, max_tokens=8) for i in range(3)]
    assert texts == [solo.choices[0].message.content for solo in solos]
    assert sampled.usage.prompt_tokens == solos[0].usage.prompt_tokens
    assert sampled.usage.completion_tokens == sum(solo.usage.completion_tokens for solo in solos)
    greedy = chat(client, llm, messages, n=2, max_tokens=8)
    one = chat(client, llm, messages, max_tokens=8).choices[0].message.content
    assert greedy.choices[0].message.content == greedy.choices[1].message.content == one
    stream = chat(client, llm, messages, n=2, temperature=1.0, seed=11, max_tokens=8, stream=True)
    by_index: dict[int, list[str]] = {0: [], 1: []}
    finished: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            by_index[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert ["".join(by_index[i]) for i in (0, 1)] == texts[:2] and set(finished) == {0, 1}
    named = chat(client, llm, messages, "choices", n=2, temperature=1.0, seed=11, max_tokens=8)
    alone = chat(client, llm, messages, "one-choice", temperature=1.0, seed=11, max_tokens=8)
    assert named.choices[0].message.content == alone.choices[0].message.content
    assert http.get("/v1/sessions/choices").json()["tokens"] == http.get("/v1/sessions/one-choice").json()["tokens"]
    wait_until(lambda: resident() == open_before + 2, what="the forks to close")  # (the two named sessions)
