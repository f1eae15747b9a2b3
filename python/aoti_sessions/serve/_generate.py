"""One generation request from start to end: its sampling parameters, the
step loop (one model step per await, in a worker thread, so the event loop
interleaves requests token by token and notices a client that left within one
step), and the OpenAI response bodies and stream chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from ._errors import APIError
from ._metrics import ServerMetrics
from ._protocol import ChatRequest, CompletionRequest
from ._sessions import Entry, in_thread

if TYPE_CHECKING:
    from ..llm import LLM, Generation

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Job:
    """A generation request: its session, its generation, and what it reports."""

    def __init__(self, llm: LLM, request: ChatRequest | CompletionRequest, model: str,
                 metrics: ServerMetrics) -> None:
        self.llm, self.request, self.model, self.metrics = llm, request, model, metrics
        self.entry: Entry | None = None
        self.chat = isinstance(request, ChatRequest)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.arrived = time.perf_counter()
        self.generation: Generation | None = None
        self.cancelled = False
        self._counted = False
        # Checked before any session is touched: a bad request changes nothing.
        self.params, self.prompt = self._params(), self._prompt()

    # -- start -----------------------------------------------------------
    def _params(self) -> Any:
        from ..llm import SamplingParams

        r = self.request
        field, limit = r.limit()
        if limit is None and not self.chat:
            limit = COMPLETION_DEFAULT_MAX_TOKENS
        elif limit is not None and limit > self.llm.max_context:
            raise APIError(400, f"{field}: {limit} is more than the model's context of {self.llm.max_context} "
                                "tokens", "invalid_value", field)
        # No limit: until a stop or the end of the context.
        options: dict[str, Any] = {"max_tokens": limit, "stop": r.stops()}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(r, name) is not None:
                options[name] = getattr(r, name)
        return SamplingParams(**options)

    def _prompt(self) -> Any:
        if isinstance(self.request, ChatRequest):
            return [m.as_dict() for m in self.request.messages]
        prompt = self.request.the_prompt()
        if isinstance(prompt, list):
            vocab = self.llm.spec.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                               "invalid_value", "prompt")
        return prompt

    async def start(self, entry: Entry) -> None:
        """Starts the generation on ``entry``'s session, held by this request
        (400 for a prompt or parameters the runtime refuses)."""
        self.entry, session, params, prompt = entry, entry.session, self.params, self.prompt
        assert session is not None
        try:
            self.generation = await in_thread(lambda: session.start(prompt, params))
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) else "invalid_value"
            raise APIError(400, str(e), code, "messages" if self.chat else "prompt") from e
        self.metrics.active += 1

    # -- steps -----------------------------------------------------------
    async def pieces(self, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        """The generated text, piece by piece, until the generation ends or
        ``disconnected()`` says the client left (then ``cancelled``)."""
        g, entry = self.generation, self.entry
        assert g is not None and entry is not None and entry.session is not None
        session = entry.session

        def step() -> tuple[str | None, int]:
            return g.step(), len(session.tokens)  # the count for listings, read here: no waiting on the loop

        tokens, last = 0, self.arrived
        while True:
            if await disconnected():
                self.cancelled = True
                return
            piece, entry.tokens = await anyio.to_thread.run_sync(step)
            now = time.perf_counter()
            if g.completion_tokens > tokens:
                if tokens == 0:
                    self.metrics.ttft.observe(now - self.arrived)
                else:
                    self.metrics.itl.observe((now - last) / (g.completion_tokens - tokens))
                tokens, last = g.completion_tokens, now
            if piece is None:
                return
            if piece:
                yield piece

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

    def response(self, text: str) -> dict[str, Any]:
        g = self.generation
        assert g is not None
        choice: dict[str, Any] = {"index": 0, "finish_reason": g.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = self.usage()
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.request.include_usage():
            body["usage"] = None
        return _event(body)

    def usage_chunk(self) -> bytes:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage()
        return _event(body)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
