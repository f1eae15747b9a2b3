"""The command line's logs: a line each with its time, level and logger, and
the id of the HTTP request it was written for where there is one
(``X-Request-Id``, serve/_middleware.py), e.g.::

    2026-12-01 09:14:03,512 INFO uvicorn.access [3f2a...]: 127.0.0.1:50312 - "POST /v1/chat/completions HTTP/1.1" 200

The server's other processes (its engine process, its front ends) log the
same way at the same level: :func:`configure` hands the level to them in
the environment (:data:`LEVEL_ENV`), and they call :func:`configure_here`.
"""

from __future__ import annotations

import logging
import os
import sys
from contextvars import ContextVar

# The id of the request being answered (set by the server for the request's
# whole handling: its task, and the worker threads it starts).
REQUEST_ID: ContextVar[str | None] = ContextVar("aoti_sessions_request_id", default=None)
LEVEL_ENV = "AOTI_SESSIONS_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s%(request)s: %(message)s"


class Format(logging.Formatter):
    """:data:`FORMAT`, ``%(request)s`` being `` [ID]`` while a request is answered (else nothing)."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        request = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request = f" [{request}]" if request else ""
        return super().format(record)


class Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to the ``sys.stderr`` of the moment it writes, not of
    the moment it was made: a stream swapped in and closed since (pytest's
    capture, a notebook's) is never written to."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[no-untyped-def]
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def configure(level: int | str = logging.INFO) -> None:
    """This process's logs to stderr in :class:`Format`, from ``level`` up
    (the handlers there before replaced); the processes it starts do the same
    where they call :func:`configure_here`."""
    handler = Stderr()
    handler.setFormatter(Format())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    os.environ[LEVEL_ENV] = logging.getLevelName(logging.getLogger().level)


def configure_here(default: int | str = logging.WARNING) -> None:
    """A process the server started: logs as :func:`configure` set them up
    in its parent (the level of :data:`LEVEL_ENV`), else from ``default``."""
    level = os.environ.get(LEVEL_ENV, "")
    configure(level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else default)
