"""One reply being generated on a chat session. The LLM's scheduler
(_scheduler.py) runs its model steps, batched with every other generation;
the caller reads the text as it comes, with ``step()`` or a callback.

The step loop hands out token ids, never text: the text is made where it is
read (:class:`Pieces`: by the thread calling ``step()``, or for a callback
the thread that hands the tokens over). Only a generation with stop strings
has its text made in the step loop too, to end where one appears; the
reading side's text then ends there as well (the same tokens, the same
decoder). (An engine process hands its server the text, made by such a
callback: with one front end, the server's process is the busier of the
two: docs/batching.md.)"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ..._session import Closable
from ...errors import SessionClosedError
from ._logprobs import TokenLogprob
from ._params import ParamError, SamplingParams
from ._sampling import Sampler
from ._text import TextStream, decoded

if TYPE_CHECKING:
    from ._roles import GenerationSession

__all__ = ["Completion", "Generation", "Pieces", "Event", "TokenEvent", "Held"]


# What a generation hands out: a piece of text, None once finished, or the
# error that ended it.
Event = Union[str, None, BaseException]
# What the step loop hands out: a token id, None once finished, or the error
# (or, from an engine process, text already made).
TokenEvent = Union[int, str, None, BaseException]


@dataclass(frozen=True)
class Completion:
    """The outcome of one generation."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of sequence, stop string or token) or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens already in the session's cache (not prefilled again)
    completion_tokens: int
    # Each token's logprob and the top ones at its step (SamplingParams.logprobs; else None).
    logprobs: list[TokenLogprob] | None = None


class Pieces(Closable):
    """The reading side of a generation: its token ids made into pieces of
    text, read with :meth:`step` or handed to a sink (``with`` closes it).
    The text is made by the reading thread (``reading``: a TextStream with
    the generation's stop strings; None where the events are text already)."""

    def __init__(self, reading: TextStream | None) -> None:
        self._closed = False
        self._cond = threading.Condition()
        self._events: deque[TokenEvent] = deque()
        self._sink: Callable[[TokenEvent], None] | None = None
        self._over = False  # the end (None or an error) went out
        self._cut: BaseException | None = None  # a sink's end of a generation closed before it finished
        self._reading = reading  # the text read so far
        self._flushed = False  # the text held back at the end went out

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def step(self) -> str | None:
        """The next piece of text (waiting for it), or ``None`` once finished
        or closed; raises the error that ended the generation, if one did."""
        with self._cond:
            while self._closed or not self._events:  # (closed: what was handed out and not read is dropped)
                if self._closed or (self.finished and self._sink is None):
                    return None
                self._cond.wait()
            event = self._events.popleft()
            if event is None:
                self._events.appendleft(None)  # finished: every later step says so too
        if isinstance(event, BaseException):
            raise event
        return self._piece(event)

    def _piece(self, event: int | str | None) -> str | None:
        """The text of a token id, or at the end (None) the text held back
        (if any: None follows it)."""
        if isinstance(event, str):
            return event  # (text already)
        if event is not None:
            assert self._reading is not None, "a token id where text was expected"
            return self._reading.push(event)
        if not self._flushed and self._reading is not None:
            self._flushed = True
            rest = self._reading.flush()
            if rest:
                return rest
        return None

    def on_event(self, sink: Callable[[Event], None]) -> None:
        """Hands every later piece of text (and ``None`` at the end, or the
        error) to ``sink``, called on the thread that hands out the tokens
        (the scheduler's; it must not block), which then makes their text;
        what came before is handed over first, here."""

        def texts(event: TokenEvent) -> None:
            if isinstance(event, BaseException):
                sink(event)
                return
            piece = self._piece(event)
            if event is None and piece is not None:  # the text held back, then the end
                sink(piece)
                piece = self._piece(None)
            sink(piece)

        self.on_tokens(texts)

    def on_tokens(self, sink: Callable[[TokenEvent], None]) -> None:
        """Hands every later event as it is (token ids, ``None`` at the end,
        or the error) to ``sink``, on the thread that hands out the tokens;
        whoever reads them makes their text (an engine process's connection
        whose process does, _remote_engine.py); what came before first, here."""
        with self._cond:
            while self._events:
                sink(self._events.popleft())
            if self._cut is not None:
                sink(self._cut)
            self._sink = sink

    def _emit(self, event: TokenEvent) -> None:
        with self._cond:
            if event is None or isinstance(event, BaseException):
                self._over = True
            if self._sink is not None:
                self._sink(event)
            else:
                self._events.append(event)
                self._cond.notify_all()

    def _end_stream(self, finished: bool) -> None:
        """Ends the stream of a generation just closed, unless its end went
        out: a sink (whose reader waits for an end) gets None where the
        generation had finished, else an error saying it was closed first;
        :meth:`step` says None (it was closed)."""
        with self._cond:  # (a reentrant lock)
            if finished and not self._over:
                self._emit(None)
            elif not self._over:
                self._over = True
                self._cut = SessionClosedError("the generation was closed before it finished")
                if self._sink is not None:
                    self._sink(self._cut)
            self._cond.notify_all()


class Generation(Pieces):
    """One reply being generated; made by :meth:`ChatSession.start`.

    Each :meth:`step` returns the next piece of text that became final (one
    per generated token; possibly empty), or ``None`` once finished.
    """

    def __init__(self, session: GenerationSession, prompt: list[int], params: SamplingParams) -> None:
        llm = session.llm
        vocab = llm.spec.vocab_size
        if params.biases and params.biases[-1][0] >= vocab:  # (in id order)
            raise ParamError("logit_bias", f"logit_bias: token id {params.biases[-1][0]} is not in the "
                                           f"vocabulary of {vocab} tokens")
        # A constraint's grammar is compiled (or copied) first: one the vocabulary cannot spell changes nothing.
        self._guide = llm._grammars.guide(params.constraint) if params.constraint is not None else None
        self._guided: tuple[int, str | ValueError] | None = None  # (token, what the guide said of it), not handed out
        super().__init__(TextStream(llm.tokenizer, params.stop, params.keep_special_tokens))
        self._session = session
        self.params = params
        self.prompt_tokens = len(prompt)
        # Keep the common prefix; the prompt's last token is always fed again,
        # as its logits pick the first new token. The cache forgets the rest.
        keep = 0
        for a, b in zip(session._tokens, prompt[:-1]):
            if a != b:
                break
            keep += 1
        keep = session._keep(keep)
        self.cached_tokens = keep
        self.prefilled_tokens = 0
        # Tokens still to feed (the scheduler's): the prompt's, then (recurrent
        # state) a generated one, once read.
        self._pending = prompt[keep:]
        # The step queued last fed this generation's unread sampled token
        # (the scheduler holds the session's lock until it is read).
        self._fed_ahead = False
        self._sampler = Sampler(params, llm.generation_config, llm.device, prompt, llm._scheduler.penalties)
        # Each generated token's logprob and the top ones at its step (SamplingParams.logprobs).
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Stop strings end the reply in the step loop: its text is made there too (else only where it is read).
        self._stops = TextStream(llm.tokenizer, params.stop, params.keep_special_tokens) if params.stop else None
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else llm.eos_token_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._ending: str | None = None  # the finish reason once the last token is handed out
        self._error: BaseException | None = None
        self._ended = False  # finished: a finish reason, an error, or closed (read every step: kept, not derived)
        self._released = threading.Event()  # set once the scheduler no longer holds it
        # Read for every row of every step: kept here, not looked up each time.
        self._max_context = llm.max_context
        self._recurrent = llm.spec.recurrent
        self.submitted = 0.0  # time.perf_counter() when it joined the step loop

    @property
    def text(self) -> str:
        """The text of the tokens generated so far (what a reader was, or
        will be, handed: without an unfinished character at the end, cut
        where a stop string begins; made here if not read)."""
        if self._stops is not None:
            return self._stops.text
        if self._flushed:  # a reader took every piece: its text is the whole
            assert self._reading is not None
            return self._reading.text
        return decoded(self._session.llm.tokenizer, self.token_ids, self.finished, self.params.keep_special_tokens)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self._ended

    # -- the scheduler's side ----------------------------------------------------
    def _fed(self, count: int) -> None:
        """``count`` tokens of ``_pending`` were fed (a sampled token fed ahead needs no record)."""
        if count:
            del self._pending[:count]
            # Not a generated token fed once read: the prompt's tokens not yet fed at most.
            self.prefilled_tokens += min(count, self.prompt_tokens - self.cached_tokens - self.prefilled_tokens)

    def _took(self, tokens: list[int], width: int) -> None:
        """(Its session held: :class:`Held`) the step fed ``tokens``, the
        start of ``_pending``, in a call ``width`` tokens wide (ChatSession._took)."""
        self._session._took(tokens, width)
        self._fed(len(tokens))

    def _took_unread(self) -> None:
        """(Its session held) the step fed the token sampled last, before it
        is read: the session stays held until :meth:`_take_token`."""
        self._fed_ahead = True

    def _room_for_next(self) -> bool:
        """Whether the token the last step sampled (not read yet) is to be
        fed, unless it is a stop token: not at max_tokens or the context's end."""
        max_tokens = self.params.max_tokens
        return (max_tokens is None or len(self.token_ids) + 1 < max_tokens) \
            and len(self._session._tokens) < self._max_context

    def _feeds_next(self) -> bool:
        """Whether the step queued next feeds the last step's token before it
        is read: where there is room, except for a model with recurrent state,
        which could not take a stop token back out (its token is fed once
        read, as a one-token chunk)."""
        return not self._recurrent and self._room_for_next()

    def _take_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """A sampled token, read (the next step was queued): recorded (with
        its ``logprob``, where asked), then handed out. Where the step queued since fed it, the session settles
        it (ChatSession._settle: its token list gains it, or, for a stop
        token or a generation that ended meanwhile, its cache forgets it;
        then its lock goes). With stop strings, the generation ends where
        its text has one."""
        fed, self._fed_ahead = self._fed_ahead, False
        session = self._session
        if not fed and not self.token_ids:  # the first: the whole prompt is in (and, recurrent, no more)
            session._prompt_fed(self)
        keep = not self._ended and token not in self._stop_ids
        grammar, refused = "more", None
        if self._guide is not None:
            if self._guided is None or self._guided[0] != token:
                self._guide_token(token)
            assert self._guided is not None
            taken, self._guided = self._guided[1], None
            if keep:
                if isinstance(taken, ValueError):
                    refused = taken
                else:
                    grammar = taken
                keep = grammar != "end" and refused is None
        if fed:
            try:
                session._settle(token, keep)
            except Exception as e:  # noqa: BLE001 - its session closed under it
                if not self._ended:
                    self._fail(e)
                return
        if self._ended:
            return
        if refused is not None:
            self._fail(refused)
            return
        if not keep:
            self._finish("stop", None)
            return
        if not fed and grammar != "done":
            if self._room_for_next():  # (counted before the token joins token_ids) recurrent: fed now it is read
                self._pending.append(token)
            else:  # at max_tokens or the context's end
                self._ending = "length"
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        self.token_ids.append(token)
        if self._ended:  # (closed meanwhile, on another thread)
            return
        if self._stops is not None:
            self._stops.push(token)
            if self._stops.stopped:
                self._finish("stop", token)
                return
        if grammar == "done":  # (nothing but the end can follow)
            self._finish("stop", token)
        elif self._ending is not None:
            self._finish(self._ending, token)
        else:
            self._emit(token)

    def _guide_token(self, token: int) -> None:
        """(The step loop, before it hands the token out, so that the next
        step's mask can be computed first; else :meth:`_take_token`) the
        guide takes a sampled token: what it said is kept for _take_token."""
        assert self._guide is not None
        try:
            self._guided = (token, self._guide.take(token))
        except ValueError as e:
            self._guided = (token, e)

    def _finish(self, reason: str, token: int | None) -> None:
        """Ends the generation (``token``: its last one to hand out, if any)."""
        if self._stops is not None:
            self._stops.flush()
        # Finished, and the last token and the end out, at once: a reader never
        # sees the generation finished before its last events.
        with self._cond:
            self.finish_reason = reason
            self._ended = True
            self._session._release(self)
            if token is not None:
                self._emit(token)
            self._emit(None)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._ended = True
            self._session._release(self)
            self._emit(error)

    # -- the caller's side -------------------------------------------------------
    def completion(self) -> Completion:
        """What was generated (``finish_reason`` is ``"stop"`` if closed early)."""
        return Completion(text=self.text, token_ids=list(self.token_ids), finish_reason=self.finish_reason or "stop",
                          prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                          completion_tokens=self.completion_tokens,
                          logprobs=list(self.logprobs) if self.logprobs is not None else None)

    def close(self) -> None:
        """Stops generating (after the step in flight); the session keeps
        what was fed and is free for the next request. Idempotent."""
        if self._closed:
            return
        self._closed = self._ended = True
        self._session.llm._scheduler.cancel(self)
        self._session._release(self)
        # (The step loop is done with it: no piece can follow this end.)
        self._end_stream(self.finish_reason is not None or self._error is not None)


class Held:
    """The locks of the chat sessions a step feeds, taken in id order and
    released after the block but for those kept: a session whose unread
    token the step fed stays held until :meth:`Generation._take_token`
    records it (a fork or save then sees its cache and tokens agree)."""

    def __init__(self, sessions: Sequence[GenerationSession]) -> None:
        self._sessions = sorted(sessions, key=lambda s: s.id)
        self._kept: set[int] = set()

    def __enter__(self) -> Held:
        taken = []
        try:
            for s in self._sessions:
                s._lock.acquire()
                taken.append(s)
        except BaseException:
            for s in reversed(taken):
                s._lock.release()
            raise
        return self

    def keep(self, session: GenerationSession) -> None:
        self._kept.add(id(session))

    def __exit__(self, *exc: object) -> None:
        for s in reversed(self._sessions):
            if id(s) not in self._kept:
                s._lock.release()
