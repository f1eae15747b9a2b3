"""The server's sessions: client-chosen ids mapped to the runtime's chat
sessions, each used by one request at a time.

All bookkeeping happens on the event loop's thread, so the table needs no
lock; the runtime's calls that may take a while (creating a session, which can
wait for an eviction, forking, saving, loading, closing) run in worker
threads, shielded from cancellation so that a client hanging up cannot leak a
session half made.

A request without a session id gets a throwaway session from the LLM's
prefix cache (llm/runtime/_prefix.py), in its tenant's namespace: a fork of the
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

With checkpoints on (serve/_checkpoints.py), every change to a named session
is also written to its parked file in the background; a generation request
for it goes ahead while the file is written, other requests (a reset, a fork,
a save, a delete) wait for the write. The file is then the session's truth
across processes: a server that finds it changed since its own write (another
server served the session meanwhile) drops its copy and loads the file; one
that finds it gone (deleted elsewhere) drops its copy. (A generation that
comes while this server's own write is under way skips that check: the file
is its own, being replaced.)

Sessions belong to tenants (serve/_tenants.py): a table key, a parked file
and a session file (serve/_session_files.py) are the tenant's own; every
method takes the tenant of the request, and another tenant's is absent to it.
The sessions of stored responses (serve/_response_store.py) are caches, parked
first to make room. A park that fails (a full disk) keeps the session in
memory, usable, and the next sweep tries again (logged once an episode).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import CapacityError, SessionFileError
from ._checkpoints import CheckpointWriter
from ._entry import Entry, described, new_id
from ._errors import APIError
from ._limits import DEFAULT_MAX_SESSION_FILES, DEFAULT_MAX_SESSION_FILES_BYTES
from ._protocol import SESSION_ID_PATTERN
from ._response_store import ResponseStore
from ._session_files import Failures, SessionFiles, error_text, save_session, signature
from ._tenants import cache_namespace, scoped
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedLLM, ServedSession

log = logging.getLogger("aoti_sessions.serve")
PARKED_DIR = ".live"  # in --session-dir: parked sessions (a name no client's file can take)
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


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
        self.superseded = 0  # copies dropped: their checkpoint changed or went elsewhere
        self.park_failures = 0  # parks that failed (the session kept in memory, or lost when stopping)
        self.parked_for_room = 0  # idle sessions parked to make room for another
        self._parking = Failures("parking sessions")
        self.session_files = SessionFiles(self.session_dir, max_files, max_file_bytes)
        self.checkpoints = CheckpointWriter(lambda e: self._parked_path(e.tenant, e.id or ""),
                                            lambda e: self._entries.get(e.key) is e)
        # Stored responses of /v1/responses (serve/_response_store.py): parked with the sessions, beside them.
        self.responses = ResponseStore(self.session_files.home if self.parked is not None else None)

    sweeps = True  # its sessions idle past their TTL are parked by its own sweep (sweep, expire_idle)
    # Its figures for /metrics (figure): counts kept as attributes (the checkpoints' by its CheckpointWriter),
    # and ``named``.
    FIGURES = ("named", "throwaway", "expired", "unparked", "park_failures", "parked_for_room",
               *CheckpointWriter.FIGURES, "superseded")

    def __len__(self) -> int:
        return len(self._entries)

    def figure(self, name: str) -> float:
        """One of its counts for /metrics (``expired``, ``unparked``, ...; ``named``: len)."""
        if name == "named":
            return float(len(self))
        return float(getattr(self.checkpoints if name in CheckpointWriter.FIGURES else self, name))

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

    def _parked_path(self, tenant: str, session_id: str) -> Path:
        return self.session_files.home(tenant) / PARKED_DIR / session_id

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
        written = signature(path)
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
        await self.checkpoints.wait(entry)
        if not self.checkpoint or entry.busy or entry.id is None or entry.session is None:
            return entry
        if signature(self._parked_path(entry.tenant, entry.id)) == entry.written:
            return entry
        log.info("session %r changed elsewhere since this server last wrote it: its copy here is dropped", entry.id)
        session, entry.session = entry.session, None
        self._entries.pop(entry.key, None)
        self.superseded += 1
        await in_thread(session.close)
        return None

    def checkpoint_soon(self, entry: Entry) -> None:
        """With checkpoints: named ``entry`` changed; its state is written to
        its parked file in the background (serve/_checkpoints.py)."""
        if self.checkpoint and entry.id is not None and entry.session is not None:
            self.checkpoints.soon(entry)

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
                await in_thread(lambda: save_session(session, path))
                saved = True
                self._parking.succeeded()
            except Exception as e:  # noqa: BLE001 - one session's failure must not stop the others'
                self.park_failures += 1
                self._parking.failed(f"session {entry.id!r} could not be parked ({why}): {error_text(e)}; "
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
        prefix cache: llm/runtime/_prefix.py)."""
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

    async def files(self, tenant: str) -> list[dict[str, Any]]:
        """``tenant``'s session files, as ``GET /v1/session-files`` lists them."""
        return await self.session_files.listing(tenant)

    async def delete_file(self, tenant: str, name: str) -> None:
        await self.session_files.delete(tenant, name)

    async def save(self, tenant: str, session_id: str, name: str) -> int:
        """Saves the session as ``tenant``'s file ``name``; its bytes."""
        self.session_files.path(tenant, name)  # (a bad name is refused before the session is held)
        async with self.session_files.saving(tenant):
            async with self._held(tenant, session_id) as (_, session):
                return await self.session_files.write(tenant, name, session)

    async def load(self, tenant: str, name: str, session_id: str | None) -> Entry:
        path = self.session_files.path(tenant, name)
        if not path.is_file():
            raise APIError(404, f"no session file {name!r}", "file_not_found", "name")
        with self.session_files.errors("load the session file", name, path):
            entry = await self._add(tenant, session_id or new_id(), lambda: self.llm.load_session(path))
        entry.busy = False
        self.checkpoint_soon(entry)
        return entry

    async def close(self) -> None:
        """The server is stopping: parks every named session (saved, with
        persistence on), closes the rest."""
        await self.checkpoints.drain()
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


