"""The server's sessions: client-chosen ids mapped to the runtime's chat
sessions, each used by one request at a time.

All bookkeeping happens on the event loop's thread, so the table needs no
lock; the runtime's calls that may take a while (creating a session, which can
wait for an eviction, forking, saving, loading, closing) run in worker
threads, shielded from cancellation so that a client hanging up cannot leak a
session half made.

A request without a session id gets a throwaway session from the LLM's
prefix cache (llm/_prefix.py), in its tenant's namespace: a fork of the
kept session sharing the longest start with its prompt, kept there itself
when the request ends.

A named session unused for ``ttl`` seconds is parked: with persistence (a
session dir), saved to ``SESSION_DIR/.live/ID`` and closed; without, closed.
A stopping server parks every named session the same way, and a request
that finds the engine full (CapacityError: its ``max_sessions``, or its
memory) parks an idle one to make room (:meth:`Registry._made`): a stored
response's first (below), then with persistence the least recently used. A
request naming a parked session's id brings it back from its file, whatever
the endpoint.

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

Sessions belong to tenants (serve/_tenants.py): a table key, a parked file
and a session file are the tenant's own; every method takes the tenant of
the request, and another tenant's session or file is absent to it. A
tenant's saved files are bounded in count and bytes (403 past them).

The sessions of stored responses (serve/_response_store.py) are caches: where
the engine has no room for a new session, the least recently used idle one
is parked (without persistence: closed) to make some, before any 429.

A park that fails (a full disk) keeps the session in memory, usable, and
the next sweep tries again; such failures, and failed checkpoint writes,
are logged once an episode (the first failure, then one line when writing
works again), and counted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import CapacityError, SessionClosedError, SessionFileError, SessionFileNotFoundError
from ._errors import APIError
from ._limits import DEFAULT_MAX_SESSION_FILES, DEFAULT_MAX_SESSION_FILES_BYTES
from ._protocol import FILE_NAME_PATTERN, SESSION_ID_PATTERN
from ._response_store import ResponseStore
from ._tenants import DEFAULT_TENANT, TENANTS_DIR, cache_namespace, scoped
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedLLM, ServedSession

log = logging.getLogger("aoti_sessions.serve")
PARKED_DIR = ".live"  # in --session-dir: parked sessions (a name no client's file can take)
CHECKPOINT_DELAY_S = 0.05  # a session's checkpoint is written once it has been left alone this long
CHECKPOINT_WRITERS = 4  # checkpoint writes at once (each holds a host copy of a state; the rest wait their turn)

# A session file's name: a plain, visible file name inside --session-dir (short
# enough for the writer's temporary name beside it).
_FILE_NAME = re.compile(FILE_NAME_PATTERN)
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
# The writer's temporary file beside a session file (csrc/core/atomic_file.cc):
# its name carries the server's pid, kept out of answers.
_TEMPORARY = re.compile(r"\S*\.aoti-tmp-\d+-\d+")
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def new_id() -> str:
    return f"sess-{uuid.uuid4().hex[:24]}"


@dataclass(eq=False)
class Entry:
    """One session of the server; ``id`` is None for a request's throwaway."""

    id: str | None
    tenant: str = DEFAULT_TENANT  # whose it is (serve/_tenants.py)
    session: ServedSession | None = None  # None while being created
    busy: bool = True  # a request holds it (a generation, a fork, a save)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    tokens: int = 0  # in the cache, as of the last step when busy
    writing: asyncio.Event | None = None  # set when its checkpoint write ends
    changes: int = 0  # changes made to it (each to be checkpointed)
    written: tuple[int, int, int] | None = None  # its checkpoint file as this server last wrote or read it

    @property
    def key(self) -> str:
        """Its key in the server's table (and the cluster's router): its id within its tenant."""
        assert self.id is not None
        return scoped(self.tenant, self.id)

    def describe(self) -> dict[str, Any]:
        resident = self.session is not None  # a busy session is on the device (or on its way)
        if self.session is not None and not self.busy:  # else a step may hold the session's lock
            self.tokens, resident = self.session.token_count, self.session.resident
        return {"id": self.id, "object": "session", "created": int(self.created), "tokens": self.tokens,
                "busy": self.busy, "resident": resident, "last_used": int(self.last_used)}


class Registry:
    """Named sessions, plus the throwaway ones of requests that name none."""

    def __init__(self, llm: ServedLLM, session_dir: str | os.PathLike[str] | None = None, *,
                 ttl: float | None = None, persist: bool = False, checkpoint: bool = False,
                 max_files: int = DEFAULT_MAX_SESSION_FILES,
                 max_file_bytes: int = DEFAULT_MAX_SESSION_FILES_BYTES) -> None:
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
        self.park_failures = 0  # parks that failed (the session kept in memory, or lost when stopping)
        self.parked_for_room = 0  # idle sessions parked to make room for another
        self._parking, self._checkpointing = _Failures("parking sessions"), _Failures("writing checkpoints")
        self._saving_out_of_space = _Failures("saving session files")
        self.max_files, self.max_file_bytes = max_files, max_file_bytes  # a tenant's saved session files
        self._saving: dict[str, asyncio.Lock] = {}  # a tenant's saves, one at a time (each checks the limits)
        self._writes: set[asyncio.Task[None]] = set()
        self._writers: anyio.CapacityLimiter | None = None  # (made on the event loop)
        # Stored responses of /v1/responses (serve/_response_store.py): parked with the sessions, beside them.
        self.responses = ResponseStore(self._home if self.parked is not None else None)

    sweeps = True  # its sessions idle past their TTL are parked by its own sweep (sweep, expire_idle)
    # Its figures for /metrics (figure): counts kept as attributes, and ``named``.
    FIGURES = ("named", "throwaway", "expired", "unparked", "park_failures", "parked_for_room", "checkpoints",
               "checkpoint_failures", "checkpoint_seconds", "checkpoint_wait_seconds", "superseded")

    def __len__(self) -> int:
        return len(self._entries)

    def figure(self, name: str) -> float:
        """One of its counts for /metrics (``expired``, ``unparked``, ...; ``named``: len)."""
        return float(len(self) if name == "named" else getattr(self, name))

    async def open(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """(A registry shared by several front ends connects here: serve/_shared.py.)"""

    async def peer_metrics(self) -> list[dict[str, Any]]:
        """Other front ends' metrics, to sum with this one's (none: it is the only one)."""
        return []

    async def listing(self, tenant: str) -> list[dict[str, Any]]:
        """``tenant``'s named sessions in memory, described (GET /v1/sessions)."""
        return await described(self.entries(tenant))

    def entries(self, tenant: str | None = None) -> list[Entry]:
        """The named sessions in memory (of ``tenant`` only, if given)."""
        return [e for e in self._entries.values() if tenant is None or e.tenant == tenant]

    def _missing(self, session_id: str) -> APIError:
        return APIError(404, f"no session {session_id!r}", "session_not_found", "session_id")

    async def lookup(self, tenant: str, session_id: str) -> Entry:
        """The named session (brought back if parked), or 404."""
        entry = await self._current(self._entries.get(scoped(tenant, session_id)))
        if entry is None:
            entry = await self._unpark(tenant, session_id)
            if entry is None:
                raise self._missing(session_id)
            entry.busy = False
        return entry

    def _home(self, tenant: str) -> Path:
        """The folder of ``tenant``'s session files (its parked ones in ``.live`` inside)."""
        assert self.session_dir is not None
        return self.session_dir if tenant == DEFAULT_TENANT else self.session_dir / TENANTS_DIR / tenant

    def _parked_path(self, tenant: str, session_id: str) -> Path:
        return self._home(tenant) / PARKED_DIR / session_id

    def _parked_file(self, tenant: str, session_id: str) -> Path | None:
        """Where session ``session_id`` is parked, if it is (an id no client
        could create never is)."""
        if self.parked is None or not _SESSION_ID.fullmatch(session_id):
            return None
        path = self._parked_path(tenant, session_id)
        return path if path.is_file() else None

    async def _unpark(self, tenant: str, session_id: str) -> Entry | None:
        """A parked session back in memory, held; its file goes. None if it
        is not parked, or its file cannot be loaded (set aside as NAME.bad,
        with a log line: the id then starts afresh)."""
        path = self._parked_file(tenant, session_id)
        if path is None:
            return None
        written = _signature(path)
        try:
            entry = await self._add(tenant, session_id, lambda: self.llm.load_session(path), unparking=True)
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
        if _signature(self._parked_path(entry.tenant, entry.id)) == entry.written:
            return entry
        log.info("session %r changed elsewhere since this server last wrote it: its copy here is dropped", entry.id)
        session, entry.session = entry.session, None
        self._entries.pop(entry.key, None)
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
            if entry.changes != change or entry.session is None or self._entries.get(entry.key) is not entry:
                return  # changed again (that change writes it), or gone
            if not entry.busy and entry.writing is None:
                break  # (held by a request that does not change it, a save: after it)
        entry.writing = asyncio.Event()
        assert self.parked is not None and entry.id is not None
        path, session = self._parked_path(entry.tenant, entry.id), entry.session
        if self._writers is None:
            self._writers = anyio.CapacityLimiter(CHECKPOINT_WRITERS)

        took = [0.0]  # the write's seconds, timed on its thread (the wait for a writer is not the write's)

        def write() -> None:
            started = time.perf_counter()
            try:
                _save(session, path)
            finally:
                took[0] = time.perf_counter() - started

        try:
            await in_thread(write, self._writers)
            entry.written = _signature(path)
            self.checkpoints += 1
            self._checkpointing.succeeded()
        except Exception as e:  # noqa: BLE001 - the session serves on; its last good checkpoint stays
            self.checkpoint_failures += 1
            self._checkpointing.failed(f"session {entry.id!r}: writing its checkpoint failed: {_why(e)}")
        finally:
            self.checkpoint_seconds += took[0]
            done, entry.writing = entry.writing, None
            assert done is not None
            done.set()

    async def _park(self, entry: Entry, why: str, *, keep: bool = True) -> bool:
        """Saves a held named session to its parked file (persistence on)
        and closes it; out of the table. Whether it was saved. A save that
        fails (a full disk) keeps the session in memory and released, to be
        parked at a later sweep, if ``keep`` (False: the server is stopping,
        and the session is closed all the same)."""
        assert entry.id is not None and entry.session is not None
        session = entry.session
        saved = False
        if self.parked is not None:
            path = self._parked_path(entry.tenant, entry.id)
            try:
                await in_thread(lambda: _save(session, path))
                saved = True
                self._parking.succeeded()
            except Exception as e:  # noqa: BLE001 - one session's failure must not stop the others'
                self.park_failures += 1
                self._parking.failed(f"session {entry.id!r} could not be parked ({why}): {_why(e)}; "
                                     + ("it stays in memory, and a later sweep parks it" if keep else "it is closed"))
                if keep:
                    entry.busy = False
                    return False
        self._entries.pop(entry.key, None)
        entry.session = None
        try:
            await in_thread(session.close)
        except Exception as e:  # noqa: BLE001 - (its engine gone: nothing left to free)
            log.warning("session %r: closing it failed: %s", entry.id, e)
        return saved

    async def sweep(self) -> None:
        """Parks the sessions idle past their TTL, every quarter TTL (a minute at most), until cancelled."""
        if self.ttl is None:
            return
        while True:
            await anyio.sleep(min(60.0, self.ttl / 4))
            try:
                await self.expire_idle()
            except Exception:  # noqa: BLE001 - the sweep goes on
                log.exception("parking idle sessions failed")

    async def expire_idle(self) -> int:
        """Parks every named session unused for ``ttl`` seconds (not one a
        request holds); returns how many."""
        if self.ttl is None or not self.llm.alive:
            return 0  # (an engine that does not answer would fail every park: the next sweep's)
        cutoff = time.time() - self.ttl
        self.responses.expire(cutoff)

        def idle(e: Entry) -> bool:
            return self._idle(e) and e.last_used < cutoff

        parked = 0
        for entry in [e for e in self._entries.values() if idle(e)]:
            # Checked again: parking the ones before it let requests in, which
            # may have taken this one (parking it would close their generation).
            if idle(entry):
                entry.busy = True
                await self._park(entry, f"idle for {self.ttl:g} s")
                if entry.session is None:  # (a park that failed kept it in memory)
                    self.expired += 1
                    parked += 1
        return parked

    def _idle(self, e: Entry) -> bool:
        """Whether named ``e`` may be parked now: in memory, in the table, and no request or write holds it."""
        return not e.busy and e.writing is None and e.session is not None and e.id is not None \
            and self._entries.get(e.key) is e

    def _take(self, entry: Entry) -> Entry:
        if entry.busy:
            raise APIError(409, f"session {entry.id!r} is busy with another request; retry when it is done",
                           "session_busy", "session_id")
        entry.busy = True
        entry.last_used = time.time()
        return entry

    async def acquire(self, tenant: str, session_id: str | None, *, create: bool,
                      prompt: list[int] | None = None, cache_key: str | None = None) -> Entry:
        """The session ``session_id`` of ``tenant`` held for this request (409
        when another request holds it). An unknown id is created when
        ``create``, else 404; None is a throwaway session, from the LLM's
        prefix cache in the tenant's namespace (with ``cache_key``, the
        request's ``prompt_cache_key``: serve/_tenants.py), started from
        the kept session sharing the longest start with ``prompt`` (its
        token ids), and kept there by :meth:`release`."""
        if session_id is None:
            entry = Entry(None)
            namespace = cache_namespace(tenant, cache_key)
            entry.session = await self._made(lambda: self.llm.new_session(prompt, cache=namespace))
            self.throwaway += 1
            return entry
        existing = await self._current(self._entries.get(scoped(tenant, session_id)), wait=False)
        if existing is not None:
            return self._take(existing)
        parked = await self._unpark(tenant, session_id)
        if parked is not None:
            return parked
        if not create:
            raise self._missing(session_id)
        return await self._add(tenant, session_id, self.llm.new_session)

    async def _add(self, tenant: str, session_id: str, make: Callable[[], ServedSession], *,
                   unparking: bool = False) -> Entry:
        """A new entry, held, under an id checked free, in memory and (unless
        ``unparking`` it) parked; made in a thread (its placeholder makes a
        concurrent request for the id wait its turn: 409)."""
        key = scoped(tenant, session_id)
        if key in self._entries or (not unparking and self._parked_file(tenant, session_id) is not None):
            raise APIError(409, f"session {session_id!r} already exists", "session_exists", "session_id")
        entry = self._entries[key] = Entry(session_id, tenant)
        try:
            entry.session = await self._made(make)
        except BaseException:
            del self._entries[key]
            raise
        return entry

    async def _made(self, make: Callable[[], ServedSession]) -> ServedSession:
        """A new session from ``make()`` (created, loaded, forked), in a
        thread. While the engine has no room for it, an idle session is
        parked (as the TTL sweep parks it: the next request naming it brings
        it back) and ``make`` tried again: the least recently used of stored
        responses' (caches: serve/_response_store.py; without persistence
        closed) first, then, with persistence, of any named one."""
        while True:
            try:
                return await in_thread(make)
            except CapacityError as e:
                idle = [entry for entry in self._entries.values() if self._idle(entry) and (
                    self.parked is not None or self.responses.holds(entry.tenant, entry.id or ""))]
                if not idle:
                    if self.parked is None and any(self._idle(entry) for entry in self._entries.values()):
                        raise CapacityError(f"{e} (idle named sessions make room only where they persist: a "
                                            "server started with --session-dir parks them)") from e
                    raise
                victim = min(idle, key=lambda entry: (not self.responses.holds(entry.tenant, entry.id or ""),
                                                      entry.last_used))
                victim.busy = True
                await self._park(victim, "to make room for another")
                if victim.session is not None:  # (its park failed: it stays in memory, and this request gets 429)
                    raise
                self.parked_for_room += 1

    async def release(self, entry: Entry) -> None:
        """Ends a request's hold; a throwaway session is closed (kept in the
        prefix cache: llm/_prefix.py)."""
        entry.last_used = time.time()
        if entry.id is not None:
            entry.busy = False
            self.checkpoint_soon(entry)
            return
        session, entry.session = entry.session, None
        if session is not None:
            self.throwaway -= 1
            await in_thread(session.close)

    async def delete(self, tenant: str, session_id: str) -> None:
        key = scoped(tenant, session_id)
        if key not in self._entries and (parked := self._parked_file(tenant, session_id)) is not None:
            parked.unlink(missing_ok=True)
            return
        entry = self._take(await self.lookup(tenant, session_id))
        try:
            assert entry.session is not None
            await in_thread(entry.session.close)
        finally:
            del self._entries[key]
            if self.checkpoint and (parked := self._parked_file(tenant, session_id)) is not None:
                parked.unlink(missing_ok=True)  # (else another server would bring it back)

    @asynccontextmanager
    async def _held(self, tenant: str, session_id: str) -> AsyncIterator[tuple[Entry, ServedSession]]:
        """The named session, held for one operation (409 while a request holds it)."""
        entry = self._take(await self.lookup(tenant, session_id))
        try:
            assert entry.session is not None
            yield entry, entry.session
        finally:
            entry.busy = False

    async def reset(self, tenant: str, session_id: str) -> Entry:
        async with self._held(tenant, session_id) as (entry, session):
            await in_thread(session.reset)
        self.checkpoint_soon(entry)
        return entry

    async def fork(self, tenant: str, session_id: str, new_session_id: str | None) -> Entry:
        async with self._held(tenant, session_id) as (_, session):
            child = await self._add(tenant, new_session_id or new_id(), session.fork)
        child.busy = False
        self.checkpoint_soon(child)
        return child

    def _files_on(self) -> None:
        if self.session_dir is None:
            raise APIError(400, "saving and loading sessions is off: start the server with --session-dir DIR",
                           "session_dir_not_set", "name")

    def file(self, tenant: str, name: str) -> Path:
        """``name`` as a file of ``tenant``'s in the session directory: a
        plain visible file name, nothing a client could point elsewhere with
        (400)."""
        self._files_on()
        if (not _FILE_NAME.fullmatch(name) or name in (".", "..") or ".." in name
                or os.path.basename(name) != name):
            raise APIError(400, f"invalid session file name {name!r}: a plain file name of letters, digits, "
                                "'.', '_' and '-', not starting with '.' or '-', without '..'",
                           "invalid_name", "name")
        return self._home(tenant) / name

    def _files(self, tenant: str) -> list[tuple[str, os.stat_result]]:
        """``tenant``'s session files: (name, stat) of each plain file a
        client could have named."""
        try:
            found = list(os.scandir(self._home(tenant)))
        except FileNotFoundError:
            return []
        out = []
        for item in found:
            if _FILE_NAME.fullmatch(item.name) and ".." not in item.name:
                try:
                    if item.is_file(follow_symlinks=False):
                        out.append((item.name, item.stat(follow_symlinks=False)))
                except OSError:
                    pass  # (gone meanwhile)
        return sorted(out)

    async def files(self, tenant: str) -> list[dict[str, Any]]:
        """``tenant``'s session files, as ``GET /v1/session-files`` lists them."""
        self._files_on()
        return [{"name": name, "object": "session_file", "bytes": st.st_size, "modified": int(st.st_mtime)}
                for name, st in await in_thread(lambda: self._files(tenant))]

    async def delete_file(self, tenant: str, name: str) -> None:
        path = self.file(tenant, name)

        def delete() -> bool:
            try:
                if not stat.S_ISREG(path.lstat().st_mode):
                    return False  # (not a file a client saved)
                path.unlink()
            except FileNotFoundError:
                return False
            return True

        if not await in_thread(delete):
            raise APIError(404, f"no session file {name!r}", "file_not_found", "name")

    def _check_room(self, tenant: str, name: str) -> None:
        """403 when ``tenant``'s session files are at the server's limits
        (their count, or their bytes: a save that starts under it may end
        past it by its own size); a file of the same name counts as replaced."""
        others = [st.st_size for file, st in self._files(tenant) if file != name]
        if len(others) >= self.max_files:
            raise APIError(403, f"cannot save the session as {name!r}: your saved sessions are {len(others)} files, "
                                f"the server's limit; delete one (DELETE /v1/session-files/NAME) or save over one",
                           "session_files_limit", "name")
        if sum(others) >= self.max_file_bytes:
            raise APIError(403, f"cannot save the session as {name!r}: your saved sessions hold {sum(others)} bytes, "
                                f"the server's limit is {self.max_file_bytes}; delete some "
                                "(DELETE /v1/session-files/NAME)", "session_files_limit", "name")

    async def save(self, tenant: str, session_id: str, name: str) -> int:
        """Saves the session as ``tenant``'s file ``name``; its bytes."""
        path = self.file(tenant, name)
        async with self._saving.setdefault(tenant, asyncio.Lock()):
            async with self._held(tenant, session_id) as (_, session):
                with self._file_errors("save the session as", name, path):
                    await in_thread(lambda: self._check_room(tenant, name))
                    await in_thread(lambda: _save(session, path))
            self._saving_out_of_space.succeeded()
            return path.stat().st_size

    async def load(self, tenant: str, name: str, session_id: str | None) -> Entry:
        path = self.file(tenant, name)
        if not path.is_file():
            raise APIError(404, f"no session file {name!r}", "file_not_found", "name")
        with self._file_errors("load the session file", name, path):
            entry = await self._add(tenant, session_id or new_id(), lambda: self.llm.load_session(path))
        entry.busy = False
        self.checkpoint_soon(entry)
        return entry

    @contextmanager
    def _file_errors(self, doing: str, name: str, path: Path) -> Iterator[None]:
        """A session file's failure as a 400 that names the file as the
        client did: no server path or temporary name in the answer; the
        server out of space, 507."""
        try:
            yield
        except (SessionFileError, OSError) as e:
            if out_of_space(e):
                self._saving_out_of_space.failed(f"cannot {doing} {name!r}: {_why(e)}")
                raise APIError(507, f"cannot {doing} {name!r}: the server is out of space for session files; try "
                                    "again later", "out_of_space", "name") from e
            if not isinstance(e, SessionFileError):
                raise
            assert self.session_dir is not None
            message = _TEMPORARY.sub("a temporary file", str(e).replace(str(path), repr(name)))
            message = message.replace(str(path.parent), "--session-dir").replace(str(self.session_dir),
                                                                                 "--session-dir")
            if isinstance(e, SessionFileNotFoundError):
                raise APIError(404, f"no session file {name!r}", "file_not_found", "name") from e
            raise APIError(400, f"cannot {doing} {name!r}: {message}", "invalid_session_file", "name") from e

    async def close(self) -> None:
        """The server is stopping: parks every named session (saved, with
        persistence on), closes the rest."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        entries = list(self._entries.values())
        parked = lost = 0
        for entry in entries:
            if entry.session is None:
                continue
            if entry.id is not None and self.parked is not None:
                if await self._park(entry, "the server is stopping", keep=False):
                    parked += 1
                else:
                    lost += 1
            else:
                await in_thread(entry.session.close)
        self._entries = {}
        if parked:
            log.info("parked %d sessions in %s: a server started with this --session-dir serves them on",
                     parked, self.parked)
        if lost:
            log.warning("%d sessions could not be parked: their caches are lost", lost)


async def described(entries: list[Entry]) -> list[dict[str, Any]]:
    """``entries`` described, in a worker thread: where a session's state is
    is the engine's to say (with an engine process, a call with a deadline),
    never a wait of the event loop. One closed meanwhile (parked) is left out."""
    def describe() -> list[dict[str, Any]]:
        out = []
        for entry in entries:
            try:
                out.append(entry.describe())
            except SessionClosedError:
                pass
        return out

    return await in_thread(describe)


async def described_one(entry: Entry) -> dict[str, Any]:
    out = await described([entry])
    if not out:
        raise APIError(404, f"no session {entry.id!r}", "session_not_found", "session_id")
    return out[0]


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells one write of a file from another (each write is a new file
    renamed into place): inode, size, modification time; None if absent."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns



def _save(session: ServedSession, path: Path) -> None:
    """Writes ``session`` to ``path``, making its folder first (a tenant's,
    at its first file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    session.save(path)


def out_of_space(error: BaseException) -> bool:
    """Whether ``error`` is a write that found its disk (or the writer's
    quota) full: an OSError, or the runtime's SessionFileError, which says
    so in the C library's words."""
    if isinstance(error, OSError) and error.errno in _OUT_OF_SPACE:
        return True
    return isinstance(error, SessionFileError) and any(os.strerror(n) in str(error) for n in _OUT_OF_SPACE)


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__


class _Failures:
    """The log of one kind of write that may fail over and over (a full
    disk fails every park and checkpoint until space is made): the first
    failure of an episode is logged, the rest only counted, and one line
    says when writing works again."""

    def __init__(self, what: str) -> None:
        self.what, self.count = what, 0

    def failed(self, message: str) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("%s (further failures of %s are not logged until one succeeds)", message, self.what)

    def succeeded(self) -> None:
        if self.count:
            log.info("%s works again, after %d failures", self.what, self.count)
            self.count = 0
