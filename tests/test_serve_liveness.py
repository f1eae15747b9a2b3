"""Liveness (issue 34, items 2 and 3): a closed generation always ends its
stream; the idle-session sweep never parks a session under a request; an
engine process that stops answering fails requests within its deadline and
says so on ``/health`` (and comes back when it answers again); one that dies
stops the server with status 1. Real servers over the tiny Qwen3 package on
the CPU, with real engine processes."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from aoti_sessions.errors import SessionClosedError
from aoti_sessions.llm import LLM, RemoteLLM
from conftest import on_threads
from llm_models import llm_package
from serving import FRONT_ENDS, client, descendants, metrics, open_served, serving, wait_until

CONTEXT = 256
ENGINE_TIMEOUT = 3.0  # the test engine process's: short, with room for a loaded machine's pauses
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def package() -> Path:
    return llm_package("qwen3", max_cache_len=CONTEXT)


@pytest.fixture(scope="module")
def llm(package: Path) -> Iterator[LLM]:
    with LLM(package, threads=1, max_sessions=64) as model:
        yield model


@pytest.fixture(scope="module")
def served(package: Path, llm: LLM) -> Iterator[LLM | RemoteLLM]:
    """What the servers of the tests below serve: ``llm``, or (FRONT_ENDS >
    1, tests/serving.py) the package in an engine process, for front ends."""
    if FRONT_ENDS == 1:
        yield llm
        return
    with open_served(package, max_sessions=64) as model:
        yield model


@pytest.fixture(scope="module")
def remote(package: Path) -> Iterator[RemoteLLM]:
    with RemoteLLM(package, threads=1, max_sessions=16, engine_timeout=ENGINE_TIMEOUT) as model:
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


def test_the_sweep_never_parks_a_session_under_a_request(llm: LLM, served: LLM | RemoteLLM, tmp_path: Path) -> None:
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
    with serving(served, session_dir=tmp_path, session_ttl=1.0) as url:
        problems: list[str] = []
        stop_at = time.monotonic() + 7.0

        def chats(worker: int) -> None:
            rng = random.Random(worker)
            mine = list(range(worker, sessions, clients))  # (its own: none of its turns overlap)
            with client(url, timeout=20) as http:
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

        on_threads(clients, "cpu", chats)
        assert not problems, problems[:3]
        # (The race ran: sessions were parked and brought back all along.)
        with client(url, timeout=20) as http:
            seen = metrics(http)
        expired, unparked = seen["aoti_sessions_sessions_expired_total"], seen["aoti_sessions_sessions_unparked_total"]
        assert expired >= 10 and unparked >= 5, (expired, unparked)


def test_the_heartbeat_goes_on_through_a_long_step(package: Path) -> None:
    """The engine process's heartbeat comes from a thread of its own: a step
    that takes long (here held up by its session's lock, as a hung device or
    a deadlock would hold it) does not stop it, and it tells how long the step
    loop has been in that step, back to about 0 once steps go on. (The engine
    served in this process, this test its parent.)"""
    from aoti_sessions.llm.process._remote_engine import _Engine
    from aoti_sessions.llm.runtime._sampling import SamplingParams

    here, there = socket.socketpair()
    llm = LLM(package, threads=1)
    engine = _Engine(Connection(there.detach()), llm)
    served = threading.Thread(target=engine.serve, args=(0.05,), daemon=True)
    served.start()
    parent = Connection(here.detach())

    def until(kind: str, seconds: float = 30.0) -> list[tuple[Any, ...]]:
        """Messages' items until one of ``kind`` (or ``seconds`` of them)."""
        seen: list[tuple[Any, ...]] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and parent.poll(max(0.0, deadline - time.monotonic())):
            seen += parent.recv()
            if any(item[0] == kind for item in seen):
                break
        return seen

    try:
        parent.send([(1, "new_session", ())])
        sid = next(item[3] for item in until("reply") if item[0] == "reply")[0]  # (its id, its tokens)
        parent.send([(2, "start", (sid, llm.prompt_ids(USER), SamplingParams(max_tokens=CONTEXT - 64,
                                                                              ignore_eos=True)))])
        until("event")
        with engine._sessions[sid]._lock:  # (taken between two steps; the next one waits for it)
            beats = [item[1] for item in until("never", 1.0) if item[0] == "beat"]
        assert len(beats) >= 10 and beats[-1] >= 0.6, beats
        time.sleep(0.3)
        assert [item[1] for item in until("never", 0.3) if item[0] == "beat"][-1] < 0.3
    finally:
        parent.send([(3, "close", ())])
        served.join(60)
    assert not served.is_alive() and llm.engine.closed


def _chat(session: str, text: str = "Hello", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "session_id": session, **extra}


def test_a_stopped_engine_fails_requests_within_its_deadline_and_recovers(remote: RemoteLLM,
                                                                          tmp_path: Path) -> None:
    """SIGSTOP on the engine process: the stream in flight ends with an error
    event naming the engine as unresponsive, a request sent meanwhile gets a
    503 within the deadline, later ones at once; /health is 503 with the
    reason, the cluster's health check fails, /metrics answers (engine_up 0).
    SIGCONT: all is well again, the stopped stream's session included."""
    from aoti_sessions.cluster._replica import Replica

    replica: Any = SimpleNamespace(llm=remote, id="test-replica")  # (its health check alone: no Ray)
    pid = remote.pid or 0
    with serving(remote, session_dir=tmp_path) as url, client(url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json=_chat("s")).status_code == 200
        Replica.check_health(replica)
        long = _chat("long", max_tokens=CONTEXT - 64, ignore_eos=True, stream=True)
        try:
            with http.stream("POST", "/v1/chat/completions", json=long) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
                meanwhile = http.post("/v1/chat/completions", json=_chat("s", "More"))
                waited = time.monotonic() - stopped
                rest = [line for line in lines if line.startswith("data: ")]
            assert meanwhile.status_code == 503 and "unresponsive" in meanwhile.json()["error"]["message"], \
                meanwhile.text
            assert waited < ENGINE_TIMEOUT + 5, waited
            assert rest and "unresponsive" in rest[-1] and rest[-1] != "data: [DONE]", rest[-2:]
            started = time.monotonic()
            for request in (http.build_request("POST", "/v1/chat/completions", json=_chat("new")),
                            http.build_request("GET", "/v1/sessions"), http.build_request("GET", "/v1/sessions/s")):
                answer = http.send(request)
                assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_unavailable", \
                    answer.text
            assert time.monotonic() - started < 2  # at once
            health = http.get("/health")
            assert health.status_code == 503 and "unresponsive" in health.json()["reason"], health.text
            with pytest.raises(RuntimeError, match="unresponsive"):
                Replica.check_health(replica)
            seen = metrics(http)
            assert seen["aoti_sessions_engine_up"] == 0
            assert seen['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="503"}'] >= 2
        finally:
            os.kill(pid, signal.SIGCONT)
        # (With front ends, each front end's connection and the replica's learn from their own heartbeats:
        # FRONT_ENDS answers in a row, the client's requests going to each in turn, are every front end's.)
        wait_until(lambda: all(http.get("/health").status_code == 200 for _ in range(FRONT_ENDS)), timeout=10,
                   what="/health to be 200 again")
        wait_until(lambda: remote.alive, timeout=10, what="the engine to answer the replica's connection again")
        Replica.check_health(replica)
        assert metrics(http)["aoti_sessions_engine_up"] == 1
        for session in ("s", "long", "new"):
            answer = http.post("/v1/chat/completions", json=_chat(session, "And now?"))
            assert answer.status_code == 200, answer.text
        assert len(http.get("/v1/sessions").json()["data"]) == 3


def test_a_dead_engine_stops_the_server_with_status_1(package: Path, llm: LLM, tmp_path: Path) -> None:
    """SIGKILL on the engine process of ``aoti-sessions serve`` (with
    FRONT_ENDS front ends): the server stops with exit status 1 (a
    supervisor starts it again) saying why; a session parked before is left
    in its file for the next server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port),
                                    "--session-dir", str(tmp_path / "sessions"), "--session-ttl", "0.5",
                                    "--threads", "1", "--engine-timeout", "10", "--api-workers", str(FRONT_ENDS)],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            def up() -> bool:
                assert process.poll() is None, log_path.read_text()
                try:
                    return http.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(up, timeout=120, what="the server to start")
            assert http.post("/v1/chat/completions", json=_chat("kept")).status_code == 200
            parked = tmp_path / "sessions" / ".live" / "kept"
            wait_until(parked.is_file, timeout=30, what="the session to be parked")
            engines = {p for p in descendants(process.pid) - {process.pid} if b"_engine_main" in _cmdline(p)}
            assert len(engines) == 1, engines
            os.kill(engines.pop(), signal.SIGKILL)
            assert process.wait(60) == 1, log_path.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    said = log_path.read_text()
    assert "the engine process ended (exit code -9): stopped with exit status 1" in said, said[-2000:]
    with llm.load_session(parked) as session:
        assert session.token_count > 0


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
