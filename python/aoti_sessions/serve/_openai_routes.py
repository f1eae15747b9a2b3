"""OpenAI's model, chat and completion endpoints: a request's session named
or throwaway, its generation answered whole or streamed as server-sent
events (the Responses API's routes: serve/_responses.py)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from ._bodies import DONE
from ._errors import APIError, runtime_error, sse_error, unexpected
from ._generate import Job
from ._protocol import SESSION_ID_PATTERN, ChatRequest, CompletionRequest
from ._routes import GENERATED, answer, check_model, tenant_of

if TYPE_CHECKING:
    from ._metrics import ServerMetrics
    from ._model import ServedLLM
    from ._sessions import Registry
    from ._shared import SharedRegistry

__all__ = ["install"]

_SESSION_ID = re.compile(SESSION_ID_PATTERN)


def install(app: FastAPI, llm: ServedLLM, registry: Registry | SharedRegistry, metrics: ServerMetrics,
            names: Sequence[str], retry_after: int) -> None:
    """The model, chat and completion endpoints on ``app``: ``names`` the
    model ids answered to (answers report the first)."""
    model = names[0]
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
