"""One generation request from start to end: its sampling parameters, its
pieces (handed to the event loop by the LLM's step loop, which batches every
request's steps; the loop sends each piece while the next step runs and
notices a client that left within DISCONNECT_CHECK_S, a streaming one at once
as Starlette cancels its response), and the OpenAI response bodies and stream
chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._errors import APIError
from ._metrics import ServerMetrics
from ._protocol import ChatRequest, CompletionRequest
from ._sessions import Entry
from ._threads import in_thread

if TYPE_CHECKING:
    from ..llm import LLM, Generation, RemoteGeneration, RemoteLLM, ToolCall, ToolCallStream
    from ..llm._prompts import ChatPrompt

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# How often a request asks whether its client left (Starlette's check costs
# more than sending a piece: once a step for every request was most of the
# server's time per token).
DISCONNECT_CHECK_S = 0.05


class Job:
    """A generation request: its session, its generation, and what it reports."""

    def __init__(self, llm: LLM | RemoteLLM, request: ChatRequest | CompletionRequest, model: str,
                 metrics: ServerMetrics) -> None:
        self.llm, self.request, self.model, self.metrics = llm, request, model, metrics
        self.entry: Entry | None = None
        self.chat = isinstance(request, ChatRequest)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.arrived = time.perf_counter()
        self.started = self.arrived  # when its generation joined the step loop (start())
        self.generation: Generation | RemoteGeneration | None = None
        self.cancelled = False
        self._counted = False
        # Checked before any session is touched: a bad request changes nothing.
        self.params = self._params()
        self.prompt: list[int] | ChatPrompt = []  # token ids (chat: with the text), from tokenize()
        self._piece_frame: tuple[bytes, bytes] | None = None  # piece_chunk's bytes around the text
        # The reply's tool calls, parsed from its text where tools were offered (llm/_tools.py).
        self.calls: ToolCallStream | None = None
        if isinstance(request, ChatRequest) and request.tools_offered():
            from ..llm import ToolCallStream

            self.calls = ToolCallStream()

    # -- start -----------------------------------------------------------
    def _params(self) -> Any:
        from ..llm._sampling import ParamError, SamplingParams

        r = self.request
        field, limit = r.limit()
        if limit is None and not self.chat:
            limit = COMPLETION_DEFAULT_MAX_TOKENS
        elif limit is not None and limit > self.llm.max_context:
            raise APIError(400, f"{field}: {limit} is more than the model's context of {self.llm.max_context} "
                                "tokens", "invalid_value", field)
        # No limit: until a stop or the end of the context.
        options: dict[str, Any] = {"max_tokens": limit, "stop": r.stops(), "ignore_eos": r.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(r, name) is not None:
                options[name] = getattr(r, name)
        if isinstance(r, ChatRequest):
            options["constraint"] = self._constraint(r)
        try:
            return SamplingParams(**options)
        except ParamError as e:  # the runtime's own bounds (seed, top_k, stop)
            raise APIError(400, str(e), "invalid_value", e.field) from e

    def _constraint(self, r: ChatRequest) -> Any:
        """What the reply is held to: response_format's schema, or calls of the
        tools where tool_choice asks for one (not both); None for neither."""
        if r.tools_offered() and self.llm.tool_format is None:
            raise APIError(400, f"the chat template of {self.model} renders no tools in a format this server parses "
                                "(Hermes/Qwen <tool_call>)", "invalid_value", "tools")
        field = "response_format"
        try:
            constraint = r.response_format.constraint() if r.response_format is not None else None
            field = "tools"
            calls = r.call_constraint()
        except ValueError as e:  # a schema the grammar engine refuses
            raise APIError(400, f"{field}: {e}", "invalid_value", field) from e
        if constraint is not None and calls is not None:
            raise APIError(400, "response_format and a tool_choice that asks for a call cannot both hold the reply",
                           "invalid_value", "tool_choice")
        return constraint if constraint is not None else calls

    async def tokenize(self) -> None:
        """The prompt as token ids (chat template, tokenizer, the runtime's
        checks), in a worker thread, before any session is touched (400 for a
        prompt the runtime refuses). A chat prompt keeps its text: the
        session keeps its own ids for the history it fed (llm/_prompts.py)."""
        from ..llm import ContextLengthError

        r = self.request
        prompt: Any = [m.as_dict() for m in r.messages] if isinstance(r, ChatRequest) else r.the_prompt()
        tools = r.tools_offered() if isinstance(r, ChatRequest) else None
        try:
            self.prompt = await in_thread(lambda: self.llm.prepare(prompt, tools))
        except (ValueError, TypeError) as e:
            code = "context_length_exceeded" if isinstance(e, ContextLengthError) else "invalid_value"
            raise APIError(400, str(e), code, "messages" if self.chat else "prompt") from e

    async def start(self, entry: Entry) -> None:
        """Starts the generation on ``entry``'s session, held by this request."""
        self.entry, session, params, prompt = entry, entry.session, self.params, self.prompt
        assert session is not None
        self.generation = await in_thread(lambda: session.start(prompt, params))
        self.started = self.generation.submitted
        self.metrics.time_to_start.observe(self.started - self.arrived)
        self.metrics.active += 1

    # -- steps -----------------------------------------------------------
    async def pieces(self, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        """The generated text until the generation ends or ``disconnected()``
        says the client left (then ``cancelled``).

        The LLM's step loop runs every request's generation in one batched
        step and hands each piece to the event loop (one wake-up a step for
        every request, _Relay), which sends it while the next step runs. A
        request that fell behind sends what piled up as one piece."""
        g, entry = self.generation, self.entry
        assert g is not None and entry is not None and entry.session is not None
        session = entry.session
        relay = _Relay.of(asyncio.get_running_loop())
        queue: asyncio.Queue[tuple[Any, int, float, int]] = asyncio.Queue()

        def sink(event: Any) -> None:
            # On the step loop's thread: the counts are read here, not waited for.
            relay.put(queue, (event, g.completion_tokens, time.perf_counter(), session.token_count))

        g.on_event(sink)
        tokens, last, checked = 0, self.arrived, time.perf_counter()
        while True:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            text: list[str] = []
            for event, count, now, entry.tokens in items:
                if isinstance(event, BaseException):
                    raise event
                if count > tokens:
                    if tokens == 0:
                        self.metrics.ttft.observe(now - self.arrived)
                        self.metrics.start_to_first_token.observe(now - self.started)
                    else:
                        self.metrics.token_gaps((now - last) / (count - tokens), count - tokens)
                    tokens, last = count, now
                if event is None:
                    if text:
                        yield "".join(text)
                    return
                text.append(event)
            if now - checked >= DISCONNECT_CHECK_S:
                checked = now
                if await disconnected():
                    self.cancelled = True
                    return
            if any(text):
                yield "".join(text)

    async def finish(self) -> None:
        """Cancels the generation if still running and counts its tokens;
        idempotent."""
        g = self.generation
        if g is None or self._counted:
            return
        self._counted = True
        if g.finish_reason is None:  # the client left, or a step failed
            self.cancelled = True
            await in_thread(g.close)
        m = self.metrics
        m.prompt_tokens.inc(g.prompt_tokens)
        m.prefilled_tokens.inc(g.prefilled_tokens)
        m.cached_tokens.inc(g.cached_tokens)
        m.generated_tokens.inc(g.completion_tokens)
        if self.cancelled:
            m.cancelled.inc()
        m.active -= 1

    # -- bodies ----------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        g = self.generation
        assert g is not None
        return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                "total_tokens": g.prompt_tokens + g.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": g.cached_tokens}}

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                "choices": choices}
        if self.entry is not None and self.entry.id is not None:
            body["session_id"] = self.entry.id
        return body

    def finish_reason(self) -> str | None:
        """The generation's, or "tool_calls" where it stopped after calling tools."""
        g = self.generation
        assert g is not None
        return "tool_calls" if g.finish_reason == "stop" and self.calls is not None and self.calls.calls else \
            g.finish_reason

    def response(self, text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.calls is not None:
                pieces = [*self.calls.push(text), *self.calls.finish()]
                content = "".join(p for p in pieces if isinstance(p, str))
                calls = [self._call(p) for p in pieces if not isinstance(p, str)]
                message = {"role": "assistant", "content": content if content.strip() or not calls else None}
                if calls:
                    message["tool_calls"] = calls
            choice["message"] = message
        else:
            choice["text"] = text
        choice["finish_reason"] = self.finish_reason()
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = self.usage()
        return body

    @staticmethod
    def _call(call: ToolCall) -> dict[str, Any]:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def stream_chunks(self, piece: str | None) -> list[bytes]:
        """The stream's chunks for a piece of text (None: the end, what is
        held back): the piece itself, or where tools were offered its text
        and calls (a call as one ``tool_calls`` delta, once its block closes)."""
        if self.calls is None:
            return [self.piece_chunk(piece)] if piece is not None else []
        out = []
        index = self.calls.calls
        for p in self.calls.push(piece) if piece is not None else self.calls.finish():
            if isinstance(p, str):
                out.append(self.piece_chunk(p))
                continue
            call = {"index": index, **self._call(p)}
            index += 1
            body = self._envelope(self._chunk_kind, [{"index": 0, "finish_reason": None, "logprobs": None,
                                                      "delta": {"tool_calls": [call]}}])
            if self.request.include_usage():
                body["usage"] = None
            out.append(_event(body))
        return out

    def piece_chunk(self, text: str) -> bytes:
        """``chunk(text)``, from the event's bytes around the text, made once
        (the hot path: one a generated piece)."""
        if self._piece_frame is None:
            sentinel = "\x00piece\x00"
            # The text is the last field that can hold it (a session id cannot; a model name before it can).
            head, _, tail = self.chunk(sentinel).rpartition(json.dumps(sentinel).encode())
            self._piece_frame = (head, tail)
        head, tail = self._piece_frame
        return head + json.dumps(text).encode() + tail

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = self._envelope(self._chunk_kind, [choice])
        if self.request.include_usage():
            body["usage"] = None
        return _event(body)

    def usage_chunk(self) -> bytes:
        body = self._envelope(self._chunk_kind, [])
        body["usage"] = self.usage()
        return _event(body)

    @property
    def _chunk_kind(self) -> str:
        """The ``object`` of a stream chunk (OpenAI streams completions as ``text_completion``)."""
        return "chat.completion.chunk" if self.chat else "text_completion"


class _Relay:
    """Hands items from the LLM's step loop (another thread) to the event
    loop's queues: one wake-up of the loop for all that one step produced,
    not one per request."""

    _relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Relay] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._armed = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Relay:
        relay = cls._relays.get(loop)
        if relay is None:
            relay = cls._relays[loop] = cls(loop)
        return relay

    def put(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """From any thread."""
        self._items.append((queue, item))
        if not self._armed:
            self._armed = True
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        # Disarmed before draining: an item put after the drain arms it again.
        self._armed = False
        while self._items:
            queue, item = self._items.popleft()
            queue.put_nowait(item)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
