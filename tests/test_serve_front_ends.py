"""Several front ends over one engine process (``aoti-sessions serve
--api-workers N``, serve/_fleet.py): the engine shared by connections of
other processes (RemoteLLM.attach), one registry of sessions the front ends
ask (serve/_shared.py), one view of /metrics, and the real command: a chat's
turns on fresh connections, concurrent chats equal to their solo runs, a
clean stop that parks the sessions. test_serve.py runs each of its server
tests through two front ends too."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import httpx
import pytest

from aoti_sessions.errors import EngineProcessError, SessionClosedError
from aoti_sessions.llm import LLM, RemoteLLM
from aoti_sessions.llm.process._remote_wire import EngineAddress, Outbox
from aoti_sessions.serve._fleet import default_api_workers
from aoti_sessions.serve._entry import Entry
from aoti_sessions.serve._sessions import Registry
from aoti_sessions.serve._shared import SharedRegistry
from aoti_sessions.serve._tenants import DEFAULT_TENANT
from conftest import run_async
from serving import SERVER_CONTEXT, llm, package  # noqa: F401 (llm, package: fixtures)
from serving import descendants, metrics, running_front_ends, wait_until

CONTEXT = SERVER_CONTEXT
TOKENS = 6


def _text(g: Any) -> str:
    pieces = []
    while (piece := g.step()) is not None:
        pieces.append(piece)
    return "".join(pieces)


def _solo(llm: LLM, turns: list[str]) -> list[str]:
    """A chat's greedy replies, run alone in this process."""
    messages: list[dict[str, str]] = []
    replies = []
    with llm.new_session() as session:
        for user in turns:
            messages.append({"role": "user", "content": user})
            replies.append(session.generate(messages, max_tokens=TOKENS, temperature=0, ignore_eos=True).text)
            messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_an_outbox_sends_what_was_put_later_at_its_flush() -> None:
    """An engine process's events from the step loop are put ``later`` and
    sent at the loop's flush (Scheduler.before_wait), in order with what was
    put for at once; a put for at once sends everything before it too."""
    ours, theirs = Pipe()
    outbox = Outbox(ours, "test-sender")
    try:
        outbox.put(("event", 1), later=True)
        outbox.put(("event", 2), later=True)
        assert not theirs.poll(0.2)  # (held until a flush)
        outbox.flush()
        assert theirs.poll(5) and theirs.recv() == [("event", 1), ("event", 2)]
        outbox.flush()  # nothing put: nothing sent
        assert not theirs.poll(0.1)
        outbox.put(("event", 3), later=True)
        outbox.put(("reply", 4))
        got: list[Any] = []
        while len(got) < 2 and theirs.poll(5):
            got += theirs.recv()
        assert got == [("event", 3), ("reply", 4)]
    finally:
        outbox.stop(5)
        ours.close()
        theirs.close()


def test_attached_processes_share_the_engines_sessions(package: Path, device: str, llm: LLM) -> None:
    """A session made by one connection runs from another with the same
    text; a connection that goes stops its generations, not the session; a
    wrong key, a share from an attached one and an engine gone are refused."""
    with llm.new_session() as local:
        want = local.generate("The sea", max_tokens=TOKENS, temperature=0, ignore_eos=True).text
    with RemoteLLM(package, device, threads=1) as owner:
        address = owner.share()
        assert owner.share() == address and oct(os.stat(os.path.dirname(address.path)).st_mode & 0o777) == "0o700"
        other = RemoteLLM.attach(package, address)
        session = owner.new_session()
        proxy = other.session_of(session.id, session.token_count)
        assert _text(proxy.start("The sea", max_tokens=TOKENS, temperature=0, ignore_eos=True)) == want
        # A generation of a connection that goes ends with it; the session serves on.
        third = RemoteLLM.attach(package, address)
        long = third.session_of(session.id, proxy.token_count).start("More", max_tokens=CONTEXT // 2,
                                                                        ignore_eos=True)
        assert long.step() is not None
        third.close()  # (its detach is answered once its generations stopped)
        again = other.session_of(session.id, 0)
        g = again.start("Again", max_tokens=2, temperature=0, ignore_eos=True)
        _text(g)
        assert g.completion_tokens == 2 and g.finish_reason == "length"
        with pytest.raises(EngineProcessError, match="only the RemoteLLM that started"):
            other.share()
        with pytest.raises(EngineProcessError, match="cannot reach the engine process"):
            RemoteLLM.attach(package, EngineAddress(address.path, b"x" * 32))
        assert other.alive and _text(proxy.start("Still", max_tokens=2, temperature=0)) is not None
    # The engine ended with its first connection: the others' calls say so.
    with pytest.raises((EngineProcessError, SessionClosedError)):
        other.new_session()
    other.close()
    with pytest.raises(EngineProcessError):
        RemoteLLM.attach(package, address)


def test_text_made_by_the_front_end_is_the_engines(package: Path, device: str) -> None:
    """A connection with ``text_here`` gets token ids and makes their text
    itself: the same pieces' text, stops and counts as the engine's, for
    random prompts, sampling and stop strings (cut mid-character too)."""
    rng = random.Random(3535)
    with RemoteLLM(package, device, threads=1) as owner:
        here = RemoteLLM.attach(package, owner.share())
        assert here.text_here and not owner.text_here
        vocab = [t for t in range(owner.spec.vocab_size) if t not in owner.spec.eos_token_ids]
        for case in range(12):
            prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 12))]
            with owner.new_session() as probe:
                seen = _text(probe.start(prompt, max_tokens=12, temperature=0, ignore_eos=True))
            stop = [seen[i:i + rng.randint(1, 3)] for i in rng.sample(range(len(seen)), min(2, len(seen)))] \
                if seen and case % 3 else []
            params = dict(max_tokens=12, temperature=rng.choice([0, 0.8]), seed=case, stop=[s for s in stop if s],
                          ignore_eos=True)
            runs = []
            for llm in (owner, here):
                session = owner.new_session()
                proxy = llm.session_of(session.id, 0)
                g = proxy.start(prompt, **params)
                runs.append((_text(g), g.finish_reason, g.completion_tokens))
                session.close()
            assert runs[0] == runs[1], (case, params, runs)
        here.close()


def test_front_ends_share_one_registry_and_one_view_of_metrics(package: Path, device: str, llm: LLM,
                                                                 tmp_path: Path) -> None:
    """Two front ends (in this process): a chat alternating between them
    gets its solo replies from one session, a session held through one is
    busy through the other, each front end's /metrics counts both's requests,
    and a front end that goes lets its sessions go."""
    turns = ["Hello", "Tell me more", "And then?"]
    want = _solo(llm, turns)
    with RemoteLLM(package, device, threads=1, max_sessions=8) as owner, \
            running_front_ends(owner, 2, session_dir=tmp_path) as url:
        first, second = (httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) for port in url.ports)
        with first, second:
            messages: list[dict[str, str]] = []
            for i, user in enumerate(turns):
                messages.append({"role": "user", "content": user})
                front = (first, second)[i % 2]
                reply = front.post("/v1/chat/completions", json={
                    "messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                    "session_id": "across"}).json()
                assert reply["choices"][0]["message"]["content"] == want[i], (i, reply)
                if i:
                    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, reply
                messages.append({"role": "assistant", "content": want[i]})
            # Held through one front end: busy through the other.
            body = {"messages": messages, "max_tokens": CONTEXT // 2, "ignore_eos": True, "stream": True,
                    "session_id": "across"}
            with first.stream("POST", "/v1/chat/completions", json=body) as stream:
                assert stream.status_code == 200
                assert second.get("/v1/sessions/across").json()["busy"] is True
                busy = second.post("/v1/chat/completions", json={**body, "stream": False})
                assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy", busy.text
            wait_until(lambda: not second.get("/v1/sessions/across").json()["busy"], what="the hold to end")
            # One view: each front end counts the other's requests too.
            views = [metrics(front) for front in (first, second)]
            for view in views:
                assert view['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 3
                assert view['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="409"}'] == 1
                assert view["aoti_sessions_named_sessions"] == 1
            assert views[0]["aoti_sessions_generated_tokens_total"] >= 3 * TOKENS
            # Sessions, forks and files through either front end.
            assert second.post("/v1/sessions/across/fork", json={"session_id": "branch"}).status_code == 200
            assert {s["id"] for s in first.get("/v1/sessions").json()["data"]} == {"across", "branch"}
            assert first.post("/v1/sessions/branch/save", json={"name": "kept"}).status_code == 200
            assert [f["name"] for f in second.get("/v1/session-files").json()["data"]] == ["kept"]
            assert second.delete("/v1/sessions/branch").status_code == 200
            assert first.get("/v1/sessions/branch").status_code == 404

        # A front end that goes (its link closes) lets what it held go.
        async def hold_and_go() -> None:
            shared = SharedRegistry(owner, url.hub)
            await shared.open(dict)
            entry = await shared.acquire(DEFAULT_TENANT, "across", create=False)
            assert entry.session is not None
            await shared.close()
        run_async(hold_and_go())
        with httpx.Client(base_url=url, timeout=60) as http:
            wait_until(lambda: not http.get("/v1/sessions/across").json()["busy"], what="the session to be let go")


class _SlowRelease(Registry):
    """A registry whose releases take a while (a hub busy with other front ends)."""

    async def release(self, entry: Entry) -> None:
        await asyncio.sleep(0.2)
        await super().release(entry)


def test_a_streams_session_is_free_once_its_last_event_arrives(package: Path, device: str) -> None:
    """The session is released before a stream's last event goes: a next
    turn sent the moment it arrives, to the other front end, never finds the
    session busy, however long the hub takes to release it."""
    with RemoteLLM(package, device, threads=1) as owner, \
            running_front_ends(owner, 2, registry=_SlowRelease(owner)) as url:
        first, second = (httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) for port in url.ports)
        with first, second:
            for i in range(4):
                body = {"messages": [{"role": "user", "content": f"Quick {i}"}], "max_tokens": 2, "stream": True,
                        "session_id": "quick"}
                with (first, second)[i % 2].stream("POST", "/v1/chat/completions", json=body) as stream:
                    lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]", lines
                    assert (second, first)[i % 2].get("/v1/sessions/quick").json()["busy"] is False, i


class _SlowAcquire(Registry):
    """A registry whose acquires take a while (an unpark, a full engine)."""

    async def acquire(self, tenant: str, session_id: str | None, *, create: bool, **options: Any) -> Entry:
        await asyncio.sleep(0.3)
        return await super().acquire(tenant, session_id, create=create, **options)


def test_a_request_that_gives_up_waiting_leaves_the_session_free(package: Path, device: str) -> None:
    """A front end's request that stops waiting for the hub's acquire (its
    client went, a deadline) leaves the session free once the hub has it,
    the front end's link still open."""
    with RemoteLLM(package, device, threads=1) as owner, \
            running_front_ends(owner, 1, registry=_SlowAcquire(owner)) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            made = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "session_id": "wait"})
            assert made.status_code == 200, made.text

        async def give_up_then_take() -> None:
            shared = SharedRegistry(owner, url.hub)
            await shared.open(dict)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(shared.acquire(DEFAULT_TENANT, "wait", create=False), 0.05)
            await asyncio.sleep(0.6)  # the hub acquired it meanwhile, then let it go
            entry = await shared.acquire(DEFAULT_TENANT, "wait", create=False)  # (409 if still held)
            await shared.release(entry)
            await shared.close()

        run_async(give_up_then_take())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_front_ends_serve_concurrent_chats_as_alone(package: Path, device: str, llm: LLM,
                                                        tmp_path: Path) -> None:
    """``serve --api-workers 2``: two front-end processes on one port over
    one engine process; concurrent chats of random lengths, every turn on a
    fresh connection (the kernel hands them to either front end), each equal
    to its solo run; /metrics counts them all; a second such server on the
    port is refused; a front end killed is replaced and the sessions serve
    on; SIGTERM parks the sessions and every process ends."""
    rng = random.Random(35)
    words = ["sea", "stone", "river", "light", "cloud", "field", "road", "bird"]
    chats = {f"chat-{i}": [" ".join(rng.choices(words, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
             for i in range(6)}
    want = {name: _solo(llm, turns) for name, turns in chats.items()}
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port),
                                    "--device", device, "--api-workers", "2", "--threads", "1",
                                    "--session-dir", str(tmp_path / "sessions"), "--stats-interval", "0.5"],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert process.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{base}/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_until(up, timeout=120, what="the server to start")
        # The server's processes: itself, the engine process, two front ends.
        wait_until(lambda: len(descendants(process.pid)) == 4, what="four processes")

        def converse(name: str) -> list[str]:
            messages: list[dict[str, str]] = []
            replies = []
            for user in chats[name]:
                messages.append({"role": "user", "content": user})
                with httpx.Client(base_url=base, timeout=120) as fresh:  # (a new connection a turn)
                    response = fresh.post("/v1/chat/completions", json={
                        "messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                        "session_id": name, "stream": rng.random() < 0.5})
                assert response.status_code == 200, response.text
                if response.headers["content-type"].startswith("text/event-stream"):
                    import json
                    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                              if line.startswith("data: {")]
                    replies.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                                           if c["choices"]))
                else:
                    replies.append(response.json()["choices"][0]["message"]["content"])
                messages.append({"role": "assistant", "content": replies[-1]})
            return replies

        with ThreadPoolExecutor(len(chats)) as pool:
            got = dict(zip(chats, pool.map(converse, chats)))
        assert got == want
        # The front ends' lines carry each request's id; the hub's stats line counts every front end's requests.
        for i in range(4):  # (fresh connections: both front ends, most likely)
            with httpx.Client(base_url=base, timeout=60) as fresh:
                assert fresh.get("/v1/models", headers={"X-Request-Id": f"fleet-{i}"}).headers["x-request-id"] \
                    == f"fleet-{i}"
        stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
        sent = sum(len(turns) for turns in chats.values())
        wait_until(lambda: sum(int(n) for n in re.findall(stamp + r"aoti_sessions\.serve: stats: (\d+) requests",
                                                          log_path.read_text(), re.M)) >= sent, timeout=30,
                   what="stats lines of every front end's requests")
        assert all(re.search(stamp + rf'uvicorn\.access \[fleet-{i}\]: \S+ - "GET /v1/models', log_path.read_text(),
                             re.M) for i in range(4)), log_path.read_text()
        ok = 'aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="200"}'
        with httpx.Client(base_url=base, timeout=60) as http:
            counts = metrics(http)
        assert counts[ok] == sent, counts
        assert counts["aoti_sessions_named_sessions"] == len(chats)
        # A second server with several front ends on the port is refused (not spread beside this one).
        second = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port),
                                 "--device", device, "--api-workers", "2", "--threads", "1"],
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and "is taken by another aoti-sessions server" in second.stderr, second.stderr
        # A front end killed: another takes its place; the sessions serve on.
        fronts = [p for p in descendants(process.pid) - {process.pid} if _is_front_end(p)]
        assert len(fronts) == 2
        os.kill(fronts[0], signal.SIGKILL)
        wait_until(lambda: len([p for p in descendants(process.pid) if _is_front_end(p)]) == 2
                   and fronts[0] not in descendants(process.pid), timeout=120, what="a new front end")
        name = next(iter(chats))
        messages = [m for user, reply in zip(chats[name], want[name])
                    for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]
        for _ in range(4):  # (on fresh connections: whichever front end takes them)
            with httpx.Client(base_url=base, timeout=120) as fresh:
                again = fresh.post("/v1/chat/completions", json={
                    "messages": [*messages, {"role": "user", "content": "more"}], "max_tokens": TOKENS,
                    "temperature": 0, "ignore_eos": True, "session_id": name})
            assert again.status_code == 200, again.text
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        with httpx.Client(base_url=base, timeout=60) as http:
            assert metrics(http)[ok] >= counts[ok]  # (the dead front end's counts stay in the sums)
    finally:
        every = descendants(process.pid)
        os.killpg(process.pid, signal.SIGTERM)
        status = process.wait(120)
    text = log_path.read_text()
    assert status == 0 and f"parked {len(chats)} sessions in" in text and "2 front ends" in text, text
    assert sorted(p.name for p in (tmp_path / "sessions" / ".live").iterdir()) == sorted(chats)
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in every), what="every process to end")


def _is_front_end(pid: int) -> bool:
    try:
        return b"aoti_sessions.serve._front_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_cli_api_workers_default_and_refusals() -> None:
    assert default_api_workers("cpu", 64) == 1
    assert default_api_workers("cuda", 2) == 1 and default_api_workers("cuda:0", 16) == 4
    assert default_api_workers("cuda", 8) == 2
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", "x.pt2", "--api-workers", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--api-workers: must be at least 1, got 0" in result.stderr, result.stderr
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", "x.pt2", "--api-workers", "2",
                             "--no-engine-process"], capture_output=True, text=True)
    assert result.returncode == 2 and "needs the engine process" in result.stderr, result.stderr
    assert time.monotonic() - started < 60
