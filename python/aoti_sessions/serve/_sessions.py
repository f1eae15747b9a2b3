"""The server's sessions: client-chosen ids mapped to the runtime's chat
sessions, each used by one request at a time.

All bookkeeping happens on the event loop's thread, so the table needs no
lock; the runtime's calls that may take a while (creating a session, which can
wait for an eviction, forking, saving, loading, closing) run in worker
threads, shielded from cancellation so that a client hanging up cannot leak a
session half made.
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    from ..llm import LLM, ChatSession, RemoteLLM, RemoteSession

T = TypeVar("T")

# A session file's name: a plain, visible file name inside --session-dir (short
# enough for the writer's temporary name beside it).
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


async def in_thread(call: Callable[[], T]) -> T:
    """Runs ``call`` in a worker thread; a cancelled caller still waits for it,
    so whatever it made or changed is accounted for."""
    with anyio.CancelScope(shield=True):
        result = await anyio.to_thread.run_sync(call)
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

    def describe(self) -> dict[str, Any]:
        resident = self.session is not None  # a busy session is on the device (or on its way)
        if self.session is not None and not self.busy:  # else a step may hold the session's lock
            self.tokens, resident = self.session.token_count, self.session.resident
        return {"id": self.id, "object": "session", "created": int(self.created), "tokens": self.tokens,
                "busy": self.busy, "resident": resident, "last_used": int(self.last_used)}


class Registry:
    """Named sessions, plus the throwaway ones of requests that name none."""

    def __init__(self, llm: LLM | RemoteLLM, session_dir: str | os.PathLike[str] | None = None) -> None:
        self.llm = llm
        self.session_dir = Path(session_dir).resolve() if session_dir is not None else None
        self._entries: dict[str, Entry] = {}
        self.throwaway = 0  # throwaway sessions alive now

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def get(self, session_id: str) -> Entry:
        entry = self._entries.get(session_id)
        if entry is None:
            raise APIError(404, f"no session {session_id!r}", "session_not_found", "session_id")
        return entry

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
        existing = self._entries.get(session_id)
        if existing is not None:
            return self._take(existing)
        if not create:
            self.get(session_id)  # raises the 404
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
            return
        session, entry.session = entry.session, None
        if session is not None:
            self.throwaway -= 1
            await in_thread(session.close)

    async def delete(self, session_id: str) -> None:
        entry = self._take(self.get(session_id))
        try:
            assert entry.session is not None
            await in_thread(entry.session.close)
        finally:
            del self._entries[session_id]

    @asynccontextmanager
    async def _held(self, session_id: str) -> AsyncIterator[tuple[Entry, ChatSession | RemoteSession]]:
        """The named session, held for one operation (409 while a request holds it)."""
        entry = self._take(self.get(session_id))
        try:
            assert entry.session is not None
            yield entry, entry.session
        finally:
            entry.busy = False

    async def reset(self, session_id: str) -> Entry:
        async with self._held(session_id) as (entry, session):
            await in_thread(session.reset)
        return entry

    async def fork(self, session_id: str, new_session_id: str | None) -> Entry:
        async with self._held(session_id) as (_, session):
            child = await self._add(new_session_id or new_id(), session.fork)
        child.busy = False
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
        """Closes every session (the server is stopping)."""
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            if entry.session is not None:
                await in_thread(entry.session.close)
