"""A front end's view of the one session registry of a server with several
front ends (``aoti-sessions serve --api-workers N``, serve/_fleet.py).

Each front end is a process of its own (HTTP, templates, tokenizing, the
text of its requests' streams) attached to the one engine process
(RemoteLLM.attach); the registry of named sessions (serve/_sessions.py: ids
within tenants, busy flags, TTL parking, checkpoints, session files) lives in
the server's first process, the hub, and every front end asks it: a turn
twice (:meth:`SharedRegistry.acquire`: the id to the engine's session, held;
:meth:`SharedRegistry.release`: its token count, let go), a session endpoint
once. So any session id may arrive at any front end, and one request at a
time holds a session whichever front end it came to.

The hub and a front end talk over a :class:`Link`: a Unix socket in a folder
only this user may enter (0700), length-prefixed pickles, calls both ways
(the hub asks the front ends for their metrics when one is scraped, so
``/metrics`` is one view from any of them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import EngineProcessError
from ._response_store import RemoteResponses
from ._entry import Entry

if TYPE_CHECKING:
    from ..llm import RemoteLLM

log = logging.getLogger("aoti_sessions.serve")
_HEADER = struct.Struct("!I")
CALL_TIMEOUT_S = 600.0  # a hub call waits at most this (a save, a load of a big session: seconds)
METRICS_TIMEOUT_S = 5.0  # a front end that does not answer a scrape's question is left out of it


class LinkClosed(EngineProcessError):
    """The other end of a link went (the hub stopped, or a front end ended):
    for a request, the server is unavailable (503, as an engine gone)."""


Handler = Callable[..., Awaitable[Any]]


class Link:
    """Calls both ways over one stream: ``await call(op, *args)`` runs the
    other end's ``handlers[op](*args)`` and returns what it returns, or
    raises what it raised (pickled)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 handlers: dict[str, Handler]) -> None:
        self._reader, self._writer, self._handlers = reader, writer, handlers
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._reading = self._loop.create_task(self._read())

    async def call(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        if self.closed.is_set():
            raise LinkClosed(f"the link is closed ({op})")
        cid = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._waiting[cid] = future
        try:
            self._send(("call", cid, op, args))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiting.pop(cid, None)

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def _read(self) -> None:
        try:
            while True:
                size, = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
                message = pickle.loads(await self._reader.readexactly(size))
                if message[0] == "call":
                    task = self._loop.create_task(self._answer(*message[1:]))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    _, cid, ok, value = message
                    future = self._waiting.get(cid)
                    if future is not None and not future.done():
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except Exception:  # noqa: BLE001 - an unreadable message: the link is lost
            log.exception("unreadable message on a front end's link")
        finally:
            self.closed.set()
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(LinkClosed("the other end of the link went"))
            self._writer.close()

    async def _answer(self, cid: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            value, ok = await self._handlers[op](*args), True
        except Exception as e:  # noqa: BLE001 - the caller's to raise
            value, ok = _portable(e), False
        if not self.closed.is_set():
            self._send(("reply", cid, ok, value))

    async def close(self) -> None:
        self._writer.close()
        self.closed.set()
        self._reading.cancel()
        for task in list(self._tasks):
            task.cancel()


def _portable(error: BaseException) -> BaseException:
    from ..llm.interface import portable

    return portable(error)


@dataclass(eq=False)
class SharedEntry(Entry):
    """A session held by this front end (the hub's entry ``handle``), or one
    the hub described (``shown``)."""

    handle: int = 0
    shown: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        assert self.shown is not None, "a held session is described by the hub"
        return self.shown


class SharedRegistry:
    """The registry's API, asked of the hub (module docstring): what a
    front end's app (serve/_app.py) calls on a :class:`~._sessions.Registry`."""

    sweeps = False  # the hub parks idle sessions, not the front ends

    def __init__(self, llm: RemoteLLM, hub: str, on_lost: Callable[[], None] | None = None) -> None:
        self.llm = llm
        self._hub_path = hub
        self._on_lost = on_lost  # called if the link to the hub goes while this front end serves
        self._closing = False
        self._link: Link | None = None
        self._handles = itertools.count(1)  # a request's hold, named here (so that it can be let go unfinished)
        self._snapshot: Callable[[], dict[str, Any]] = dict
        # The hub's figures, as of the last scrape (what Registry keeps as attributes).
        self.shared: dict[str, float] = {}
        self.responses = RemoteResponses(self._call)  # the hub's stored responses (serve/_response_store.py)

    async def open(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Connects to the hub; ``snapshot``: this front end's metrics, when a scrape asks."""
        self._snapshot = snapshot
        reader, writer = await asyncio.open_unix_connection(self._hub_path)
        self._link = Link(reader, writer, {"snapshot": self._metrics_snapshot})
        self._watching = asyncio.get_running_loop().create_task(self._watch(self._link))

    async def _watch(self, link: Link) -> None:
        await link.closed.wait()
        if not self._closing and self._on_lost is not None:
            log.error("this front end lost its link to the server's registry: it stops (the server starts another)")
            self._on_lost()

    async def _metrics_snapshot(self) -> dict[str, Any]:
        return self._snapshot()

    async def _call(self, op: str, *args: Any) -> Any:
        if self._link is None:
            raise LinkClosed("this front end is not connected to the hub")
        return await self._link.call(op, *args)

    def __len__(self) -> int:
        return int(self.shared.get("named", 0))

    def figure(self, name: str) -> float:
        """One of the hub's figures (Registry.figure), as of the last scrape."""
        return float(self.shared.get(name, 0.0))

    async def acquire(self, tenant: str, session_id: str | None, *, create: bool,
                      prompt: list[int] | None = None, cache_key: str | None = None) -> Entry:
        handle = next(self._handles)
        try:
            sid, tokens = await self._call("acquire", handle, tenant, session_id, create, prompt, cache_key)
        except (asyncio.CancelledError, asyncio.TimeoutError, anyio.get_cancelled_exc_class()):
            # Given up waiting: the hub lets the session go once it has it (else it would stay busy).
            with anyio.CancelScope(shield=True):
                try:
                    await self._call("release", handle, None)
                except (LinkClosed, OSError):
                    pass  # (the hub lets go what a link that went held)
            raise
        entry = SharedEntry(session_id, tenant, handle=handle)
        entry.session = self.llm.session_of(sid, tokens)
        return entry

    async def release(self, entry: Entry) -> None:
        assert isinstance(entry, SharedEntry) and entry.session is not None
        with anyio.CancelScope(shield=True):  # (a cancelled request's session is let go all the same)
            await self._call("release", entry.handle, entry.session.token_count)
        entry.session = None

    async def lookup(self, tenant: str, session_id: str) -> Entry:
        return self._shown(await self._call("lookup", tenant, session_id))

    async def reset(self, tenant: str, session_id: str) -> Entry:
        return self._shown(await self._call("reset", tenant, session_id))

    async def fork(self, tenant: str, session_id: str, new_session_id: str | None) -> Entry:
        return self._shown(await self._call("fork", tenant, session_id, new_session_id))

    async def load(self, tenant: str, name: str, session_id: str | None) -> Entry:
        return self._shown(await self._call("load", tenant, name, session_id))

    async def delete(self, tenant: str, session_id: str) -> None:
        await self._call("delete", tenant, session_id)

    async def save(self, tenant: str, session_id: str, name: str) -> int:
        return int(await self._call("save", tenant, session_id, name))

    async def files(self, tenant: str) -> list[dict[str, Any]]:
        return list(await self._call("files", tenant))

    async def delete_file(self, tenant: str, name: str) -> None:
        await self._call("delete_file", tenant, name)

    async def listing(self, tenant: str) -> list[dict[str, Any]]:
        return list(await self._call("listing", tenant))

    async def peer_metrics(self) -> list[dict[str, Any]]:
        """The other front ends' metrics (and the hub's figures, kept here for this scrape)."""
        self.shared, others = await self._call("metrics", self._snapshot())
        return list(others)

    async def sweep(self) -> None:
        return None  # (the hub's)

    async def expire_idle(self) -> int:
        return 0  # (the hub's sweep)

    async def close(self) -> None:
        self._closing = True
        if self._link is not None:
            await self._link.close()

    @staticmethod
    def _shown(described: dict[str, Any]) -> Entry:
        return SharedEntry(described["id"], shown=described, busy=bool(described.get("busy")))
