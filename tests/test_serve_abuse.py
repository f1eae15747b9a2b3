"""The server under abuse (issue 20): bodies past the limit, prompts that
cannot fit, answered cleanly and cheaply, the server left serving. A real
uvicorn server over the tiny Qwen3 package on the CPU."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aoti_sessions.llm import LLM
from aoti_sessions.serve import create_app
from aoti_sessions.serve._limits import MIN_BODY_LIMIT, default_body_limit
from llm_models import llm_package
from serving import client, open_served, running, serving

CONTEXT = 256
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with open_served(llm_package("qwen3", max_cache_len=CONTEXT), max_sessions=8) as model:
        yield model


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[str]:
    with serving(llm, max_body_bytes=LIMIT) as url:
        yield url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with client(server, timeout=60) as http:
        yield http


def _chat(text: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["code"] == code, error
    return str(error["message"])


def _serves(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_chat("Hello"))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_body_over_the_limit_is_413_unread(http: httpx.Client, server: str) -> None:
    """Declared too long (Content-Length), or found too long as it arrives
    (chunked, no length): 413 naming the limit, the rest never read; the
    server goes on serving."""
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (2 * LIMIT) + b'"}]}'
    message = _error(http.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"}),
                     413, "request_too_large")
    assert f"limit of {LIMIT} bytes" in message and "--max-body-bytes" in message

    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b" " * 4096  # (whitespace: valid JSON padding, were it read)

    _error(http.post("/v1/chat/completions", content=chunks()), 413, "request_too_large")
    # A client that declares 100 MB and sends 12 bytes is answered at once, not held.
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000000\r\n\r\n{\"messages\":")
        assert raw.recv(4096).startswith(b"HTTP/1.1 413 ")
    _serves(http)
    # Just under the limit is read whole, as usual (and refused for what it
    # says: its short messages pass the character bound, their tokens do not fit).
    under = _chat("x")
    under["messages"] = [{"role": "user", "content": "h"}] * ((LIMIT - 200) // 30)
    assert LIMIT - 400 < len(httpx.Request("POST", "/", json=under).content) < LIMIT
    message = _error(http.post("/v1/chat/completions", json=under), 400, "context_length_exceeded")
    assert f"tokens; the context holds {CONTEXT}" in message


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(http: httpx.Client, llm: LLM) -> None:
    """Text longer than the context's tokens times the longest piece any
    token stands for: 400 context_length_exceeded from its length alone."""
    limit = CONTEXT * llm._piece_chars
    for body in (_chat("word " * (limit // 5 + 1)),
                 {"prompt": "x" * (limit + 1), "max_tokens": 2},
                 {**_chat("a"), "messages": [{"role": "user", "content": "b" * 600}] * (limit // 600 + 1)}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        message = _error(http.post(path, json=body), 400, "context_length_exceeded")
        assert "characters: at least" in message and f"the context holds {CONTEXT}" in message
    # Token ids: counted before each is checked.
    message = _error(http.post("/v1/completions", json={"prompt": [1] * (CONTEXT + 1), "max_tokens": 2}), 400,
                     "context_length_exceeded")
    assert f"has {CONTEXT + 1} tokens" in message
    _serves(http)


def test_the_default_body_limit_follows_the_context() -> None:
    assert default_body_limit(128) == MIN_BODY_LIMIT == 1 << 20
    assert default_body_limit(128 * 1024) == 4 << 20
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1, got 0"):
        create_app(None, max_body_bytes=0)  # type: ignore[arg-type]


def test_cli_takes_a_body_limit(tmp_path: Path) -> None:
    import argparse

    from aoti_sessions.serve._cli import add_arguments

    from aoti_sessions.serve._cli import describe_limits
    from aoti_sessions.serve._limits import default_budgets

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["p.pt2", "--max-body-bytes", "2MiB"]).max_body_bytes == 2 << 20
    defaults = parser.parse_args(["p.pt2"])
    assert defaults.max_body_bytes is None and defaults.session_ttl == 3600 and defaults.persist_sessions is None
    assert parser.parse_args(["p.pt2", "--session-ttl", "none"]).session_ttl is None
    assert parser.parse_args(["p.pt2", "--host-budget", "1G"]).host_budget == 10**9
    for bad in (["--session-ttl", "0"], ["--session-ttl", "inf"], ["--rewind-checkpoints", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["p.pt2", *bad])
    # Sessions are bounded by memory by default: on the CPU half of what is
    # available for state, a quarter for offloaded sessions; on CUDA the device bounds state.
    assert default_budgets("cpu", 8 << 30) == (4 << 30, 2 << 30)
    assert default_budgets("cuda:0", 8 << 30) == (None, 2 << 30)
    line = describe_limits(parser.parse_args(["p.pt2", "--session-dir", str(tmp_path)]), 4 << 30, 2 << 30)
    assert line == (f"sessions bounded by memory, session state 4.0 GiB, offloaded 2.0 GiB, idle sessions parked "
                    f"after 3600 s, parked to {tmp_path}/.live, saved sessions 100 files, 16.0 GiB a key, "
                    f"bodies up to 32 bytes a context token, "
                    f"1000 connections, request head in 10 s, body in 30 s")


KEY = "abuse-key-77"


@pytest.fixture(scope="module")
def guarded(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server with an API key and a session dir."""
    folder = tmp_path_factory.mktemp("sessions")
    with serving(llm, api_key=KEY, session_dir=folder) as url:
        yield url, folder


def test_errors_are_bounded_and_say_what_is_wrong(http: httpx.Client) -> None:
    """Each refusal a clean 4xx with its code; none echoes a huge input
    whole (at most about 1 KB of message)."""
    response = http.post("/v1/chat/completions", json={**_chat("hi"), "model": "m" * 50_000})
    assert len(_error(response, 404, "model_not_found")) <= 1100 and len(response.content) < 2000
    response = http.post("/v1/chat/completions", json={**_chat("hi"), "session_id": "s" * 50_000})
    assert response.status_code == 400 and len(response.content) < 2000
    # Bad UTF-8 in the body: malformed JSON, said so.
    bad = b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert "malformed JSON body: not UTF-8 text" in _error(http.post("/v1/chat/completions", content=bad,
                                                headers={"Content-Type": "application/json"}), 400, "invalid_json")
    # NaN (Python's JSON reader takes it): not a finite number.
    nan = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    message = _error(http.post("/v1/chat/completions", content=nan, headers={"Content-Type": "application/json"}),
                     400, "invalid_value")
    assert message.startswith("temperature:") and "finite number" in message
    # A lone surrogate (a \ud800 escape): not text a tokenizer takes.
    lone = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    message = _error(http.post("/v1/chat/completions", content=lone, headers={"Content-Type": "application/json"}),
                     400, "invalid_value")
    assert "not valid Unicode text: a lone surrogate at character 1" in message
    lone_prompt = b'{"prompt": "\\udfff", "max_tokens": 2}'
    assert "lone surrogate" in _error(http.post("/v1/completions", content=lone_prompt,
                                                headers={"Content-Type": "application/json"}), 400, "invalid_value")
    _serves(http)


def test_the_bearer_scheme_is_case_insensitive(guarded: tuple[str, Path]) -> None:
    url, _ = guarded
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}"):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in (f"Bearer {KEY}x", f"Basic {KEY}", KEY, f"bearer{KEY}"):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": header}).status_code == 401, header


def test_session_file_errors_name_the_file_not_the_server_path(guarded: tuple[str, Path], llm: LLM) -> None:
    import os

    url, folder = guarded
    auth = {"Authorization": f"Bearer {KEY}"}
    with client(url, headers=auth, timeout=60) as http:
        assert http.post("/v1/chat/completions", json={**_chat("Hello"), "session_id": "s1"}).status_code == 200
        os.mkfifo(folder / "pipe")
        message = _error(http.post("/v1/sessions/s1/save", json={"name": "pipe"}), 400, "invalid_session_file")
        assert message.startswith("cannot save the session as 'pipe': ") and str(folder) not in message
        (folder / "junk").write_bytes(b"AISSTATE" + b"\0" * 100)
        message = _error(http.post("/v1/sessions/load", json={"name": "junk"}), 400, "invalid_session_file")
        assert message.startswith("cannot load the session file 'junk': ") and str(folder) not in message
        # A chat saved under a name, and another chat saved under that name + ".tokens.json": both load as saved.
        assert http.post("/v1/chat/completions", json={**_chat("Other words"), "session_id": "s2"}).status_code == 200
        assert http.post("/v1/sessions/s1/save", json={"name": "col"}).status_code == 200
        assert http.post("/v1/sessions/s2/save", json={"name": "col.tokens.json"}).status_code == 200
        one = http.post("/v1/sessions/load", json={"name": "col"}).json()
        two = http.post("/v1/sessions/load", json={"name": "col.tokens.json"}).json()
        assert one["tokens"] == http.get("/v1/sessions/s1").json()["tokens"]
        assert two["tokens"] == http.get("/v1/sessions/s2").json()["tokens"]


def test_an_unexpected_error_is_one_500_logged_once(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """A bug's 500 carries the error's kind and a reference into the log, not
    its message (server paths, C++ sources); the log has its traceback once."""

    class Broken:
        def __init__(self, inner: LLM) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self._inner, name)

        def stats(self) -> dict[str, object]:
            raise RuntimeError("/secret/path/wrapper.so failed at csrc/core/runner.cc:123")

    server_log = logging.getLogger("uvicorn.error")  # (configured as the server starts; not propagated)
    with caplog.at_level("ERROR"), running(create_app(Broken(llm))) as url:  # type: ignore[arg-type]
        server_log.addHandler(caplog.handler)
        try:
            response = httpx.get(f"{url}/metrics")
        finally:
            server_log.removeHandler(caplog.handler)
    message = _error(response, 500, "internal_error")
    assert "RuntimeError" in message and "/secret" not in message and "runner.cc" not in message
    reference = message.split("reference ")[1].split(" ")[0]
    logged = [r for r in caplog.records if r.exc_info is not None]
    assert len(logged) == 1 and reference in logged[0].getMessage(), [r.getMessage() for r in caplog.records]


def test_idle_sessions_are_parked_and_come_back(llm: LLM, tmp_path: Path) -> None:
    """Past the TTL a named session is saved (persistence: a session dir)
    and closed: it holds no memory; the next request naming it brings it back
    with its cache (cached_tokens). Without a session dir it is closed: the
    id starts afresh. A stopping server parks every named session; the next
    server serves them on."""
    with serving(llm, session_dir=tmp_path, session_ttl=0.3) as url, client(url, timeout=60) as http:
        first = http.post("/v1/chat/completions", json={**_chat("Hello there"), "session_id": "chat:1"}).json()
        history = [{"role": "user", "content": "Hello there"},
                   {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                   {"role": "user", "content": "And then?"}]
        live = llm.stats()["live_sessions"]
        _wait(lambda: (tmp_path / ".live" / "chat:1").is_file(), "the session to be parked")
        _wait(lambda: llm.stats()["live_sessions"] == live - 1, "the parked session to be closed")
        assert http.get("/v1/sessions").json()["data"] == []
        again = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2, "temperature": 0,
                                                         "session_id": "chat:1"}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its cache came back
        assert not (tmp_path / ".live" / "chat:1").exists()
        metrics = http.get("/metrics").text
        assert "aoti_sessions_sessions_expired_total 1" in metrics
        assert "aoti_sessions_sessions_unparked_total 1" in metrics
    # The server stopped: the session was parked; a new server brings it back.
    assert (tmp_path / ".live" / "chat:1").is_file()
    with serving(llm, session_dir=tmp_path) as url, client(url, timeout=60) as http:
        described = http.get("/v1/sessions/chat:1").json()
        assert described["id"] == "chat:1" and described["tokens"] > 0
        assert http.delete("/v1/sessions/chat:1").status_code == 200
    assert not (tmp_path / ".live" / "chat:1").exists()
    # No session dir: closed at the TTL, nothing kept.
    with serving(llm, session_ttl=0.3) as url, client(url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json={**_chat("Hi"), "session_id": "gone"}).status_code == 200
        _wait(lambda: http.get("/v1/sessions").json()["data"] == [], "the session to be closed")
        assert http.get("/v1/sessions/gone").status_code == 404
    with pytest.raises(ValueError, match="session_ttl must be a number of seconds > 0"):
        create_app(llm, session_ttl=0)
    with pytest.raises(ValueError, match="persist_sessions needs a session_dir"):
        create_app(llm, persist_sessions=True)


def test_a_parked_file_that_cannot_load_is_set_aside(llm: LLM, tmp_path: Path) -> None:
    (tmp_path / ".live").mkdir()
    (tmp_path / ".live" / "broken").write_bytes(b"AISSTATE" + b"\0" * 40)
    with serving(llm, session_dir=tmp_path) as url, client(url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={**_chat("Hi"), "session_id": "broken"})
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (tmp_path / ".live" / "broken.bad").is_file()


def _wait(condition: object, what: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_slow_clients_and_too_many_connections(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """A client that sends half a request head is disconnected after the
    head timeout; one whose body stalls gets 408 after the body timeout;
    past the connection limit requests get 503; the server serves on, and
    overload is logged once, not once a connection."""
    import time

    from aoti_sessions.serve._http import server_config

    app = create_app(llm, body_timeout=0.5)
    config = server_config(app, "127.0.0.1", 0, max_connections=4, header_timeout=0.5, log_level="warning",
                           lifespan="on")
    with caplog.at_level("WARNING", logger="aoti_sessions.serve"), running(app, config) as url:
        port = int(url.rsplit(":", 1)[1])
        half_heads = []
        for _ in range(3):
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            half_heads.append(raw)
        started = time.monotonic()
        for raw in half_heads:
            assert raw.recv(100) == b""  # closed by the server
            raw.close()
        assert time.monotonic() - started < 8
        closed = [r for r in caplog.records if "request head did not arrive" in r.getMessage()]
        assert len(closed) == 1, [r.getMessage() for r in closed]  # three closed, one line
        # A body that stalls: 408.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"messages\":")
            assert raw.recv(4096).startswith(b"HTTP/1.1 408 ")
        # At the connection limit: 503 for the next, until one goes.
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        time.sleep(0.2)
        try:
            assert httpx.get(f"{url}/health").status_code == 503
        finally:
            for raw in held:
                raw.close()
        time.sleep(0.2)
        assert httpx.get(f"{url}/health").status_code == 200
        with httpx.Client(base_url=url, timeout=60) as http:
            _serves(http)


def test_an_idle_connection_outlives_the_clients_keep_alive(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """The server keeps an idle connection longer than httpx (the OpenAI
    client's transport) keeps reusing one, 5 s: a request sent on it then
    is answered, never met by the server closing it; it is closed later,
    without a warning."""
    import time

    from aoti_sessions.serve._http import server_config
    from aoti_sessions.serve._limits import DEFAULT_HEADER_TIMEOUT, KEEP_ALIVE

    assert 5 < KEEP_ALIVE < DEFAULT_HEADER_TIMEOUT
    app = create_app(llm)
    config = server_config(app, "127.0.0.1", 0, log_level="warning", lifespan="on")
    with caplog.at_level("WARNING", logger="aoti_sessions.serve"), running(app, config) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            raw.sendall(request)
            assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
            time.sleep(5.5)  # past httpx's keepalive_expiry
            raw.sendall(request)
            assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
            started = time.monotonic()
            assert raw.recv(100) == b""  # then closed, idle
            assert KEEP_ALIVE - 1 < time.monotonic() - started < DEFAULT_HEADER_TIMEOUT
    assert not [r for r in caplog.records if "request head did not arrive" in r.getMessage()]


def test_a_flood_of_connections_past_the_open_file_limit(tmp_path: Path) -> None:
    """The real command with 200 open files at most (hard limit) and 600
    connections each holding half a request head: it says once that fewer
    connections fit than --max-connections, logs no traceback, and serves
    the next request."""
    import resource
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    package = llm_package("qwen3", max_cache_len=CONTEXT)
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port), "--threads", "1",
             "--no-engine-process"], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
        try:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            held = []
            for _ in range(600):
                try:
                    raw = socket.create_connection(("127.0.0.1", port), timeout=2)
                    raw.sendall(b"GET /health HTTP/1.1\r\nHo")
                    held.append(raw)
                except OSError:
                    pass
            time.sleep(1)
            for raw in held:
                raw.close()
            time.sleep(0.5)
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        finally:
            server.terminate()
            server.wait(60)
    text = (tmp_path / "server.log").read_text()
    assert "Traceback" not in text, text[-3000:]
    assert text.count("open files are limited to 200 (ulimit -Hn): fewer than 1000 connections fit") == 1, text
    assert len(text.splitlines()) < 40, text[-3000:]
