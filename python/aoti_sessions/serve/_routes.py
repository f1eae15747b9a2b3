"""What the server's route modules share (serve/_app.py's OpenAI and
session endpoints, serve/_responses.py's Responses API): the request's
tenant, the model check, and a generation's answer, whole or streamed as
server-sent events."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ._errors import APIError
from ._tenants import DEFAULT_TENANT

if TYPE_CHECKING:
    from ._generate import Job
    from ._entry import Entry
    from ._sessions import Registry
    from ._shared import SharedRegistry

TENANT = "aoti_sessions.tenant"  # the request's tenant, in its ASGI scope (set by serve/_middleware.py's Guard)
# A generation's answer: one JSON object, or with "stream": true server-sent events.
GENERATED: dict[int | str, dict[str, Any]] = {200: {
    "description": "The completion or response, or (stream) its chunks or events as server-sent events",
    "content": {"application/json": {}, "text/event-stream": {}}}}


def tenant_of(request: Request) -> str:
    """The tenant of the request (its API key's): whose sessions and files it sees."""
    return str(request.scope.get(TENANT, DEFAULT_TENANT))


def check_model(name: str, names: Sequence[str]) -> None:
    """404 unless ``name`` is one of the served model's ``names``."""
    if name not in names:
        served = ", ".join(repr(n) for n in names)
        raise APIError(404, f"the model {name!r} does not exist; this server has {served}", "model_not_found",
                       "model")


class EventStream(StreamingResponse):
    """A server-sent event stream that runs ``cleanup`` however it ends: done,
    failed, or cut short by the client (Starlette then cancels the stream)."""

    def __init__(self, content: AsyncGenerator[bytes, None], cleanup: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content, self._cleanup = content, cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._content.aclose()
                await self._cleanup()


async def answer(job: Job, entry: Entry, registry: Registry | SharedRegistry, stream: bool,
                 whole: Callable[[], Awaitable[Response]],
                 events: Callable[[Callable[[], Awaitable[None]]], AsyncGenerator[bytes, None]],
                 headers: dict[str, str]) -> Response:
    """Runs ``job`` on ``entry``'s session (held for it) and answers: the
    whole answer (``whole()``), or (``stream``) the stream of
    ``events(release)``, which lets the session go before its last event.
    The session is let go once, however the answer ends."""
    released = False

    async def release() -> None:  # (once: a second release could let go a session another request took since)
        nonlocal released
        if not released:
            released = True
            try:
                await job.finish()
            finally:
                await registry.release(entry)

    if not stream:
        try:
            await job.start(entry)
            return await whole()
        finally:
            await release()
    try:
        await job.start(entry)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await release()
        raise
    return EventStream(events(release), release, headers)
