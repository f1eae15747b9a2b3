"""The layers around the server's routes, outermost first (:func:`install`):

- :class:`RequestId`: the request's ``X-Request-Id`` (checked) or a new one,
  echoed on every answer (errors and streams too) and on every log line
  written while the request is answered (aoti_sessions/_logs.py).
- CORS (Starlette's CORSMiddleware), with ``allowed_origins``: a browser's
  preflight ``OPTIONS`` is answered here, before the API key is asked for
  (a preflight carries none); every other request still needs it.
- :class:`Guard`: the API key (the request's tenant, for the routes:
  serve/_routes.py's ``tenant_of``), the request count by route and status,
  and a 500 for anything unexpected.
- :class:`BodyLimit`: the body read whole, up to its limit and deadline.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._logs import REQUEST_ID
from ._errors import error_response, unexpected
from ._metrics import ServerMetrics
from ._routes import TENANT
from ._tenants import DEFAULT_TENANT, Keys

log = logging.getLogger("aoti_sessions.serve")
OPEN_PATHS = ("/health",)  # answered without the API key
REQUEST_ID_HEADER = "X-Request-Id"
# A request id taken as the client sent it: what goes into a log line and a
# header safely (no spaces, quotes or control characters; UUIDs, hex, base64).
_GOOD_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
# Answer headers a browser's script may read (CORS).
EXPOSED_HEADERS = (REQUEST_ID_HEADER, "X-Session-ID", "Retry-After")


def install(app: FastAPI, *, keys: Keys, metrics: ServerMetrics, body_limit: int, body_timeout: float,
            allowed_origins: Sequence[str] = ()) -> None:
    """Wraps ``app``'s routes in the layers above (Starlette runs the one
    added last outermost)."""
    app.add_middleware(BodyLimit, limit=body_limit, timeout=body_timeout)  # inside the guard: a client without the key sends no body
    app.add_middleware(Guard, keys=keys, metrics=metrics, routes=app.router)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, **cors_options(allowed_origins))
    app.add_middleware(RequestId)


def cors_options(allowed_origins: Sequence[str]) -> dict[str, Any]:
    """CORSMiddleware's options for ``allowed_origins`` (``*``: any)."""
    return {"allow_origins": list(allowed_origins), "allow_methods": ["*"], "allow_headers": ["*"],
            "expose_headers": list(EXPOSED_HEADERS)}


def check_origins(allowed_origins: Iterable[str]) -> tuple[str, ...]:
    """``allowed_origins`` checked: each ``*`` or ``scheme://host[:port]``."""
    if isinstance(allowed_origins, str):
        raise ValueError("allowed_origins must be a list of origins, not one string")
    origins = tuple(allowed_origins)
    for origin in origins:
        if not isinstance(origin, str) or not (origin == "*" or re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin)):
            raise ValueError(f"not an origin: {origin!r} (scheme://host[:port], as a browser sends it, or '*')")
    return origins


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The request's ``X-Request-Id`` where it is one a log may hold, else a new one."""
    sent = next((v for k, v in headers if k == b"x-request-id"), None)
    if sent is not None:
        text = sent.decode("latin-1")
        if _GOOD_REQUEST_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestId:
    """Outermost layer: the request's id (:func:`request_id`), in
    :data:`~aoti_sessions._logs.REQUEST_ID` while it is answered and in its
    answer's ``X-Request-Id`` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*(h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"),
                                      header]
            await send(message)

        token = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


def unauthorized(headers: Iterable[tuple[bytes, bytes]]) -> JSONResponse:
    """The 401 of a request without the right API key."""
    missing = not any(k == b"authorization" for k, _ in headers)
    message = "no API key: send it as 'Authorization: Bearer KEY'" if missing else "incorrect API key"
    return error_response(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class Guard:
    """The API key check (the request's tenant, in the scope's
    :data:`~._routes.TENANT`), and the request count by route and status."""

    def __init__(self, app: ASGIApp, keys: Keys, metrics: ServerMetrics, routes: Any) -> None:
        self.app, self.keys, self.metrics, self.routes = app, keys, metrics, routes

    def _endpoint(self, scope: Scope) -> str:
        for route in self.routes.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return str(getattr(route, "path_format", route.path))
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, started = 500, False

        async def send_counted(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            tenant = DEFAULT_TENANT if scope["path"] in OPEN_PATHS else self.keys.tenant(scope["headers"])
            if tenant is None:
                await unauthorized(scope["headers"])(scope, receive, send_counted)
            else:
                scope[TENANT] = tenant
                try:
                    await self.app(scope, receive, send_counted)
                except Exception as exc:  # noqa: BLE001 - every request gets an answer, every error one log line
                    if started:
                        log.error("unexpected error on %s %s after its answer began", scope["method"],
                                  scope["path"], exc_info=exc)
                        return
                    error = unexpected(f"on {scope['method']} {scope['path']}", exc)
                    await error_response(error.status, error.message, error.code)(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(endpoint=self._endpoint(scope), status=str(status)).inc()


class BodyLimit:
    """Reads each request's body, up to ``limit`` bytes, before the app sees
    it: one declared longer (Content-Length) or found longer as it arrives is
    answered 413 at once, never held whole; one not whole within ``timeout``
    seconds, 408."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.timeout) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before its body was whole: nothing to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limit:
                    await self._refuse(scope, receive, send)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if deadline.cancelled_caught:
            response = error_response(408, f"the request body did not arrive whole within {self.timeout:g} s",
                                      "request_timeout", headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        body, handed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal handed
            if handed:
                return await receive()  # (a disconnect, which streaming answers watch for)
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body is over the server's limit of {self.limit} bytes "
                                       "(aoti-sessions serve --max-body-bytes)", "request_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


class Cors:
    """CORS for answers made outside an ASGI stack (the cluster's ingress, a
    Serve deployment called with each request): Starlette's CORSMiddleware's
    own preflight answers and answer headers."""

    def __init__(self, allowed_origins: Sequence[str]) -> None:
        self._cors = CORSMiddleware(_no_app, **cors_options(check_origins(allowed_origins)))

    def preflight(self, method: str, headers: Headers) -> Response | None:
        """The answer to a browser's preflight request (None: not one)."""
        if method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers:
            return self._cors.preflight_response(request_headers=headers)
        return None

    async def answer_headers(self, request: Headers, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """An answer's ``headers`` with the CORS headers for ``request``'s origin."""
        sent: list[Message] = []

        async def keep(message: Message) -> None:
            sent.append(message)

        await self._cors.send({"type": "http.response.start", "status": 200, "headers": headers}, keep, request)
        return list(sent[0]["headers"])


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("(Cors calls no application)")
