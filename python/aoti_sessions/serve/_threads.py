"""The server's calls that may take a while, off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


async def in_thread(call: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Runs ``call`` in a worker thread (of ``limiter``'s, if given, else
    the shared ones); a cancelled caller still waits for it, so whatever it
    made or changed is accounted for."""
    with anyio.CancelScope(shield=True):
        result = await anyio.to_thread.run_sync(call, limiter=limiter)
    return result
