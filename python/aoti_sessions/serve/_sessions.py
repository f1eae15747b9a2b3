"""The server's sessions: client-chosen ids mapped to the runtime's chat
sessions, each used by one request at a time.

All bookkeeping happens on the event loop's thread, so the table needs no
lock; the runtime's calls that may take a while (creating a session, which can
wait for an eviction, forking, saving, loading, closing) run in worker
threads, shielded from cancellation so that a client hanging up cannot leak a
session half made.

A named session unused for ``ttl`` seconds is parked: with persistence (a
session dir), saved to ``SESSION_DIR/.live/ID`` and closed; without, closed.
A stopping server parks every named session the same way. A request naming a
parked session's id brings it back from its file, whatever the endpoint.

With checkpoints on (servers that share a session dir, e.g. the replicas of a
cluster), every change to a named session (a turn, a reset, a fork, a load)
is also written to its parked file in the background, once the session has
been left alone for ``CHECKPOINT_DELAY_S`` (a burst of turns, as an agent's
tool calls make, is written once, after it), at most ``CHECKPOINT_WRITERS``
at a time: the session stays in memory, held by the write only while its
state is copied out (``ChatSession.save``); a generation request for it goes
ahead while the file is written, other requests (a reset, a fork, a save, a
delete) wait for the write. The file is then the session's truth across
processes: a server that finds it changed since its own write (another
server served the session meanwhile) drops its copy and loads the file; one
that finds it gone (deleted elsewhere) drops its copy. (A generation that
comes while this server's own write is under way skips that check: the file
is its own, being replaced.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from ..errors import SessionFileError, SessionFileNotFoundError
from ._errors import APIError
from ._protocol import FILE_NAME_PATTERN, SESSION_ID_PATTERN

if TYPE_CHECKING:
    from ..llm import LLM, ChatSession, RemoteLLM, RemoteSession

T = TypeVar("T")

log = logging.getLogger("aoti_sessions.serve")
PARKED_DIR = ".live"  # in --session-dir: parked sessions (a name no client's file can take)
CHECKPOINT_DELAY_S = 0.05  # a session's checkpoint is written once it has been left alone this long
CHECKPOINT_WRITERS = 4  # checkpoint writes at once (each holds a host copy of a state; the rest wait their turn)

# A session file's name: a plain, visible file name inside --session-dir (short
# enough for the writer's temporary name beside it).
_FILE_NAME = re.compile(FILE_NAME_PATTERN)
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


async def in_thread(call: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Runs ``call`` in a worker thread (of ``limiter``'s, if given, else
    the shared ones); a cancelled caller still waits for it, so whatever it
    made or changed is accounted for."""
    with anyio.CancelScope(shield=True):
        result = await anyio.to_thread.run_sync(call, limiter=limiter)
    return result


def new_id() -> str:
    return f"sess-{uuid.uuid4().hex[:24]}"


@dataclass(eq=False)
class Entry:
    """One session of the server; ``id`` is None for a request's throwaway."""

    id: str | None
    session: ChatSession | RemoteSession | None = None  # None while being created
    busy: bool = True  # a request holds it (a generation, a fork, a save)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    tokens: int = 0  # in the cache, as of the last step when busy
    writing: asyncio.Event | None = None  # set when its checkpoint write ends
    changes: int = 0  # changes made to it (each to be checkpointed)
    written: tuple[int, int, int] | None = None  # its checkpoint file as this server last wrote or read it

    def describe(self) -> dict[str, Any]:
        resident = self.session is not None  # a busy session is on the device (or on its way)
        if self.session is not None and not self.busy:  # else a step may hold the session's lock
            self.tokens, resident = self.session.token_count, self.session.resident
        return {"id": self.id, "object": "session", "created": int(self.created), "tokens": self.tokens,
                "busy": self.busy, "resident": resident, "last_used": int(self.last_used)}


class Registry:
    """Named sessions, plus the throwaway ones of requests that name none."""

    def __init__(self, llm: LLM | RemoteLLM, session_dir: str | os.PathLike[str] | None = None, *,
                 ttl: float | None = None, persist: bool = False, checkpoint: bool = False) -> None:
        self.llm = llm
        self.session_dir = Path(session_dir).resolve() if session_dir is not None else None
        self._entries: dict[str, Entry] = {}
        self.throwaway = 0  # throwaway sessions alive now
        self.ttl = ttl
        self.parked: Path | None = None  # where parked sessions go (persistence on)
        if persist and self.session_dir is not None:
            self.parked = self.session_dir / PARKED_DIR
            self.parked.mkdir(exist_ok=True)
        if checkpoint and self.parked is None:
            raise ValueError("checkpoints need persistence: a session dir to keep them in")
        self.checkpoint = checkpoint
        self.expired = 0    # sessions parked or closed for their TTL
        self.unparked = 0   # parked sessions brought back
        self.checkpoints = 0  # checkpoint writes done
        self.checkpoint_failures = 0
        self.checkpoint_seconds = 0.0  # spent writing them (in the background)
        self.checkpoint_wait_seconds = 0.0  # requests spent waiting for a write to end
        self.superseded = 0  # copies dropped: their checkpoint changed or went elsewhere
        self._writes: set[asyncio.Task[None]] = set()
        self._writers: anyio.CapacityLimiter | None = None  # (made on the event loop)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def _missing(self, session_id: str) -> APIError:
        return APIError(404, f"no session {session_id!r}", "session_not_found", "session_id")

    async def lookup(self, session_id: str) -> Entry:
        """The named session (brought back if parked), or 404."""
        entry = await self._current(self._entries.get(session_id))
        if entry is None:
            entry = await self._unpark(session_id)
            if entry is None:
                raise self._missing(session_id)
            entry.busy = False
        return entry

    def _parked_file(self, session_id: str) -> Path | None:
        """Where session ``session_id`` is parked, if it is (an id no client
        could create never is)."""
        if self.parked is None or not _SESSION_ID.fullmatch(session_id):
            return None
        path = self.parked / session_id
        return path if path.is_file() else None

    async def _unpark(self, session_id: str) -> Entry | None:
        """A parked session back in memory, held; its file goes. None if it
        is not parked, or its file cannot be loaded (set aside as NAME.bad,
        with a log line: the id then starts afresh)."""
        path = self._parked_file(session_id)
        if path is None:
            return None
        written = _signature(path)
        try:
            entry = await self._add(session_id, lambda: self.llm.load_session(path))
        except SessionFileError as e:
            log.warning("parked session %r cannot be loaded (%s); set aside as %s.bad", session_id, e, path.name)
            os.replace(path, path.with_name(path.name + ".bad"))
            return None
        if self.checkpoint:
            entry.written = written  # the checkpoint stays: it is the session's truth
        else:
            path.unlink(missing_ok=True)  # in memory again; parked anew when it goes
        self.unparked += 1
        return entry

    async def _current(self, entry: Entry | None, *, wait: bool = True) -> Entry | None:
        """``entry`` once its checkpoint write (if any) has ended, or at
        once with ``wait`` False (a generation: the session runs on while
        the write goes on); with checkpoints, None when its file changed or
        went since this server wrote or read it (the stale copy is closed
        and out of the table)."""
        if entry is None:
            return None
        if not wait and entry.writing is not None:
            return entry  # (the file is this server's, being replaced: nothing to check)
        if entry.writing is not None:
            started = time.perf_counter()
            while entry.writing is not None:
                await entry.writing.wait()
            self.checkpoint_wait_seconds += time.perf_counter() - started
        if not self.checkpoint or entry.busy or entry.id is None or entry.session is None:
            return entry
        assert self.parked is not None
        if _signature(self.parked / entry.id) == entry.written:
            return entry
        log.info("session %r changed elsewhere since this server last wrote it: its copy here is dropped", entry.id)
        session, entry.session = entry.session, None
        self._entries.pop(entry.id, None)
        self.superseded += 1
        await in_thread(session.close)
        return None

    def checkpoint_soon(self, entry: Entry) -> None:
        """With checkpoints: named ``entry`` changed; its state is written to
        its parked file in the background once it has been left alone for
        ``CHECKPOINT_DELAY_S`` (a change meanwhile writes it after that one)."""
        if not self.checkpoint or entry.id is None or entry.session is None:
            return
        entry.changes += 1
        task = asyncio.get_running_loop().create_task(self._write_later(entry, entry.changes))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_later(self, entry: Entry, change: int) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_DELAY_S)
            if entry.changes != change or entry.session is None or self._entries.get(entry.id or "") is not entry:
                return  # changed again (that change writes it), or gone
            if not entry.busy and entry.writing is None:
                break  # (held by a request that does not change it, a save: after it)
        entry.writing = asyncio.Event()
        assert self.parked is not None and entry.id is not None
        path, session = self.parked / entry.id, entry.session
        if self._writers is None:
            self._writers = anyio.CapacityLimiter(CHECKPOINT_WRITERS)

        took = [0.0]  # the write's seconds, timed on its thread (the wait for a writer is not the write's)

        def write() -> None:
            started = time.perf_counter()
            try:
                session.save(path)
            finally:
                took[0] = time.perf_counter() - started

        try:
            await in_thread(write, self._writers)
            entry.written = _signature(path)
            self.checkpoints += 1
        except Exception as e:  # noqa: BLE001 - the session serves on; its last good checkpoint stays
            self.checkpoint_failures += 1
            log.warning("session %r: writing its checkpoint failed: %s", entry.id, e)
        finally:
            self.checkpoint_seconds += took[0]
            done, entry.writing = entry.writing, None
            assert done is not None
            done.set()

    async def _park(self, entry: Entry, why: str) -> bool:
        """Saves a held named session to its parked file (persistence on)
        and closes it; out of the table. Whether it was saved: a failed save
        is logged, and the session closed all the same."""
        assert entry.id is not None and entry.session is not None
        session = entry.session
        saved = False
        if self.parked is not None:
            path = self.parked / entry.id
            try:
                await in_thread(lambda: session.save(path))
                saved = True
            except Exception as e:  # noqa: BLE001 - one session's failure must not stop the others'
                log.warning("session %r could not be parked (%s): %s; it is closed", entry.id, why, e)
        self._entries.pop(entry.id, None)
        entry.session = None
        try:
            await in_thread(session.close)
        except Exception as e:  # noqa: BLE001 - (its engine gone: nothing left to free)
            log.warning("session %r: closing it failed: %s", entry.id, e)
        return saved

    async def expire_idle(self) -> int:
        """Parks every named session unused for ``ttl`` seconds (not one a
        request holds); returns how many."""
        if self.ttl is None or not self.llm.alive:
            return 0  # (an engine that does not answer would fail every park: the next sweep's)
        cutoff = time.time() - self.ttl

        def idle(e: Entry) -> bool:
            return not e.busy and e.writing is None and e.session is not None and e.last_used < cutoff \
                and e.id is not None and self._entries.get(e.id) is e

        parked = 0
        for entry in [e for e in self._entries.values() if idle(e)]:
            # Checked again: parking the ones before it let requests in, which
            # may have taken this one (parking it would close their generation).
            if idle(entry):
                entry.busy = True
                await self._park(entry, f"idle for {self.ttl:g} s")
                self.expired += 1
                parked += 1
        return parked

    def _take(self, entry: Entry) -> Entry:
        if entry.busy:
            raise APIError(409, f"session {entry.id!r} is busy with another request; retry when it is done",
                           "session_busy", "session_id")
        entry.busy = True
        entry.last_used = time.time()
        return entry

    async def acquire(self, session_id: str | None, *, create: bool) -> Entry:
        """The session ``session_id`` held for this request (409 when another
        request holds it). An unknown id is created when ``create``, else 404;
        None is a throwaway session, closed by :meth:`release`."""
        if session_id is None:
            entry = Entry(None)
            entry.session = await in_thread(self.llm.new_session)
            self.throwaway += 1
            return entry
        existing = await self._current(self._entries.get(session_id), wait=False)
        if existing is not None:
            return self._take(existing)
        parked = await self._unpark(session_id)
        if parked is not None:
            return parked
        if not create:
            raise self._missing(session_id)
        return await self._add(session_id, self.llm.new_session)

    async def _add(self, session_id: str, make: Callable[[], ChatSession | RemoteSession]) -> Entry:
        """A new entry, held, under an id checked free; made in a thread (its
        placeholder makes a concurrent request for the id wait its turn: 409)."""
        if session_id in self._entries:
            raise APIError(409, f"session {session_id!r} already exists", "session_exists", "session_id")
        entry = self._entries[session_id] = Entry(session_id)
        try:
            entry.session = await in_thread(make)
        except BaseException:
            del self._entries[session_id]
            raise
        return entry

    async def release(self, entry: Entry) -> None:
        """Ends a request's hold; a throwaway session is closed."""
        entry.last_used = time.time()
        if entry.id is not None:
            entry.busy = False
            self.checkpoint_soon(entry)
            return
        session, entry.session = entry.session, None
        if session is not None:
            self.throwaway -= 1
            await in_thread(session.close)

    async def delete(self, session_id: str) -> None:
        if session_id not in self._entries and (parked := self._parked_file(session_id)) is not None:
            parked.unlink(missing_ok=True)
            return
        entry = self._take(await self.lookup(session_id))
        try:
            assert entry.session is not None
            await in_thread(entry.session.close)
        finally:
            del self._entries[session_id]
            if self.checkpoint and (parked := self._parked_file(session_id)) is not None:
                parked.unlink(missing_ok=True)  # (else another server would bring it back)

    @asynccontextmanager
    async def _held(self, session_id: str) -> AsyncIterator[tuple[Entry, ChatSession | RemoteSession]]:
        """The named session, held for one operation (409 while a request holds it)."""
        entry = self._take(await self.lookup(session_id))
        try:
            assert entry.session is not None
            yield entry, entry.session
        finally:
            entry.busy = False

    async def reset(self, session_id: str) -> Entry:
        async with self._held(session_id) as (entry, session):
            await in_thread(session.reset)
        self.checkpoint_soon(entry)
        return entry

    async def fork(self, session_id: str, new_session_id: str | None) -> Entry:
        async with self._held(session_id) as (_, session):
            child = await self._add(new_session_id or new_id(), session.fork)
        child.busy = False
        self.checkpoint_soon(child)
        return child

    def file(self, name: str) -> Path:
        """``name`` as a file of the session directory: a plain visible file
        name, nothing a client could point elsewhere with (400)."""
        if self.session_dir is None:
            raise APIError(400, "saving and loading sessions is off: start the server with --session-dir DIR",
                           "session_dir_not_set", "name")
        if (not _FILE_NAME.fullmatch(name) or name in (".", "..") or ".." in name
                or os.path.basename(name) != name):
            raise APIError(400, f"invalid session file name {name!r}: a plain file name of letters, digits, "
                                "'.', '_' and '-', not starting with '.' or '-', without '..'",
                           "invalid_name", "name")
        return self.session_dir / name

    async def save(self, session_id: str, name: str) -> Path:
        path = self.file(name)
        async with self._held(session_id) as (_, session):
            with self._file_errors("save the session as", name, path):
                await in_thread(lambda: session.save(path))
        return path

    async def load(self, name: str, session_id: str | None) -> Entry:
        path = self.file(name)
        if not path.is_file():
            raise APIError(404, f"no session file {name!r}", "file_not_found", "name")
        with self._file_errors("load the session file", name, path):
            entry = await self._add(session_id or new_id(), lambda: self.llm.load_session(path))
        entry.busy = False
        self.checkpoint_soon(entry)
        return entry

    @contextmanager
    def _file_errors(self, doing: str, name: str, path: Path) -> Iterator[None]:
        """A session file's failure as a 400 that names the file as the
        client did: no server path in the answer."""
        try:
            yield
        except SessionFileError as e:
            assert self.session_dir is not None
            message = str(e).replace(str(path), repr(name)).replace(str(self.session_dir), "--session-dir")
            if isinstance(e, SessionFileNotFoundError):
                raise APIError(404, f"no session file {name!r}", "file_not_found", "name") from e
            raise APIError(400, f"cannot {doing} {name!r}: {message}", "invalid_session_file", "name") from e

    async def close(self) -> None:
        """The server is stopping: parks every named session (saved, with
        persistence on), closes the rest."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        entries = list(self._entries.values())
        parked = 0
        for entry in entries:
            if entry.session is None:
                continue
            if entry.id is not None and self.parked is not None:
                parked += await self._park(entry, "the server is stopping")
            else:
                await in_thread(entry.session.close)
        self._entries = {}
        if parked:
            log.info("parked %d sessions in %s: a server started with this --session-dir serves them on",
                     parked, self.parked)


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells one write of a file from another (each write is a new file
    renamed into place): inode, size, modification time; None if absent."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
