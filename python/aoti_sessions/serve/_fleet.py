"""``aoti-sessions serve --api-workers N``: N front ends over one engine
process (docs/batching.md, "Several front ends").

One front end's process (HTTP, chat templates, tokenizing, streaming) runs
at most one core; at 64 chats on a GPU it, not the step loop, bounds the
server. So the server's first process (the hub, here) starts the engine
process (a RemoteLLM it shares), keeps the one registry of named sessions
(serve/_sessions.py) and serves it to the front ends (serve/_shared.py), and
starts N front-end processes (python -m aoti_sessions.serve._front_main), each
attached to the engine and listening on the server's port beside the others
(SO_REUSEPORT: the kernel spreads the connections over them evenly). A session id may come to any front end:
the hub holds it for one request at a time, wherever it came.

Stopping (SIGTERM, SIGINT; or the engine process died): the front ends stop
(each finishes what it serves), then the hub parks the named sessions (as one
process's server does) and closes the engine. A front end that dies is
started again; what it was serving fails with it (its sessions are released,
their state intact).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from . import _stats_log
from ._response_store import ResponseStore
from ._entry import Entry, described_one
from ._sessions import Registry
from ._shared import METRICS_TIMEOUT_S, Link
from ._threads import in_thread

if TYPE_CHECKING:
    from ..llm import RemoteLLM, RemoteSession
    from ..llm.interface import EngineAddress

log = logging.getLogger("aoti_sessions.serve")
STOP_TIMEOUT_S = 60.0  # front ends finishing what they serve when the server stops
RESTART_DELAY_S = 1.0  # before a front end that died is started again (doubled for each that ended early)
EARLY_END_S = 30.0  # a front end ending this soon after its start ended early
EARLY_ENDS = 5  # this many early ends in a row stop the server


def default_api_workers(device: str, cpus: int) -> int:
    """Front ends for ``serve`` by default: one on a CPU device (the model's
    kernels want the cores); on a GPU one per three cores beyond the engine's
    and the hub's, at most 4 (each is at most a core, and at 64 chats one
    is the server's bound)."""
    if device.startswith("cpu"):
        return 1
    return max(1, min(4, (cpus - 2) // 3))


@dataclass
class FrontEnd:
    """What a front-end process is told (pickled on its stdin: the engine's key is a secret)."""

    package: str
    engine: EngineAddress
    hub: str
    address: tuple[str, int]  # where it listens (beside the others: SO_REUSEPORT)
    app_options: dict[str, Any]
    server_options: dict[str, Any]
    engine_timeout: float
    step_timeout: float
    prompt_options: dict[str, Any]  # the engine's RemoteLLM's: its chat template and reply formats


class Hub:
    """The registry of named sessions, served to the front ends over their
    links; from start to close its sweep parks the sessions idle past their
    TTL (the front ends' registries do not sweep: SharedRegistry), and with
    ``stats_interval`` it writes the stats log line of all the front ends."""

    def __init__(self, registry: Registry, path: str, stats_interval: float | None = None) -> None:
        self.registry = registry
        self.path = path
        self.stats_interval = stats_interval
        # A request's session, by its front end's link and the handle the front end gave it.
        self._held: dict[tuple[Link, int], Entry] = {}
        self._acquiring: set[tuple[Link, int]] = set()
        self._dropped: set[tuple[Link, int]] = set()  # released while still being acquired (its caller gave up)
        self._links: set[Link] = set()
        self._last: dict[Link, dict[str, Any]] = {}  # each front end's counts as last read
        self._retired: list[dict[str, Any]] = []  # the last counts of front ends that ended
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []  # its sweep, its stats log

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connected, self.path)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.registry.sweep()))
        if self.stats_interval is not None:
            self._tasks.append(loop.create_task(_stats_log.run(self.stats_interval, self._stats)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            await link.close()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers: dict[str, Any] = {}
        link = Link(reader, writer, handlers)
        handlers.update({name: functools.partial(getattr(self, "_op_" + name), link) for name in (
            "acquire", "release", "lookup", "reset", "fork", "load", "delete", "save", "files", "delete_file",
            "listing", "metrics", "responses")})
        self._links.add(link)
        await link.closed.wait()
        self._links.discard(link)
        if link in self._last:  # its counts stay in the sums (a counter never goes down)
            self._retired.append(self._last.pop(link))
        for key, entry in list(self._held.items()):
            if key[0] is link:  # a front end that went: what it held is let go once its generation stopped
                del self._held[key]
                session: Any = entry.session
                if session is not None:
                    try:
                        await in_thread(session.settle)  # (the engine stops the generations of a connection gone)
                    except Exception as e:  # noqa: BLE001 - an engine gone: nothing runs on it any more
                        log.warning("session %r: waiting for its generation to stop failed: %s", entry.id, e)
                await self.registry.release(entry)

    # -- what a front end asks -------------------------------------------------------
    async def _op_acquire(self, link: Link, handle: int, tenant: str, session_id: str | None, create: bool,
                          prompt: list[int] | None = None, cache_key: str | None = None) -> tuple[int, int]:
        """The session held under ``handle``: the engine's id and its token
        count (a throwaway from the prefix cache: Registry.acquire)."""
        key = (link, handle)
        self._acquiring.add(key)
        try:
            entry = await self.registry.acquire(tenant, session_id, create=create, prompt=prompt,
                                                cache_key=cache_key)
        except BaseException:
            self._dropped.discard(key)
            raise
        finally:
            self._acquiring.discard(key)
        if link.closed.is_set() or key in self._dropped:  # (its front end went, or gave up waiting)
            self._dropped.discard(key)
            await self.registry.release(entry)
            raise ConnectionError("the request gave up its session before it was acquired")
        self._held[key] = entry
        session: Any = entry.session
        return session.id, session.token_count

    async def _op_release(self, link: Link, handle: int, tokens: int | None) -> None:
        key = (link, handle)
        entry = self._held.pop(key, None)
        if entry is None:
            if key in self._acquiring:
                self._dropped.add(key)  # released once acquired
            return
        if entry.session is not None and tokens is not None:
            # (The fleet's registry holds the engine process's sessions.)
            cast("RemoteSession", entry.session).counted(tokens)
            entry.tokens = tokens
        await self.registry.release(entry)

    async def _op_lookup(self, link: Link, tenant: str, session_id: str) -> dict[str, Any]:
        return await described_one(await self.registry.lookup(tenant, session_id))

    async def _op_reset(self, link: Link, tenant: str, session_id: str) -> dict[str, Any]:
        return await described_one(await self.registry.reset(tenant, session_id))

    async def _op_fork(self, link: Link, tenant: str, session_id: str, new_id: str | None) -> dict[str, Any]:
        return await described_one(await self.registry.fork(tenant, session_id, new_id))

    async def _op_load(self, link: Link, tenant: str, name: str, session_id: str | None) -> dict[str, Any]:
        return await described_one(await self.registry.load(tenant, name, session_id))

    async def _op_delete(self, link: Link, tenant: str, session_id: str) -> None:
        await self.registry.delete(tenant, session_id)

    async def _op_save(self, link: Link, tenant: str, session_id: str, name: str) -> int:
        return await self.registry.save(tenant, session_id, name)

    async def _op_files(self, link: Link, tenant: str) -> list[dict[str, Any]]:
        return await self.registry.files(tenant)

    async def _op_delete_file(self, link: Link, tenant: str, name: str) -> None:
        await self.registry.delete_file(tenant, name)

    async def _op_listing(self, link: Link, tenant: str) -> list[dict[str, Any]]:
        return await self.registry.listing(tenant)

    async def _op_responses(self, link: Link, op: str, *args: Any) -> Any:
        """One call of the registry's stored responses (serve/_response_store.py)."""
        if op not in ResponseStore.OPS:
            raise ValueError(f"no such operation of the stored responses: {op!r}")
        return await getattr(self.registry.responses, op)(*args)

    async def _op_metrics(self, link: Link, own: dict[str, Any]) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The registry's figures, and every other front end's counts (as last read, if it does not answer in time)."""
        figures = {name: self.registry.figure(name) for name in Registry.FIGURES}
        self._last[link] = own  # (the asking front end's counts, as it shows them: kept, should it end)
        return figures, await self._counts(link)

    async def _counts(self, asking: Link | None = None) -> list[dict[str, Any]]:
        """The front ends' counts (but ``asking``'s), each asked now: one that
        does not answer in time counts as last read; one that ended as it last was."""
        others = [other for other in self._links if other is not asking]
        answers = await asyncio.gather(*(other.call("snapshot", timeout=METRICS_TIMEOUT_S) for other in others),
                                       return_exceptions=True)
        for other, answer in zip(others, answers):
            if isinstance(answer, dict):
                self._last[other] = answer
        return [self._last[o] for o in others if o in self._last] + self._retired

    async def _stats(self) -> _stats_log.Figures:
        engine = await in_thread(self.registry.llm.stats)
        return _stats_log.figures(await self._counts(), engine, len(self.registry),
                                  int(self.registry.figure("throwaway")))


def port_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A socket on ``host:port`` that others of this user's processes may
    bind too (SO_REUSEPORT): the hub's holds the port (bound, not listening:
    it takes no connection), each front end listens on its own, and the
    kernel spreads connections over the front ends evenly (a hash of each
    connection), where one shared listening socket would hand a burst of them
    to whichever process wakes first."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def serve(llm: RemoteLLM, package: str, workers: int, *, host: str, port: int, app_options: dict[str, Any],
          server_options: dict[str, Any]) -> None:
    """Runs the hub and ``workers`` front ends until told to stop (or the
    engine dies); then parks and returns. ``app_options``: create_app's (the
    registry's to the hub, the rest to every front end)."""
    from ._app import new_registry

    registry = new_registry(llm, **app_options)
    try:
        sock = port_socket(host, port, listen=False)
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    folder = tempfile.mkdtemp(prefix="aoti-sessions-hub-")  # (0700: the hub's socket is this user's alone)
    try:
        guard = _port_guard(sock.getsockname()[1])
        front = FrontEnd(package, llm.share(), os.path.join(folder, "hub.sock"), (host, sock.getsockname()[1]),
                         app_options, server_options, llm.engine_timeout, llm.step_timeout, llm.prompt_options)
        with guard:
            asyncio.run(_run(llm, front, workers, sock, registry))
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


class ServeError(RuntimeError):
    """The server cannot start as asked (said in one line, exit status 2)."""


TAKEN = "port {port} is taken by another aoti-sessions server with several front ends"


def holds_port(port: int) -> bool:
    """Whether a server of this user's with several front ends holds ``port``
    (its lock, :func:`_port_guard`'s, is taken)."""
    try:
        with open(_lock_path(port)) as lock:  # (taken and given back at once where free)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return False


def _lock_path(port: int) -> str:
    """The file whose lock holds ``port`` for one of this user's servers with several front ends."""
    return os.path.join(tempfile.gettempdir(), f"aoti-sessions-ports-{os.getuid()}", f"{port}.lock")


def _port_guard(port: int) -> Any:
    """An exclusive lock on ``port`` among this user's servers with several
    front ends: SO_REUSEPORT would let a second one bind the port beside the
    first and take half its connections; it is refused instead."""
    path = _lock_path(port)
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.stat(folder).st_uid != os.getuid() or os.stat(folder).st_mode & 0o077:
        raise ServeError(f"{folder} is not this user's private folder")
    lock = open(path, "w")  # noqa: SIM115 - held while the server runs
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ServeError(TAKEN.format(port=port)) from None
    return lock


async def _run(llm: RemoteLLM, front: FrontEnd, workers: int, sock: socket.socket, registry: Registry) -> None:
    hub = Hub(registry, front.hub, front.app_options.get("stats_interval"))
    await hub.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    threading.Thread(target=_when_ended, args=(llm, loop, stop), name="aoti-sessions-engine-death",
                     daemon=True).start()
    processes = [_start_front_end(front) for _ in range(workers)]
    started = [time.monotonic()] * workers
    print(f"aoti-sessions serve: {workers} front ends (pids {', '.join(str(p.pid) for p in processes)}) on "
          f"{sock.getsockname()[0]}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    early = 0  # front ends in a row that ended soon after they started (a start that cannot succeed)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), RESTART_DELAY_S * 2 ** min(early, 5))
            except asyncio.TimeoutError:
                pass
            for i, process in enumerate(processes):
                if process.poll() is None or stop.is_set():
                    continue
                early = early + 1 if time.monotonic() - started[i] < EARLY_END_S else 0
                if early >= EARLY_ENDS:
                    log.error("front ends keep ending as they start (the last, pid %d, with exit status %s): the "
                              "server stops", process.pid, process.returncode)
                    stop.set()
                    break
                log.error("front end (pid %d) ended with exit status %s: starting another", process.pid,
                          process.returncode)
                processes[i], started[i] = _start_front_end(front), time.monotonic()
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # (each finishes what it serves, then exits)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            try:
                await loop.run_in_executor(None, process.wait, max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                await loop.run_in_executor(None, process.wait)
        await hub.close()
        await registry.close()


def _when_ended(llm: RemoteLLM, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Stops the server once its engine process ended (died: the front ends stop too, by themselves)."""
    llm.wait_ended()
    try:
        loop.call_soon_threadsafe(stop.set)
    except RuntimeError:
        pass  # (the hub already stopped)


def _start_front_end(front: FrontEnd) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-m", "aoti_sessions.serve._front_main"], stdin=subprocess.PIPE)
    assert process.stdin is not None
    with process.stdin:
        process.stdin.write(pickle.dumps(front))
    return process


def front_end_main() -> int:
    """A front end's process: attached to the engine, the hub's registry, one
    uvicorn server on a listening socket of its own at the server's address."""
    import uvicorn

    from .._logs import configure_here
    from ..llm import RemoteLLM
    from ._app import create_app
    from ..llm.interface import SWITCH_INTERVAL_S
    from ._http import server_config, stop_when_the_engine_dies
    from ._shared import SharedRegistry

    front: FrontEnd = pickle.loads(sys.stdin.buffer.read())
    configure_here(logging.INFO)  # (as the command's own: uvicorn's loggers write through it)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Bound, not listening: uvicorn listens once the app has started (connected to the hub), so the
    # kernel hands this front end no connection before it can serve one.
    sock = port_socket(*front.address, listen=False)
    llm = RemoteLLM.attach(front.package, front.engine, engine_timeout=front.engine_timeout,
                           step_timeout=front.step_timeout, **front.prompt_options)
    try:
        servers: list[uvicorn.Server] = []

        def lost() -> None:  # (its link to the hub went: it stops, and the hub starts another)
            for server in servers:
                server.should_exit = True

        app = create_app(llm, shared=SharedRegistry(llm, front.hub, on_lost=lost), **front.app_options)
        server = uvicorn.Server(server_config(app, "127.0.0.1", 0, log_level="info", log_config=None,
                                              **front.server_options))
        servers.append(server)
        stop_when_the_engine_dies(llm, server)
        server.run(sockets=[sock])
    finally:
        llm.close()
    return 0
