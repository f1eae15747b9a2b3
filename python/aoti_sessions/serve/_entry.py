"""One session of the server as its table holds it (serve/_sessions.py's
Registry): its id and tenant, the runtime's session, who holds it, and its
checkpoint bookkeeping (serve/_checkpoints.py); and how entries are described
to clients, off the event loop."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import SessionClosedError
from ._errors import APIError
from ._tenants import DEFAULT_TENANT, scoped
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedSession


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
