"""Liveness (issue 34): a closed generation always ends its stream; the
idle-session sweep never parks a session under a request. Real servers over
the tiny Qwen3 package on the CPU, with real engine processes."""

from __future__ import annotations

import json
import queue
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aoti_sessions.errors import SessionClosedError
from aoti_sessions.llm import LLM, RemoteLLM
from aoti_sessions.serve import create_app
from conftest import on_threads
from llm_models import llm_package
from serving import running

CONTEXT = 256
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def package() -> Path:
    return llm_package("qwen3", max_cache_len=CONTEXT)


@pytest.fixture(scope="module")
def llm(package: Path) -> Iterator[LLM]:
    with LLM(package, threads=1, max_sessions=64) as model:
        yield model


@pytest.fixture(scope="module")
def remote(package: Path) -> Iterator[RemoteLLM]:
    with RemoteLLM(package, threads=1, max_sessions=16) as model:
        yield model


def _ends(events: queue.Queue[Any], timeout: float = 30.0) -> list[Any]:
    """A sink's events up to its end (None or an error); fails if none comes."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        event = events.get(timeout=max(0.0, deadline - time.monotonic()))
        seen.append(event)
        if event is None or isinstance(event, BaseException):
            return seen


@pytest.mark.parametrize("kind", ["one-process", "engine-process"])
def test_a_closed_generation_ends_its_sink(kind: str, llm: LLM, remote: RemoteLLM) -> None:
    """Closed before it finished, a generation hands its sink an error as
    its end (a reader waiting on the sink, a server's stream, would wait
    forever); one that finished first has had its end, once; a sink attached
    after the close gets the end too; ``step()`` still says None."""
    model: Any = llm if kind == "one-process" else remote
    with model.new_session() as session:
        g = session.start(USER, max_tokens=CONTEXT - 64, temperature=0, ignore_eos=True)
        events: queue.Queue[Any] = queue.Queue()
        g.on_event(events.put)
        assert isinstance(events.get(timeout=30), str)  # running
        g.close()
        end = _ends(events)[-1]
        assert isinstance(end, SessionClosedError) and "closed before it finished" in str(end), end
        late: queue.Queue[Any] = queue.Queue()
        g.on_event(late.put)
        assert isinstance(_ends(late, 1)[-1], SessionClosedError)
        assert g.step() is None and not session.busy
        done = session.start(USER, max_tokens=3, temperature=0, ignore_eos=True)
        finished: queue.Queue[Any] = queue.Queue()
        done.on_event(finished.put)
        assert _ends(finished)[-1] is None and done.finish_reason == "length"
        done.close()
        time.sleep(0.1)
        assert finished.empty()  # no second end


def _stream(http: httpx.Client, session: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[int, str]:
    """A streamed chat turn: (status, its text), the text checked to end with
    a finish chunk and [DONE]; raises on an error event."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "session_id": session}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, response.text
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-2:]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    return 200, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_the_sweep_never_parks_a_session_under_a_request(llm: LLM, tmp_path: Path) -> None:
    """Sessions idle past a short TTL are parked while clients send streamed
    turns to random sessions of theirs: a sweep that parks one of its list
    after another lets requests in between, and must not park a session one
    of them took (its stream would stall, its turn be lost). Every turn ends
    whole, with the reply the same chat gets alone."""
    sessions, tokens, clients = 48, 16, 6
    prompts = [[{"role": "user", "content": f"Hello number {i}, tell me a story."}] for i in range(sessions)]
    want = []
    for messages in prompts:
        with llm.new_session() as alone:
            want.append(alone.generate(messages, max_tokens=tokens, temperature=0, ignore_eos=True).text)
    app = create_app(llm, session_dir=tmp_path, session_ttl=1.0)
    with running(app) as url:
        problems: list[str] = []
        stop_at = time.monotonic() + 7.0

        def client(worker: int) -> None:
            rng = random.Random(worker)
            mine = list(range(worker, sessions, clients))  # (its own: none of its turns overlap)
            with httpx.Client(base_url=url, timeout=20) as http:
                while time.monotonic() < stop_at:
                    for i in rng.sample(mine, len(mine)):
                        try:
                            status, text = _stream(http, f"s-{i}", prompts[i], tokens)
                        except Exception as e:  # noqa: BLE001 - a stalled stream is a read timeout
                            problems.append(f"s-{i}: {type(e).__name__}: {e}")
                            return
                        # (409: one that came while its session was being parked, in the
                        # milliseconds of its save: the error says to retry.)
                        if status != 409 and (status != 200 or text != want[i]):
                            problems.append(f"s-{i}: {status} {text!r} != {want[i]!r}")
                    # About the TTL: the next round comes while the sweep parks this one's sessions.
                    time.sleep(rng.uniform(0.5, 1.2))

        on_threads(clients, "cpu", client)
        registry = app.state.registry
        assert not problems, problems[:3]
        # (The race ran: sessions were parked and brought back all along.)
        assert registry.expired >= 10 and registry.unparked >= 5, (registry.expired, registry.unparked)
