"""An ASGI application called in-process, without a socket: a replica runs
the single-machine server's application this way, so the cluster answers
every request exactly as ``aoti-sessions serve`` does.

A request crosses processes as a plain dict (method, path, query, headers,
body); its answer comes back as a stream: first ``{"status", "headers"}``,
then the body's chunks as they are sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

Request = dict[str, Any]  # method, path, query (bytes), headers [(bytes, bytes)], body (bytes)


def request_scope(request: Request, state: dict[str, Any]) -> dict[str, Any]:
    path: str = request["path"]
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request["method"], "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": request.get("query", b""), "root_path": "", "headers": list(request["headers"]),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": dict(state)}


async def call(app: ASGIApp, request: Request, state: dict[str, Any]) -> AsyncIterator[Any]:
    """Runs ``request`` through ``app``; yields the answer's head, then its
    body chunks. Closing the iterator early is the client hanging up: the
    application sees a disconnect and ends its work before this returns."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(request_scope(request, state), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        await asyncio.shield(task)  # its cleanup (a session's release) runs whole


class Lifespan:
    """An application's startup and shutdown (ASGI lifespan protocol)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._events: asyncio.Queue[Message] = asyncio.Queue()
        self._answers: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _expect(self, event: str) -> None:
        await self._events.put({"type": f"lifespan.{event}"})
        answer = await self._answers.get()
        if answer["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(f"the application's {event} failed: {answer.get('message', '')}")

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}

        async def run() -> None:
            await self.app(scope, self._events.get, self._answers.put)

        self._task = asyncio.get_running_loop().create_task(run())
        await self._expect("startup")

    async def stop(self) -> None:
        if self._task is None:
            return
        await self._expect("shutdown")
        await self._task
        self._task = None
