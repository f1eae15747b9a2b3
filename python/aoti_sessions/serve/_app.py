"""The FastAPI application: OpenAI's chat, completion and model endpoints,
session management, ``/metrics`` and ``/health``; the Responses API's
routes come from serve/_responses.py."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import _errors, _middleware, _responses, _stats_log
from ._bodies import DONE
from ._errors import APIError, runtime_error, sse_error, unexpected
from ._generate import Job
from ._limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_SESSION_FILES, DEFAULT_MAX_SESSION_FILES_BYTES,
                      DEFAULT_SESSION_TTL, default_body_limit)
from ._metrics import CONTENT_TYPE, ServerMetrics
from ._protocol import (SESSION_ID_PATTERN, ChatRequest, CompletionRequest, ErrorBody, ForkRequest, LoadRequest,
                        SaveRequest)
from ._middleware import check_origins
from ._routes import GENERATED, answer, check_model, tenant_of
from ._sessions import Registry, described_one
from ._tenants import Keys
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedLLM
    from ._shared import SharedRegistry

log = logging.getLogger("aoti_sessions.serve")
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
def new_registry(llm: ServedLLM, *, session_dir: str | os.PathLike[str] | None = None,
                 session_ttl: float | None = DEFAULT_SESSION_TTL, persist_sessions: bool | None = None,
                 checkpoint_sessions: bool = False, max_session_files: int = DEFAULT_MAX_SESSION_FILES,
                 max_session_files_bytes: int = DEFAULT_MAX_SESSION_FILES_BYTES, **_: Any) -> Registry:
    """The session registry :func:`create_app`'s options make (the others ignored)."""
    for name, wanted in (("persist_sessions", persist_sessions), ("checkpoint_sessions", checkpoint_sessions)):
        if wanted and session_dir is None:
            raise ValueError(f"{name} needs a session_dir to keep them in")
    persist = session_dir is not None if persist_sessions is None else bool(persist_sessions)
    return Registry(llm, session_dir, ttl=session_ttl, persist=persist, checkpoint=checkpoint_sessions,
                    max_files=max_session_files, max_file_bytes=max_session_files_bytes)


def create_app(llm: ServedLLM, *, api_key: str | None = None, session_dir: str | os.PathLike[str] | None = None,
               model_name: str | Sequence[str] | None = None, retry_after: int = 1, max_body_bytes: int | None = None,
               session_ttl: float | None = DEFAULT_SESSION_TTL, persist_sessions: bool | None = None,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, checkpoint_sessions: bool = False,
               api_keys: Iterable[str] = (), max_session_files: int = DEFAULT_MAX_SESSION_FILES,
               max_session_files_bytes: int = DEFAULT_MAX_SESSION_FILES_BYTES,
               shared: SharedRegistry | None = None, allowed_origins: Iterable[str] = (),
               stats_interval: float | None = None) -> FastAPI:
    """An OpenAI-compatible server of ``llm``'s sessions.

    Args:
        llm: the model; its engine's ``max_sessions``, ``memory_budget`` and
            ``idle_timeout`` set the capacity and when idle sessions go to host memory.
        api_key: when set, every endpoint but ``/health`` wants
            ``Authorization: Bearer <api_key>`` (401 otherwise).
        api_keys: more keys, each a tenant of its own (serve/_tenants.py):
            a key sees, uses and deletes only the sessions and session files
            it made (another's answer 404, as if absent). Every endpoint but
            ``/health`` wants one of them or ``api_key``.
        session_dir: the folder ``save`` and ``load`` read and write; without
            it they answer 400.
        model_name: the model id clients name (default ``llm.name``), or
            several (``--served-model-name``): a request may name any, each is
            in ``/v1/models``, and answers report the first.
        retry_after: seconds a 429 (no room for a session) tells clients to wait.
        max_body_bytes: a request body longer than this is answered 413
            before it is read whole (default: :func:`default_body_limit` of
            the model's context).
        session_ttl: seconds a named session may sit unused; then it is
            parked (saved, with persistence on, and closed). None: never.
        persist_sessions: park sessions in ``session_dir/.live`` (at their
            TTL and when the server stops) and bring them back when a request
            names them (default: on where there is a session dir).
        body_timeout: seconds a request's body may take to arrive whole
            (408 after that).
        checkpoint_sessions: after every change to a named session, write
            it to its parked file in the background, and serve a session
            whose file another server changed from that file (servers sharing
            ``session_dir``: the replicas of :mod:`aoti_sessions.cluster`).
        max_session_files, max_session_files_bytes: each key's saved
            session files, in number and in bytes; past either a save is
            answered 403 until the key deletes some.
        shared: for one front end of several over one engine process
            (``aoti-sessions serve --api-workers N``, serve/_fleet.py): the
            registry they share (its hub keeps the sessions, with the options
            above), in place of one of this app's own.
        allowed_origins: the origins (``https://app.example``, or ``*``)
            whose pages may call the server from a browser (CORS): a
            preflight ``OPTIONS`` from one is answered without the API key;
            every other request still needs it. None by default.
        stats_interval: seconds between the stats log lines
            (serve/_stats_log.py); None: none. (With several front ends the
            hub writes them, for all.)

    Every answer carries an ``X-Request-Id``: the request's own where it
    sent a usable one (1-128 letters, digits and ``._:/+=-``), else a new
    one; the log lines written while answering it carry it too.

    A generation request names its session with ``session_id`` in the body or
    an ``X-Session-ID`` header; an id the server does not know yet is created
    (the ``/v1/sessions/{id}`` endpoints answer 404 for it instead). Without
    one, the request gets a throwaway session from the LLM's prefix cache
    (llm/_prefix.py: within the request's tenant and ``prompt_cache_key``),
    kept there when it ends.
    """
    if max_body_bytes is not None and (isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int)
                                       or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    body_limit = max_body_bytes if max_body_bytes is not None else default_body_limit(llm.max_context)
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
    origins = check_origins(allowed_origins)
    names = served_names(model_name, llm.name)
    keys = Keys(api_key, api_keys)
    registry: Registry | SharedRegistry = shared if shared is not None else new_registry(
        llm, session_dir=session_dir, session_ttl=session_ttl, persist_sessions=persist_sessions,
        checkpoint_sessions=checkpoint_sessions, max_session_files=max_session_files,
        max_session_files_bytes=max_session_files_bytes)
    metrics = ServerMetrics(llm.stats, lambda: len(registry), lambda: int(registry.figure("throwaway")))
    counters: tuple[tuple[str, str, Callable[[], float]], ...] = (
            ("sessions_expired_total", "Named sessions parked (saved with persistence on, then closed) after their TTL.",
             lambda: registry.figure("expired")),
            ("sessions_unparked_total", "Parked sessions brought back by a request naming them.",
             lambda: registry.figure("unparked")),
            ("sessions_parked_for_room_total", "Idle sessions parked (saved with persistence on, then closed) to make "
             "room for another: a stored response's, or with persistence any named one.",
             lambda: registry.figure("parked_for_room")),
            ("session_park_failures_total", "Parks that failed (a full disk): the session stays in memory, or is "
             "lost when the server stops.", lambda: registry.figure("park_failures")),
            ("checkpoints_total", "Checkpoint writes of named sessions (with checkpoints on).",
             lambda: registry.figure("checkpoints")),
            ("checkpoint_failures_total", "Checkpoint writes that failed (logged).",
             lambda: registry.figure("checkpoint_failures")),
            ("checkpoint_seconds_total", "Seconds spent writing checkpoints, off the request path.",
             lambda: registry.figure("checkpoint_seconds")),
            ("checkpoint_wait_seconds_total", "Seconds requests waited for their session's checkpoint write.",
             lambda: registry.figure("checkpoint_wait_seconds")),
            ("sessions_superseded_total", "Session copies dropped because another server changed their checkpoint.",
             lambda: registry.figure("superseded")))
    for name, what, read in counters:
        metrics.registry.gauge(f"aoti_sessions_{name}", what, read, kind="counter")
    model = names[0]  # (what answers report)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.open(metrics.snapshot)
        async with anyio.create_task_group() as tasks:
            if registry.sweeps:
                tasks.start_soon(registry.sweep)
            if stats_interval is not None and shared is None:  # (the hub's, with several front ends)
                tasks.start_soon(_stats_log.run, stats_interval, stats_figures)
            yield
            tasks.cancel_scope.cancel()
        await registry.close()

    # strict_content_type=False: a JSON body sent without a Content-Type is read as JSON.
    # Every error a route may answer, documented in the OpenAPI schema with its body.
    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorBody, "description": what} for status, what in (
            (400, "A request the server refuses, saying why"), (401, "No or a wrong API key"),
            (403, "The key's saved session files are at their limit"),
            (404, "No such session, model, file or path"), (408, "The body did not arrive in time"),
            (409, "The session is busy, or the id is taken"), (413, "The body is over the limit"),
            (429, "No room for another session now (Retry-After)"), (500, "An unexpected error"),
            (503, "The model is unavailable, or the server is at its connection limit"),
            (507, "The server is out of space for a session file"))}
    app = FastAPI(title="aoti-sessions", lifespan=lifespan, strict_content_type=False, responses=errors)
    app.state.registry, app.state.metrics, app.state.llm = registry, metrics, llm
    _errors.install(app, retry_after)
    _middleware.install(app, keys=keys, metrics=metrics, body_limit=body_limit, body_timeout=body_timeout,
                        allowed_origins=origins)

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        # An engine process is alive while its heartbeat comes and its step
        # loop moves (RemoteLLM): a stopped or wedged one is 503 within its deadline.
        if not llm.alive:
            reason = getattr(llm, "unavailable", None) or "the model is closed"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    async def prometheus() -> Response:
        # (The engine's figures are a call into it: in a thread, never a wait of the event loop.)
        # (With several front ends, the others' counts are summed in: one view from any of them.)
        others = await registry.peer_metrics()
        return PlainTextResponse(await in_thread(lambda: metrics.render(others)), media_type=CONTENT_TYPE)

    started = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "aoti-sessions",
                "max_model_len": llm.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        check_model(model_id, names)
        return model_card(model_id)

    async def stats_figures() -> _stats_log.Figures:
        engine = await in_thread(llm.stats)
        return _stats_log.figures([metrics.snapshot()], engine, len(registry), int(registry.figure("throwaway")))

    async def generate(request: Request, body: ChatRequest | CompletionRequest, header_id: str | None,
                       tenant: str) -> Response:
        session_id = _session_id(body.session_id, header_id)
        if body.model is not None:
            check_model(body.model, names)
        job = Job(llm, body, model, metrics)
        await job.tokenize()
        # (A throwaway session starts from the prefix cache: its prompt picks the kept session.)
        entry = await registry.acquire(tenant, session_id, create=True, cache_key=body.prompt_cache_key,
                                       prompt=job.prompt_ids() if session_id is None else None)
        headers = {"X-Session-ID": session_id} if session_id else {}

        async def whole() -> Response:
            async for choice, piece in job.pieces(request.is_disconnected):
                choice.text.append(piece)
            if job.cancelled:
                return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
            return JSONResponse(job.response(), headers=headers)

        return await answer(job, entry, registry, bool(body.stream), whole,
                            lambda release: _events(job, request, retry_after, release), headers)

    @app.post("/v1/chat/completions", responses=GENERATED)
    async def chat(request: Request, body: ChatRequest, x_session_id: str | None = Header(default=None),
                   tenant: str = Depends(tenant_of)) -> Response:
        return await generate(request, body, x_session_id, tenant)

    @app.post("/v1/completions", responses=GENERATED)
    async def complete(request: Request, body: CompletionRequest, x_session_id: str | None = Header(default=None),
                       tenant: str = Depends(tenant_of)) -> Response:
        return await generate(request, body, x_session_id, tenant)

    @app.get("/v1/sessions")
    async def sessions(tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return {"object": "list", "data": await registry.listing(tenant)}

    @app.post("/v1/sessions/load")
    async def load(body: LoadRequest, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.load(tenant, body.name, body.session_id))

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.lookup(tenant, session_id))

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        await registry.delete(tenant, session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/reset")
    async def reset(session_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.reset(tenant, session_id))

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork(session_id: str, body: ForkRequest | None = None,
                   tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.fork(tenant, session_id, body.session_id if body else None))

    @app.post("/v1/sessions/{session_id}/save")
    async def save(session_id: str, body: SaveRequest, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        size = await registry.save(tenant, session_id, body.name)
        return {"id": session_id, "object": "session.saved", "name": body.name, "bytes": size}

    @app.get("/v1/session-files")
    async def session_files(tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return {"object": "list", "data": await registry.files(tenant), "max_files": max_session_files,
                "max_bytes": max_session_files_bytes}

    @app.delete("/v1/session-files/{name}")
    async def delete_session_file(name: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        await registry.delete_file(tenant, name)
        return {"name": name, "object": "session_file.deleted", "deleted": True}

    _responses.install(app, llm, registry, metrics, names, retry_after)  # /v1/responses (serve/_responses.py)
    return app


def served_names(model_name: str | Sequence[str] | None, default: str) -> list[str]:
    """The model ids the server answers to (``model_name``: one, several, or None: ``default``)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name or [default])
    if not names or not all(isinstance(n, str) and n and n.strip() == n and len(n) <= 256 for n in names):
        raise ValueError(f"model_name must be one or more non-empty names (at most 256 characters, no spaces "
                         f"around them), got {model_name!r}")
    return list(dict.fromkeys(names))


def _session_id(in_body: str | None, in_header: str | None) -> str | None:
    if in_header is not None and not _SESSION_ID.fullmatch(in_header):
        raise APIError(400, f"X-Session-ID: invalid session id {in_header!r} (1-128 letters, digits, '.', '_', "
                            "':', '-')", "invalid_value", "X-Session-ID")
    if in_body is not None and in_header is not None and in_body != in_header:
        raise APIError(400, "session_id and the X-Session-ID header name different sessions", "invalid_value",
                       "session_id")
    return in_body if in_body is not None else in_header


async def _events(job: Job, request: Request, retry_after: int,
                  release: Callable[[], Awaitable[None]]) -> AsyncGenerator[bytes, None]:
    """The stream's server-sent events: OpenAI's chunks, then ``[DONE]``; an
    error met on the way is one last event. The session is released before
    the last event goes: a client's next turn, sent once it has read it (to
    any front end), finds the session free."""
    if job.chat:
        for choice in job.choices:
            yield job.chunk(choice, None, first=True)
    try:
        async for choice, piece in job.pieces(request.is_disconnected):
            for chunk in job.stream_chunks(choice, piece):
                yield chunk
        for choice in job.choices:
            for chunk in job.stream_chunks(choice, None):
                yield chunk
    except Exception as e:  # the stream has begun: the error goes in it
        error = e if isinstance(e, APIError) else runtime_error(e, retry_after)
        if error is None:
            error = unexpected("in a streamed generation", e)
        with anyio.CancelScope(shield=True):
            await release()
        yield sse_error(error)
        return
    if job.cancelled:
        return
    with anyio.CancelScope(shield=True):
        await release()
    for choice in job.choices:
        yield job.chunk(choice, None, finish_reason=job.finish_reason(choice))
    if job.request.include_usage():
        yield job.usage_chunk()
    yield DONE
