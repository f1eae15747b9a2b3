"""A real uvicorn server of ``aoti_sessions.serve`` on a free localhost port,
run in a thread of the test process, and what the server tests read from it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from llm_models import llm_package

SERVER_CONTEXT = 512  # the server tests' package: room for long generations (cancelled and busy ones still run)


def _front_ends() -> int:
    value = os.environ.get("AOTI_SESSIONS_TEST_FRONT_ENDS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"AOTI_SESSIONS_TEST_FRONT_ENDS must be an integer >= 1, got {value!r}")
    return int(value)


# AOTI_SESSIONS_TEST_FRONT_ENDS=N (N >= 2, opt-in: slower): the server tests
# written with open_served() and serving() run as N front ends over one engine
# process (serve --api-workers N), each client's requests going to the front
# ends in turn; by default they serve in this process. (test_serve.py runs
# each of its tests one process, engine process and two front ends, always.)
FRONT_ENDS = _front_ends()


def open_served(package: Any, device: str = "cpu", **options: Any) -> Any:
    """The LLM of ``package`` a server test serves: in this process, or
    (FRONT_ENDS > 1) in an engine process of its own, which front ends
    attach to (``options``: LLM's; ``threads`` 1 on the CPU unless given)."""
    from aoti_sessions.llm import LLM, RemoteLLM

    if device == "cpu":
        options.setdefault("threads", 1)
    return (RemoteLLM if FRONT_ENDS > 1 else LLM)(package, device, **options)


@contextmanager
def serving(llm: Any, **options: Any) -> Iterator[str]:
    """The server of ``llm`` (open_served's) with ``options`` (create_app's)
    until the block ends: in this process, or FRONT_ENDS front ends sharing
    one registry; yields the base URL (give it to client())."""
    if FRONT_ENDS > 1:
        with running_front_ends(llm, FRONT_ENDS, **options) as url:
            yield url
        return
    from aoti_sessions.serve import create_app

    with running(create_app(llm, **options)) as url:
        yield url


def client(url: str, **options: Any) -> httpx.Client:
    """An httpx client of ``url`` (``options``: httpx.Client's): its requests
    go to the front ends in turn where there are several."""
    return httpx.Client(base_url=url, transport=transport_for(url), **options)


@contextmanager
def running(app: Any, config: uvicorn.Config | None = None) -> Iterator[str]:
    """Serves ``app`` (with ``config``, if given: its host and port unused)
    until the block ends; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')


def metrics(client: httpx.Client) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}; checks every line is
    well-formed exposition text (a comment or a sample)."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not exposition text: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_until(condition: Any, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def descendants(root: int) -> set[int]:
    """``root`` and every process under it (from /proc): a server's or a
    cluster's processes."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(parents.get(pid, []))
    return out


class FrontEnds(str):
    """The base URL of the first of several front ends (``ports``: every
    one's; ``hub``: their registry's socket)."""

    ports: list[int]
    hub: str


class Alternating(httpx.BaseTransport):
    """Sends each request to the next of ``ports`` in turn (a session's turns
    then cross front ends): httpx's transport, for a client of FrontEnds."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = itertools.cycle(ports)
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=next(self._ports))
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def transport_for(url: str) -> Alternating | None:
    """The transport a test client of ``url`` uses: alternating over front ends, where there are several."""
    return Alternating(url.ports) if isinstance(url, FrontEnds) else None


class AsyncAlternating(httpx.AsyncBaseTransport):
    """Alternating, for an async client (the openai-agents SDK's)."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = itertools.cycle(ports)
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=next(self._ports))
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def async_transport_for(url: str) -> AsyncAlternating | None:
    """transport_for, for an async client."""
    return AsyncAlternating(url.ports) if isinstance(url, FrontEnds) else None


@contextmanager
def running_front_ends(owner: Any, count: int, registry: Any = None, **options: Any) -> Iterator[FrontEnds]:
    """``count`` front ends of ``owner`` (a RemoteLLM) sharing one registry
    (``registry``, else the one ``options`` make), as ``aoti-sessions serve
    --api-workers COUNT`` runs them (serve/_fleet.py), in this process: the
    hub on an event loop of its own, each front end's app attached to the
    engine and served by running()."""
    from aoti_sessions.llm import RemoteLLM
    from aoti_sessions.serve._app import create_app, new_registry
    from aoti_sessions.serve._fleet import Hub
    from aoti_sessions.serve._shared import SharedRegistry

    folder = tempfile.mkdtemp(prefix="aoti-sessions-test-hub-")
    hub = Hub(registry if registry is not None else new_registry(owner, **options), os.path.join(folder, "hub.sock"),
              options.get("stats_interval"))  # (the hub writes the stats log of all the front ends)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hub", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(hub.start(), loop).result(30)
    address = owner.share()
    attached = [RemoteLLM.attach(owner.package, address, engine_timeout=owner.engine_timeout,
                                 step_timeout=owner.step_timeout, **owner.prompt_options) for _ in range(count)]
    try:
        with contextlib.ExitStack() as stack:
            urls = [stack.enter_context(running(create_app(llm, shared=SharedRegistry(llm, hub.path), **options)))
                    for llm in attached]
            url = FrontEnds(urls[0])
            url.ports = [int(u.rsplit(":", 1)[1]) for u in urls]
            url.hub = hub.path
            yield url
    finally:
        for llm in attached:
            llm.close()

        async def stop() -> None:
            await hub.close()
            await hub.registry.close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def package(device: str) -> Any:
    """The server tests' package: a tiny Qwen3 of SERVER_CONTEXT tokens (import it with ``llm`` as fixtures)."""
    return llm_package("qwen3", device=device, max_cache_len=SERVER_CONTEXT)


@pytest.fixture(scope="module")
def llm(package: Any, device: str) -> Iterator[Any]:
    """An LLM of ``package`` in the test process."""
    from aoti_sessions.llm import LLM

    with LLM(package, device, max_sessions=16) as model:
        yield model
