"""What the two ends of a RemoteLLM's pipe share (llm/process/_remote.py, the
caller's end; llm/process/_remote_engine.py, the engine process's): the messages
that are more than plain values, and the outbox each end sends through."""

from __future__ import annotations

import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

__all__ = ["Started", "Finals", "Outbox", "EngineAddress"]


class Started(NamedTuple):
    """The reply to ``start``."""

    generation: int
    session: int
    submitted: float
    prompt_tokens: int
    cached_tokens: int
    stop: tuple[str, ...]  # its stop strings (for a connection that makes the text of its token ids)
    keep: tuple[int, ...] = ()  # the special tokens its text keeps (likewise)
    logprobs: bool = False  # its events carry the logprobs of their tokens


class EngineAddress(NamedTuple):
    """Where other processes reach an engine process (RemoteLLM.share): its
    socket and the key of its handshake (a secret: hand it over a pipe, never
    on a command line)."""

    path: str
    authkey: bytes


class Finals(NamedTuple):
    """A generation's counts once it ended."""

    finish_reason: str | None
    prefilled_tokens: int
    completion_tokens: int


class Outbox:
    """What one end of the pipe sends: items put from any thread, sent by a
    thread of its own; what was put while it sent goes as one message (a
    list). A full pipe (the other end not reading: stopped, wedged) holds up
    that thread only, never the threads that put."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._items: deque[tuple[Any, ...]] = deque()
        self._armed = False
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._send, name=name, daemon=True)
        self._thread.start()

    def put(self, item: tuple[Any, ...], *, later: bool = False) -> None:
        """From any thread; one wake-up of the sender for all that came before
        it ran. ``later``: the sender is woken by the next :meth:`flush`, not now."""
        self._items.append(item)
        if not later:
            self.flush()

    def flush(self) -> None:
        """Wakes the sender for what was put (if anything was, and it is not awake)."""
        if self._items and not self._armed:
            self._armed = True
            self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Sends what was put, then ends the sender (within ``timeout``)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._armed = False  # before draining: an item put after the drain arms it again
            items = []
            while self._items:
                items.append(self._items.popleft())
            try:
                if items:
                    self._conn.send(items)
            except (OSError, ValueError):
                return  # the other end went
            if self._stopping and not self._items:
                return
