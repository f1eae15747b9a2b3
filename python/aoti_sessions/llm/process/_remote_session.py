"""The proxies of a :class:`~aoti_sessions.llm.RemoteLLM`'s sessions and
generations (llm/process/_remote.py): :class:`RemoteSession` for a chat session of the
engine process, :class:`RemoteGeneration` for a generation, whose pieces
arrive from the engine process on the connection's reader thread. Each calls
the engine through its connection (:class:`EngineLink`, the RemoteLLM)."""

from __future__ import annotations

import os
from typing import Any, Protocol, TypeGuard

from ..._session import Closable
from ...errors import EngineProcessError, SessionBusyError, SessionClosedError
from ..runtime._generation import Pieces, TokenEvent
from ..runtime._logprobs import TokenLogprob
from ..runtime._params import SamplingParams, sampling_params
from ..runtime._prompts import ChatPrompt, Prompt
from ._remote_wire import Finals, Started
from ..runtime._text import TextStream


class EngineLink(Protocol):
    """What a proxy needs of its connection to the engine process (a RemoteLLM)."""

    text_here: bool  # generations' text made in this process (RemoteLLM's docstring)
    tokenizer: Any

    def prepare(self, prompt: Prompt) -> list[int] | ChatPrompt: ...

    def _call(self, op: str, *args: Any) -> Any: ...

    def _session(self, sid: int, tokens: int) -> RemoteSession: ...

    def _forget_generation(self, gid: int) -> None: ...


class RemoteSession(Closable):
    """A chat session of a :class:`RemoteLLM`."""

    def __init__(self, llm: EngineLink, sid: int, tokens: int) -> None:
        self._llm = llm
        self.id = sid
        self._tokens = tokens  # as of the last call or step that changed it
        self._active: RemoteGeneration | None = None
        self.closed = False

    @property
    def llm(self) -> EngineLink:
        return self._llm

    @property
    def token_count(self) -> int:
        """The tokens the cache holds, as of the last step (not waited for)."""
        return self._tokens

    @property
    def busy(self) -> bool:
        return self._active is not None and not self._active.finished

    def settle(self, timeout: float = 5.0) -> int:
        """Waits (up to ``timeout`` seconds) until no generation runs on it
        in the engine (one of another connection that went is being stopped);
        its token count, kept."""
        self._tokens = int(self._llm._call("settle", self.id, timeout))
        return self._tokens

    def counted(self, tokens: int) -> None:
        """Its token count as a generation of another connection left it
        (that connection's proxy saw the steps; this one did not)."""
        self._tokens = tokens

    @property
    def resident(self) -> bool:
        return bool(self._llm._call("resident", self.id))

    def start(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> RemoteGeneration:
        """Begins generating a reply to ``prompt`` (text and messages made
        into token ids here, messages as a ChatPrompt; the engine process
        checks the ids)."""
        params = sampling_params(params, kwargs)
        ids = list(prompt) if _token_ids(prompt) else self._llm.prepare(prompt)
        if self.busy:
            raise SessionBusyError(f"session {self.id} is busy: a generation is running on it")
        generation: RemoteGeneration = self._llm._call("start", self.id, ids, params)
        self._active = generation
        return generation

    def fork(self) -> RemoteSession:
        return self._llm._session(*self._llm._call("fork", self.id))

    def reset(self) -> None:
        self._llm._call("reset", self.id)
        self._tokens = 0

    def save(self, path: str | os.PathLike[str]) -> None:
        self._llm._call("save", self.id, os.fspath(path))

    def close(self) -> None:
        """Stops a running generation and frees the state; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._active is not None:
            self._active.close()
        try:
            self._llm._call("close_session", self.id)
        except (EngineProcessError, SessionClosedError):
            pass  # gone with the engine process or the LLM

    def __repr__(self) -> str:
        return f"RemoteSession(id={self.id}, {self._tokens} tokens{', busy' if self.busy else ''})"


class RemoteGeneration(Pieces):
    """A generation of a :class:`RemoteSession`: its pieces arrive from the
    engine process (on this process's reader thread)."""

    def __init__(self, session: RemoteSession, started: Started) -> None:
        llm = session._llm  # its events: token ids whose text is made here (text_here), else text
        super().__init__(TextStream(llm.tokenizer, started.stop, started.keep) if llm.text_here else None)
        self._session = session
        self.id = started.generation
        self.submitted = started.submitted
        self.prompt_tokens = started.prompt_tokens
        self.cached_tokens = started.cached_tokens
        self.prefilled_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._error: BaseException | None = None
        # Each generated token's logprob and the top ones at its step (SamplingParams.logprobs; else None).
        self.logprobs: list[TokenLogprob] | None = [] if started.logprobs else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self._closed or self._error is not None

    def _event(self, event: TokenEvent, completion_tokens: int, token_count: int, finals: Finals | None,
               logprobs: list[TokenLogprob] | None = None) -> None:
        if logprobs and self.logprobs is not None:
            self.logprobs.extend(logprobs)  # (before the count: a reader that sees the count sees them)
        self.completion_tokens = completion_tokens
        self._session._tokens = token_count
        if finals is not None:
            self._final(finals)
            if isinstance(event, BaseException):
                self._error = event
        self._emit(event)

    def _final(self, finals: Finals) -> None:
        self.finish_reason = finals.finish_reason
        self.prefilled_tokens = finals.prefilled_tokens
        self.completion_tokens = finals.completion_tokens

    def close(self) -> None:
        """Stops generating (after the step in flight); idempotent."""
        if self._closed:
            return
        self._closed = True
        llm = self._session._llm
        llm._forget_generation(self.id)
        if self.finish_reason is None and self._error is None:
            try:
                finals, tokens = llm._call("close_generation", self.id)
            except (EngineProcessError, SessionClosedError):
                pass
            else:
                if finals is not None:
                    self._final(finals)
                self._session._tokens = tokens
        # Its events from here on are dropped (it is out of the table): the end is this one.
        self._end_stream(self.finish_reason is not None or self._error is not None)


def _token_ids(prompt: Prompt) -> TypeGuard[list[int] | tuple[int, ...]]:
    """Whether ``prompt`` is token ids (a list or tuple of ints, checked by the LLM's ``prompt_ids``)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(type(t) is int for t in prompt)
