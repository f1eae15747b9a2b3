"""Checkpoints of named sessions (servers that share a session dir, e.g. the
replicas of a cluster): every change to a named session (a turn, a reset, a
fork, a load) is also written to its parked file in the background, once the
session has been left alone for ``CHECKPOINT_DELAY_S`` (a burst of turns, as
an agent's tool calls make, is written once, after it), at most
``CHECKPOINT_WRITERS`` at a time: the session stays in memory, held by the
write only while its state is copied out (``ChatSession.save``). The file is
then the session's truth across processes (serve/_sessions.py's Registry
checks it before using its own copy). A write that fails keeps the last good
checkpoint; failures are logged once an episode, and counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import anyio

from ._entry import Entry
from ._session_files import Failures, error_text, save_session, signature
from ._threads import in_thread

CHECKPOINT_DELAY_S = 0.05  # a session's checkpoint is written once it has been left alone this long
CHECKPOINT_WRITERS = 4  # checkpoint writes at once (each holds a host copy of a state; the rest wait their turn)


class CheckpointWriter:
    """The background writes of one registry's checkpoints: ``path_of(entry)``
    is an entry's parked file, ``holds(entry)`` whether the registry's table
    still holds it (a write for one gone is dropped)."""

    # Its figures for /metrics (Registry.figure).
    FIGURES = ("checkpoints", "checkpoint_failures", "checkpoint_seconds", "checkpoint_wait_seconds")

    def __init__(self, path_of: Callable[[Entry], Path], holds: Callable[[Entry], bool]) -> None:
        self._path_of, self._holds = path_of, holds
        self.checkpoints = 0  # checkpoint writes done
        self.checkpoint_failures = 0
        self.checkpoint_seconds = 0.0  # spent writing them (in the background)
        self.checkpoint_wait_seconds = 0.0  # requests spent waiting for a write to end
        self._failures = Failures("writing checkpoints")
        self._writes: set[asyncio.Task[None]] = set()
        self._writers: anyio.CapacityLimiter | None = None  # (made on the event loop)

    def soon(self, entry: Entry) -> None:
        """Named ``entry`` changed: its state is written to its parked file
        once it has been left alone for ``CHECKPOINT_DELAY_S`` (a change
        meanwhile writes it after that one)."""
        entry.changes += 1
        task = asyncio.get_running_loop().create_task(self._write_later(entry, entry.changes))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def wait(self, entry: Entry) -> None:
        """Until ``entry``'s write in flight (if any) has ended."""
        if entry.writing is None:
            return
        started = time.perf_counter()
        while entry.writing is not None:
            await entry.writing.wait()
        self.checkpoint_wait_seconds += time.perf_counter() - started

    async def drain(self) -> None:
        """Until every write started has ended (the server is stopping)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def _write_later(self, entry: Entry, change: int) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_DELAY_S)
            if entry.changes != change or entry.session is None or not self._holds(entry):
                return  # changed again (that change writes it), or gone
            if not entry.busy and entry.writing is None:
                break  # (held by a request that does not change it, a save: after it)
        entry.writing = asyncio.Event()
        path, session = self._path_of(entry), entry.session
        if self._writers is None:
            self._writers = anyio.CapacityLimiter(CHECKPOINT_WRITERS)

        took = [0.0]  # the write's seconds, timed on its thread (the wait for a writer is not the write's)

        def write() -> None:
            started = time.perf_counter()
            try:
                save_session(session, path)
            finally:
                took[0] = time.perf_counter() - started

        try:
            await in_thread(write, self._writers)
            entry.written = signature(path)
            self.checkpoints += 1
            self._failures.succeeded()
        except Exception as e:  # noqa: BLE001 - the session serves on; its last good checkpoint stays
            self.checkpoint_failures += 1
            self._failures.failed(f"session {entry.id!r}: writing its checkpoint failed: {error_text(e)}")
        finally:
            self.checkpoint_seconds += took[0]
            done, entry.writing = entry.writing, None
            assert done is not None
            done.set()
