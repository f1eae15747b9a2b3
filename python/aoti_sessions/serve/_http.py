"""Connections under abuse (docs/safety.md): uvicorn's HTTP
protocol with a deadline for each request's head (a client that sends half a
header and waits holds nothing for long), the server's connection limit
(more are answered 503), an open-file limit raised to room for them, and
overload logged in one line a minute, not a line (or a traceback) each.
Imported when the server starts (it needs uvicorn)."""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ._limits import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, KEEP_ALIVE

log = logging.getLogger("aoti_sessions.serve")


class _HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """Closes a connection whose next request head has not arrived whole
    ``head_timeout`` seconds after it opened (or after the last response)."""

    head_timeout = DEFAULT_HEADER_TIMEOUT

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._await_head()

    def _await_head(self) -> None:
        self._awaited = getattr(self, "cycle", None)  # a new request replaces the cycle
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and getattr(self, "cycle", None) is not self._awaited:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_timer is None and not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_late(self) -> None:
        self._head_timer = None
        if getattr(self, "cycle", None) is self._awaited and not self.transport.is_closing():
            log.warning("closed a connection whose request head did not arrive within %g s", self.head_timeout)
            self.transport.close()


class OnceAMinute(logging.Filter):
    """Lets the first record of each kind named in ``kinds`` (a message
    prefix) through, then one a minute saying how many it held back."""

    def __init__(self, *kinds: str, every: float = 60.0) -> None:
        super().__init__()
        self.kinds, self.every = kinds, every
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        kind = next((k for k in self.kinds if message.startswith(k)), None)
        if kind is None:
            return True
        now = time.monotonic()
        if now - self._last.get(kind, -self.every) < self.every:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        record.msg, record.args = f"{message} ({held} more like it in the last minute)" if held else message, ()
        record.exc_info = record.exc_text = None  # the kind says it: no traceback each time
        return True


_OVERLOAD = OnceAMinute("Exceeded concurrency limit", "socket.accept() out of system resource",
                       "closed a connection whose request head")


def server_config(app: Any, host: str, port: int, *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                  header_timeout: float = DEFAULT_HEADER_TIMEOUT, **options: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the server's connection limits and
    keep-alive (KEEP_ALIVE); the open-file limit raised to room for them;
    overload logged once a minute."""
    protocol = type("HeadDeadline", (_HeadDeadline,), {"head_timeout": header_timeout})
    options.setdefault("timeout_keep_alive", KEEP_ALIVE)
    config = uvicorn.Config(app, host=host, port=port, http=protocol, limit_concurrency=max_connections, **options)
    room_for(max_connections)
    for name in ("uvicorn.error", "asyncio", "aoti_sessions.serve"):
        if _OVERLOAD not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_OVERLOAD)
    return config


def room_for(connections: int) -> None:
    """Raises the soft open-file limit (up to the hard one) to room for
    ``connections`` and the files the server itself holds; says so where the
    hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("open files are limited to %d (ulimit -Hn): fewer than %d connections fit", new, connections)


def stop_when_the_engine_dies(llm: Any, server: uvicorn.Server) -> None:
    """Stops ``server`` (as SIGTERM does) once its engine process died (a thread waits for it)."""

    def wait() -> None:
        from ..errors import EngineProcessError

        error = llm.wait_ended()
        if isinstance(error, EngineProcessError):
            log.error("%s: the server stops", error)
            server.should_exit = True

    threading.Thread(target=wait, name="aoti-sessions-engine-death", daemon=True).start()
