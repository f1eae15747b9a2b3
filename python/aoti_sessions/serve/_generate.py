"""One generation request from start to end: its sampling parameters, its
choices' pieces (handed to the event loop by the LLM's step loop, which
batches every request's steps; the loop sends each piece while the next step
runs and notices a client that left within DISCONNECT_CHECK_S, a streaming
one at once as Starlette cancels its response), and the OpenAI response
bodies and stream chunks, logprobs included (_logprobs.py).

``n`` choices: the prompt is prefilled once on the request's session (a
generation of one token, dropped), then the first choice runs on that
session and each other on a fork of it, each feeding the prompt's last token
again; all in the same batched steps, each with its own random stream (a
seeded request's choice i draws with seed + i, so it stays reproducible, and
equals a request of n=1 with that seed). Usage counts the prompt once; a
named session keeps the first choice's reply, as with n=1. (Recurrent state
cannot rewind by one position: a hybrid model's choices feed the prompt
again from the turn's checkpoint, llm/runtime/_llm.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._bodies import Bodies, Choice
from ._errors import APIError
from ._logprobs import TokenTexts, token_texts
from ._metrics import ServerMetrics
from ._protocol import ChatRequest, CompletionRequest
from ._entry import Entry
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedGeneration, ServedLLM
    from ..llm.interface import ChatPrompt

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# How often a request asks whether its client left (Starlette's check costs
# more than sending a piece: once a step for every request was most of the
# server's time per token).
DISCONNECT_CHECK_S = 0.05


# The prefill of a prompt that several choices fork from: one token drawn
# (greedy), never fed, so the session holds the prompt and nothing after it.
_PREFILL_ONLY: dict[str, Any] = {"max_tokens": 1, "temperature": 0}


class Job(Bodies):
    """A generation request: its session, its choices' generations, and what it reports."""

    def __init__(self, llm: ServedLLM, request: ChatRequest | CompletionRequest, model: str,
                 metrics: ServerMetrics) -> None:
        self.llm, self.request, self.model, self.metrics = llm, request, model, metrics
        self.entry: Entry | None = None
        self.chat = isinstance(request, ChatRequest)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.arrived = time.perf_counter()
        self.started = self.arrived  # when its generation joined the step loop (start())
        self.choices: list[Choice] = []
        # n > 1: the generation that prefilled the prompt once, and the forks of its session (one a choice after
        # the first, which keeps the request's session).
        self.prefill: ServedGeneration | None = None
        self.forks: list[Any] = []
        self.cancelled = False
        self._counted = False
        self._tools = request.tools_offered() if isinstance(request, ChatRequest) else None
        self._holds_calls = False  # the constraint holds the reply to tool calls (tool_choice)
        # The prompt's text where the model's reply format reads the reply (its reasoning, its tool calls:
        # llm/runtime/_replies.py), from tokenize(): each choice reads its reply in pieces after it. None: not read.
        self._reply_after: str | None = None
        self._active = False  # counted in metrics.active (start() succeeded)
        # Checked before any session is touched: a bad request changes nothing.
        self.params = self._params()
        self.texts: TokenTexts | None = None  # the tokens' text for logprobs (tokenize())
        self.prompt: list[int] | ChatPrompt = []  # token ids (chat: with the text), from tokenize()
        self._piece_frames: dict[int, tuple[bytes, bytes]] = {}  # piece_chunk's bytes around the text, by choice

    @property
    def generation(self) -> ServedGeneration | None:
        """The first choice's generation (None before start())."""
        return self.choices[0].generation if self.choices else None

    # -- start -----------------------------------------------------------
    def _params(self) -> Any:
        from ..llm.interface import ParamError, SamplingParams

        r = self.request
        field, limit = r.limit()
        if limit is None and not self.chat:
            limit = COMPLETION_DEFAULT_MAX_TOKENS
        elif limit is not None and limit > self.llm.max_context:
            raise APIError(400, f"{field}: {limit} is more than the model's context of {self.llm.max_context} "
                                "tokens", "invalid_value", field)
        # No limit: until a stop or the end of the context.
        options: dict[str, Any] = {"max_tokens": limit, "stop": r.stops(), "ignore_eos": r.ignore_eos,
                                   "logprobs": r.top_logprobs_asked()}
        for name in ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "stop_token_ids"):
            if getattr(r, name) is not None:
                options[name] = getattr(r, name)
        if r.logit_bias:
            vocab = self.llm.spec.vocab_size
            bias = {int(k): v for k, v in r.logit_bias.items()}
            if (outside := max(bias)) >= vocab:
                raise APIError(400, f"logit_bias: token id {outside} is not in the model's vocabulary of {vocab} "
                                    "tokens", "invalid_value", "logit_bias")
            options["logit_bias"] = bias
        if isinstance(r, ChatRequest):
            options["constraint"] = self._constraint(r)
            options["keep_special_tokens"] = self.llm.reply_format.keep(self._tools is not None)
        try:
            return SamplingParams(**options)
        except ParamError as e:  # the runtime's own bounds (seed, top_k, stop)
            raise APIError(400, str(e), "invalid_value", e.field) from e

    def _constraint(self, r: ChatRequest) -> Any:
        """What the reply is held to: response_format's schema, or calls of the
        tools where tool_choice asks for one (not both); None for neither.
        (Where the model reasons, it holds what follows the reasoning: tokenize().)"""
        formats = self.llm.reply_format
        if self._tools and formats.tools is None:
            raise APIError(400, f"the chat template of {self.model} renders no tools in a format this server reads "
                                "(hermes, llama3_json, mistral, harmony)", "invalid_value", "tools")
        field = "response_format"
        try:
            constraint = r.response_format.constraint() if r.response_format is not None else None
            field = "tools"
            called = r.called()
            calls = formats.tool_constraint(self._tools, *called) if called is not None and self._tools else None
        except ValueError as e:  # a schema the grammar engine refuses
            raise APIError(400, f"{field}: {e}", "invalid_value", field) from e
        if constraint is not None and calls is not None:
            raise APIError(400, "response_format and a tool_choice that asks for a call cannot both hold the reply",
                           "invalid_value", "tool_choice")
        self._holds_calls = calls is not None
        return constraint if constraint is not None else calls

    async def tokenize(self) -> None:
        """The prompt as token ids (chat template, tokenizer, the runtime's
        checks), in a worker thread, before any session is touched (400 for a
        prompt the runtime refuses). A chat prompt keeps its text: the
        session keeps its own ids for the history it fed (llm/runtime/_prompts.py)."""
        from ..llm import ContextLengthError

        r = self.request
        prompt: Any = [m.as_dict() for m in r.messages] if isinstance(r, ChatRequest) else r.the_prompt()
        kwargs = r.template_kwargs() if isinstance(r, ChatRequest) else None
        try:
            self.prompt = await in_thread(lambda: self.llm.prepare(prompt, self._tools, kwargs))
        except (ValueError, TypeError) as e:
            code = "context_length_exceeded" if isinstance(e, ContextLengthError) else "invalid_value"
            raise APIError(400, str(e), code, "messages" if self.chat else "prompt") from e
        formats = self.llm.reply_format
        if isinstance(r, ChatRequest) and formats.reads(self._tools is not None):
            text = self._reply_after = getattr(self.prompt, "text", "")
            try:
                held = formats.after_reasoning(self.params.constraint, text, calls=self._holds_calls)
            except ValueError as e:
                field = "tools" if self._holds_calls else "response_format"
                raise APIError(400, f"{field}: {e}", "invalid_value", field) from e
            if held is not self.params.constraint:
                self.params = dataclasses.replace(self.params, constraint=held)
        if self.params.logprobs is not None:
            self.texts = await in_thread(lambda: token_texts(self.llm))

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (after :meth:`tokenize`)."""
        prompt = self.prompt
        return prompt if isinstance(prompt, list) else prompt.ids

    async def start(self, entry: Entry) -> None:
        """Starts the generations on ``entry``'s session, held by this
        request: one, or for ``n`` choices, a prefill of the prompt, then the
        first choice on the session and each other on a fork of it (the
        prompt read once: each choice feeds its last token again). A named
        session keeps the first choice's reply."""
        self.entry, session, params, prompt = entry, entry.session, self.params, self.prompt
        assert session is not None
        n = self.request.choices()
        if n == 1:
            self.choices = [self._choice(0, await in_thread(lambda: session.start(prompt, params)), session)]
        else:
            await self._start_choices(session, n)
        self.started = self.choices[0].generation.submitted
        self.metrics.time_to_start.observe(self.started - self.arrived)
        self.metrics.active += 1
        self._active = True

    async def _start_choices(self, session: Any, n: int) -> None:
        prefill = await in_thread(lambda: session.start(self.prompt, **_PREFILL_ONLY))
        self.prefill = prefill

        def fork_and_start() -> None:  # (what it made is kept as it goes: finish() closes it, however this ends)
            while prefill.step() is not None:
                pass
            for _ in range(n - 1):
                self.forks.append(session.fork())
            for i, on in enumerate([session, *self.forks]):
                self.choices.append(self._choice(i, on.start(self.prompt, self._choice_params(i)), on))

        await in_thread(fork_and_start)

    def _choice_params(self, index: int) -> Any:
        """Choice ``index``'s parameters: a seeded request's choices draw from seeds in a row, seed + index."""
        seed = self.params.seed
        if index == 0 or seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=(seed + index) % (1 << 64))

    def _choice(self, index: int, generation: ServedGeneration, session: Any) -> Choice:
        reply = None
        if self._reply_after is not None:
            reply = self.llm.reply_format.stream(self._reply_after, tools=self._tools is not None)
        return Choice(index, generation, session, reply)

    # -- steps -----------------------------------------------------------
    async def pieces(self, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[tuple[Choice, str]]:
        """Each choice's generated text until every one ends or
        ``disconnected()`` says the client left (then ``cancelled``).

        The LLM's step loop runs every request's generation in one batched
        step and hands each piece to the event loop (one wake-up a step for
        every request, _Relay), which sends it while the next step runs. A
        choice that fell behind sends what piled up as one piece (with the
        logprobs of its tokens: :meth:`Choice.logprobs_since`)."""
        entry = self.entry
        assert self.choices and entry is not None
        relay = _Relay.of(asyncio.get_running_loop())
        queue: asyncio.Queue[tuple[Choice, Any, int, float, int]] = asyncio.Queue()
        for c in self.choices:
            def sink(event: Any, c: Choice = c, g: Any = c.generation, session: Any = c.session) -> None:
                # On the step loop's thread: the counts are read here, not waited for.
                relay.put(queue, (c, event, g.completion_tokens, time.perf_counter(), session.token_count))

            c.generation.on_event(sink)
        first, running = self.choices[0], len(self.choices)
        tokens, last, checked = 0, self.arrived, time.perf_counter()
        while True:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            woken: list[Choice] = []
            for c, event, count, now, held in items:
                if isinstance(event, BaseException):
                    raise event
                c.count = count
                if c is first:
                    entry.tokens = held
                    if count > tokens:
                        if tokens == 0:
                            self.metrics.ttft.observe(now - self.arrived)
                            self.metrics.start_to_first_token.observe(now - self.started)
                        else:
                            self.metrics.token_gaps((now - last) / (count - tokens), count - tokens)
                        tokens, last = count, now
                if c not in woken:
                    woken.append(c)
                if event is None:
                    c.done = True
                    running -= 1
                else:
                    c.pending.append(event)
            if running and now - checked >= DISCONNECT_CHECK_S:
                checked = now
                if await disconnected():
                    self.cancelled = True
                    return
            for c in woken:
                text = "".join(c.pending)
                c.pending.clear()
                # (At its end, its last text, and the logprobs not yet sent with text, if any.)
                if text or (c.done and c.sent < c.count and c.generation.logprobs is not None):
                    yield c, text
            if not running:
                return

    async def finish(self) -> None:
        """Cancels the generations still running and counts their tokens;
        closes the forks; idempotent."""
        if (not self.choices and self.prefill is None) or self._counted:
            await self._close_forks()
            return
        self._counted = True
        generations = [*([self.prefill] if self.prefill is not None else []), *(c.generation for c in self.choices)]
        for g in generations:
            if g.finish_reason is None:  # the client left, or a step failed
                self.cancelled = True
                await in_thread(g.close)
        await self._close_forks()
        m, read = self.metrics, generations[0]  # (the prompt's counts: the prefill's, for n choices)
        m.prompt_tokens.inc(read.prompt_tokens)
        m.prefilled_tokens.inc(sum(g.prefilled_tokens for g in generations))
        m.cached_tokens.inc(read.cached_tokens)
        m.generated_tokens.inc(sum(c.generation.completion_tokens for c in self.choices))
        if self.cancelled:
            m.cancelled.inc()
        if self._active:
            m.active -= 1

    async def _close_forks(self) -> None:
        forks, self.forks = self.forks, []
        for session in forks:
            await in_thread(session.close)


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
