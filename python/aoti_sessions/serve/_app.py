"""The FastAPI application, wired: its options checked, its session
registry and metrics, errors and middleware, ``/health`` and ``/metrics``,
and the route modules: OpenAI's model, chat and completion endpoints
(serve/_openai_routes.py), the session endpoints (serve/_session_routes.py),
the Responses API (serve/_responses.py)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import _errors, _middleware, _openai_routes, _responses, _session_routes, _stats_log
from ._limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_SESSION_FILES, DEFAULT_MAX_SESSION_FILES_BYTES,
                      DEFAULT_SESSION_TTL, check_options, default_body_limit)
from ._metrics import CONTENT_TYPE, ServerMetrics, count_registry
from ._middleware import check_origins
from ._protocol import ErrorBody
from ._sessions import Registry
from ._tenants import Keys
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedLLM
    from ._shared import SharedRegistry


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
    (llm/runtime/_prefix.py: within the request's tenant and ``prompt_cache_key``),
    kept there when it ends.
    """
    check_options(max_body_bytes, session_ttl, body_timeout, max_session_files, max_session_files_bytes,
                  stats_interval)
    body_limit = max_body_bytes if max_body_bytes is not None else default_body_limit(llm.max_context)
    origins = check_origins(allowed_origins)
    names = served_names(model_name, llm.name)
    keys = Keys(api_key, api_keys)
    registry: Registry | SharedRegistry = shared if shared is not None else new_registry(
        llm, session_dir=session_dir, session_ttl=session_ttl, persist_sessions=persist_sessions,
        checkpoint_sessions=checkpoint_sessions, max_session_files=max_session_files,
        max_session_files_bytes=max_session_files_bytes)
    metrics = ServerMetrics(llm.stats, lambda: len(registry), lambda: int(registry.figure("throwaway")))
    count_registry(metrics, registry)

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

    async def stats_figures() -> _stats_log.Figures:
        engine = await in_thread(llm.stats)
        return _stats_log.figures([metrics.snapshot()], engine, len(registry), int(registry.figure("throwaway")))

    _openai_routes.install(app, llm, registry, metrics, names, retry_after)
    _session_routes.install(app, registry, max_session_files, max_session_files_bytes)
    _responses.install(app, llm, registry, metrics, names, retry_after)  # /v1/responses (serve/_responses.py)
    return app


def served_names(model_name: str | Sequence[str] | None, default: str) -> list[str]:
    """The model ids the server answers to (``model_name``: one, several, or None: ``default``)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name or [default])
    if not names or not all(isinstance(n, str) and n and n.strip() == n and len(n) <= 256 for n in names):
        raise ValueError(f"model_name must be one or more non-empty names (at most 256 characters, no spaces "
                         f"around them), got {model_name!r}")
    return list(dict.fromkeys(names))
