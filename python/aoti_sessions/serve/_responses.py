"""OpenAI's Responses API (the openai-agents SDK's default model):
``POST /v1/responses``, streamed or not, ``GET`` and ``DELETE
/v1/responses/{id}``.

A response is a chat turn underneath: its input items become chat messages
(serve/_responses_protocol.py) after those of the response it follows, and
the chat machinery (serve/_generate.py's Job: the chat template, tools, the
grammar, the step loop) generates it; its text and tool calls become output
items (``message`` with ``output_text``, ``function_call`` with its
``call_id``), streamed as the Responses' events, each with its
``sequence_number``: ``response.created``, ``response.in_progress``, then
per item ``response.output_item.added``, (text) ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, (call) ``response.function_call_arguments.delta``
and ``.done``, ``response.output_item.done``; last ``response.completed``
(``response.incomplete`` at ``max_output_tokens``, ``response.failed`` for
an error met on the way).

A stored response keeps the session its chain runs in (serve/_response_store.py):
a follow-up naming it in ``previous_response_id`` sends only its new items
(a ``function_call_output``) and continues that session, its cache reused
(``usage.input_tokens_details.cached_tokens``); a second follow-up on the
same response (a branch) forks the session, reusing the common start. The
first response of a chain names its session after itself (a named session:
``/v1/sessions/resp_...`` shows it), held by one request at a time.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ._errors import APIError, runtime_error, unexpected, validation_error
from ._generate import Job
from ._metrics import ServerMetrics
from ._response_store import Stored
from ._responses_protocol import ResponsesRequest
from ._routes import GENERATED, answer, check_model, tenant_of
from ._entry import Entry

if TYPE_CHECKING:
    from ..llm import ToolCall
    from ._model import ServedLLM
    from ._sessions import Registry
    from ._shared import SharedRegistry

# The chat request's fields, as the Responses name them (an error the chat machinery raises names the client's).
_FIELDS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def install(app: FastAPI, llm: ServedLLM, registry: Registry | SharedRegistry, metrics: ServerMetrics,
            names: Sequence[str], retry_after: int) -> None:
    """Adds the Responses API's routes to ``app`` (serve/_app.py's create_app;
    ``names``: the model's, the first reported)."""
    responses = _Responses(llm, registry, metrics, names, retry_after)

    @app.post("/v1/responses", responses=GENERATED)
    async def create(request: Request, body: ResponsesRequest, tenant: str = Depends(tenant_of)) -> Response:
        return await responses.create(request, body, tenant)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return (await responses.stored(tenant, response_id, "response_id")).body

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        await responses.delete(tenant, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@contextmanager
def _in_responses_words() -> Iterator[None]:
    """An error of the chat machinery, naming the Responses' field (``input``, not ``messages``)."""
    try:
        yield
    except ValidationError as e:
        raise _renamed(validation_error(e.errors())) from e
    except APIError as e:
        raise _renamed(e) from e


def _renamed(error: APIError) -> APIError:
    param = error.param or ""
    for chat, ours in _FIELDS.items():
        if param == chat or param.startswith((chat + ".", chat + "[")):
            message = error.message
            if message.startswith(param + ":"):
                message = ours + message[len(param):]
            return APIError(error.status, message, error.code, ours, error.headers)
    return error


class _Responses:
    def __init__(self, llm: ServedLLM, registry: Registry | SharedRegistry, metrics: ServerMetrics,
                 names: Sequence[str], retry_after: int) -> None:
        self.llm, self.registry, self.metrics, self.retry_after = llm, registry, metrics, retry_after
        self.names, self.model = names, names[0]

    async def stored(self, tenant: str, response_id: str, field: str) -> Stored:
        record = await self.registry.responses.get(tenant, response_id)
        if record is None:
            raise APIError(404, f"no response {response_id!r}", "response_not_found", field)
        return record

    async def delete(self, tenant: str, response_id: str) -> None:
        record = await self.registry.responses.delete(tenant, response_id)
        if record is None:
            raise APIError(404, f"no response {response_id!r}", "response_not_found", "response_id")
        if record.next is None and record.session is not None:  # its session is at it: nobody else's cache
            try:
                await self.registry.delete(tenant, record.session)
            except APIError:
                pass  # (gone already, or busy with a request naming it: theirs)

    async def create(self, request: Request, body: ResponsesRequest, tenant: str) -> Response:
        if body.model is not None:
            check_model(body.model, self.names)
        previous = None
        if body.previous_response_id is not None:
            previous = await self.stored(tenant, body.previous_response_id, "previous_response_id")
        conversation = [*(previous.conversation if previous is not None else []), *body.new_messages()]
        with _in_responses_words():
            job = Job(self.llm, body.chat(conversation), self.model, self.metrics)
            await job.tokenize()
        run = _Run(body, job, conversation)
        entry = await self._hold(tenant, body, previous, run.id)

        async def whole() -> Response:
            async for _, piece in job.pieces(request.is_disconnected):
                run.feed(piece)
            if job.cancelled:
                return Response(status_code=499)
            run.feed(None)
            done = run.body()
            await self._keep(tenant, run, entry, done)
            return JSONResponse(done)

        return await answer(job, entry, self.registry, body.stream, whole,
                            lambda release: self._events(run, request, tenant, entry, release), {})

    async def _hold(self, tenant: str, body: ResponsesRequest, previous: Stored | None, response_id: str) -> Entry:
        """The session the response is generated in, held: a new chain's
        (named after it; a throwaway one unstored), the previous response's
        where it is still at it, else a fork of that (or, where that went
        or is busy, a new one)."""
        name = response_id if body.stored else None
        if previous is None or previous.session is None:
            return await self.registry.acquire(tenant, name, create=True)
        if await self.registry.responses.claim(tenant, previous.id, response_id):
            try:
                return await self.registry.acquire(tenant, previous.session, create=True)
            except APIError as e:  # (busy: a request naming the session itself holds it)
                if e.status != 409:
                    raise
        if name is not None:
            try:
                await self.registry.fork(tenant, previous.session, name)
                return await self.registry.acquire(tenant, name, create=False)
            except APIError as e:
                if e.status not in (404, 409):
                    raise
        return await self.registry.acquire(tenant, name, create=True)

    async def _keep(self, tenant: str, run: _Run, entry: Entry, body: dict[str, Any]) -> None:
        if run.request.stored:
            await self.registry.responses.put(tenant, Stored(run.id, body, run.conversation_after(), entry.id))

    async def _events(self, run: _Run, request: Request, tenant: str, entry: Entry,
                      release: Callable[[], Awaitable[None]]) -> AsyncGenerator[bytes, None]:
        """The stream's events (module docstring). The response is stored and
        its session released before the last event goes: a follow-up sent
        once the client read it finds both."""
        numbers = itertools.count()

        def event(fields: dict[str, Any]) -> bytes:
            data = json.dumps({**fields, "sequence_number": next(numbers)}, separators=(",", ":"))
            return f"event: {fields['type']}\ndata: {data}\n\n".encode()

        for kind in ("response.created", "response.in_progress"):
            yield event({"type": kind, "response": run.body("in_progress")})
        job = run.job
        try:
            async for _, piece in job.pieces(request.is_disconnected):
                for e in run.feed(piece):
                    yield event(e)
            for e in run.feed(None):
                yield event(e)
        except Exception as e:  # the stream has begun: the error goes in it
            error = e if isinstance(e, APIError) else runtime_error(e, self.retry_after)
            if error is None:
                error = unexpected("in a streamed response", e)
            with anyio.CancelScope(shield=True):
                await release()
            yield event({"type": "response.failed", "response": run.body("failed", error)})
            return
        if job.cancelled:
            return
        done = run.body()
        with anyio.CancelScope(shield=True):
            await self._keep(tenant, run, entry, done)
            await release()
        yield event({"type": f"response.{done['status']}", "response": done})


class _Run:
    """One response being made: its job, its output items as they come, and its bodies."""

    def __init__(self, request: ResponsesRequest, job: Job, conversation: list[dict[str, Any]]) -> None:
        self.request, self.job, self.conversation = request, job, conversation
        self.id = _new_id("resp_")
        self.created = time.time()
        self.output = _Output()

    def feed(self, text: str | None) -> list[dict[str, Any]]:
        """The events for a piece of generated text (None: the end, what was held back)."""
        from ..llm import Reasoning

        reply = self.job.choices[0].reply  # (the reply read in pieces, llm/runtime/_replies.py; its reasoning is no output item yet)
        pieces: list[str | ToolCall] = [text] if text and reply is None else []
        if reply is not None:
            read = reply.push(text) if text is not None else reply.finish()
            pieces = [p for p in read if not isinstance(p, Reasoning)]
        events = []
        for piece in pieces:
            events += self.output.text(piece) if isinstance(piece, str) else self.output.call(piece)
        if text is None:
            events += self.output.close("incomplete" if self.status() == "incomplete" else "completed")
        return events

    def status(self) -> str:
        g = self.job.generation
        return "incomplete" if g is not None and g.finish_reason == "length" else "completed"

    def body(self, status: str | None = None, error: APIError | None = None) -> dict[str, Any]:
        """The response object: as it ends (``status`` None), or as it stands."""
        r, g = self.request, self.job.generation
        status = status or self.status()
        usage = None
        if status != "in_progress" and g is not None:
            usage = {"input_tokens": g.prompt_tokens, "input_tokens_details": {"cached_tokens": g.cached_tokens},
                     "output_tokens": g.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": g.prompt_tokens + g.completion_tokens}
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        choice = r.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.job.model,
            "error": {"code": error.code or "server_error", "message": error.message} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "output": self.output.items if status != "in_progress" else [],
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "store": r.stored, "temperature": r.temperature, "top_p": r.top_p, "truncation": "disabled",
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "metadata": r.metadata or {}, "user": r.user, "reasoning": None, "usage": usage}

    def conversation_after(self) -> list[dict[str, Any]]:
        """The conversation, this response's output last (one assistant message)."""
        items = self.output.items
        text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in items if i["type"] == "function_call"]
        reply: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            reply["tool_calls"] = calls
        return [*self.conversation, reply]


class _Output:
    """A response's output items, made from its text and calls as they come,
    with the stream events that tell each step (as dicts: ``type`` and the
    rest). Text opens a message item (whitespace alone waits: it opens none);
    a call closes it and is an item of its own."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the message item being written
        self._text: list[str] = []
        self._held = ""  # whitespace before a message opened

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def text(self, piece: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._held += piece
            if not self._held.strip():
                return []
            piece, self._held = self._held, ""
            self._message = {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
            self.items.append(self._message)
            where = self._where(self._message)
            events += [{"type": "response.output_item.added", "output_index": where["output_index"],
                        "item": dict(self._message, content=[])},
                       {"type": "response.content_part.added", **where, "content_index": 0, "part": _part("")}]
        self._text.append(piece)
        events.append({"type": "response.output_text.delta", **self._where(self._message), "content_index": 0,
                       "delta": piece, "logprobs": []})
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Ends the message item being written, if one is (``status``: its own)."""
        message, self._message, self._held = self._message, None, ""
        if message is None:
            return []
        text, self._text = "".join(self._text), []
        message.update(content=[_part(text)], status=status)
        where = self._where(message)
        return [{"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": _part(text)},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(message)}]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self.close("completed")
        item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": _new_id("call_"),
                "name": call.name, "arguments": ""}
        self.items.append(item)
        where = self._where(item)
        events.append({"type": "response.output_item.added", "output_index": where["output_index"], "item": dict(item)})
        item.update(arguments=call.arguments, status="completed")
        return [*events, {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
                {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(item)}]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
