"""The server's limits and their defaults (docs/safety.md), in
one place the command line reads without importing the server."""

from __future__ import annotations

import os

MIN_BODY_LIMIT = 1 << 20  # the default request body limit: 32 bytes a token of the context, at least this
DEFAULT_SESSION_TTL = 3600.0  # seconds a named session may sit unused before it is parked
DEFAULT_MAX_CONNECTIONS = 1000  # connections (or requests in flight) at once; more are answered 503
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request's head to arrive whole
# Seconds an idle connection is kept for the client's next request: longer
# than the 5 s after which httpx (the OpenAI client's transport) stops reusing
# one, so that a request never meets the server closing its connection (the
# client's "Server disconnected without sending a response"); below the head
# deadline, which would close it with a warning.
KEEP_ALIVE = 8
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a request's body to arrive whole (408 otherwise)
# Each API key's saved session files (POST /v1/sessions/{id}/save): how many,
# and their bytes in all (a save that starts under it may end past it by its
# own size); past either, 403 until the key deletes some.
DEFAULT_MAX_SESSION_FILES = 100
DEFAULT_MAX_SESSION_FILES_BYTES = 16 << 30
DEFAULT_STATS_INTERVAL = 10.0  # seconds between the command line's stats log lines (serve/_stats_log.py)


def default_body_limit(max_context: int) -> int:
    """The request body limit when none is set: room for a whole context of
    text (32 bytes a token: JSON-escaped text, chat framing), at least 1 MiB."""
    return max(MIN_BODY_LIMIT, 32 * max_context)


def available_memory() -> int:
    """Bytes of host memory available for new allocations (MemAvailable), or
    the physical memory where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budgets(device: str, available: int) -> tuple[int | None, int]:
    """memory_budget and host_budget where none is given: on a CPU device
    (where session state is host memory) half of ``available``; on CUDA no
    device budget (the device's own memory bounds it); offloaded sessions a
    quarter of ``available`` either way."""
    return (available // 2 if device.startswith("cpu") else None), available // 4


def check_options(max_body_bytes: int | None, session_ttl: float | None, body_timeout: float,
                  max_session_files: int, max_session_files_bytes: int, stats_interval: float | None) -> None:
    """create_app's limits checked: ValueError naming a bad one."""
    if max_body_bytes is not None and (isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int)
                                       or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if session_ttl is not None and not (isinstance(session_ttl, (int, float)) and not isinstance(session_ttl, bool)
                                        and 0 < session_ttl < float("inf")):
        raise ValueError(f"session_ttl must be a number of seconds > 0 (or None: never), got {session_ttl!r}")
    if isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float)) or not 0 < body_timeout < 1e9:
        raise ValueError(f"body_timeout must be a number of seconds > 0, got {body_timeout!r}")
    for name, limit in (("max_session_files", max_session_files), ("max_session_files_bytes", max_session_files_bytes)):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"{name} must be an int >= 1, got {limit!r}")
    if stats_interval is not None and (isinstance(stats_interval, bool) or not isinstance(stats_interval, (int, float))
                                       or not 0 < stats_interval < 1e9):
        raise ValueError(f"stats_interval must be a number of seconds > 0 (or None: no stats log), got "
                         f"{stats_interval!r}")
