"""One reply being generated on a chat session, a model step at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._sampling import SamplingParams, Sampler
from ._text import TextStream

if TYPE_CHECKING:
    from ._llm import ChatSession

__all__ = ["Completion", "Generation"]


@dataclass(frozen=True)
class Completion:
    """The outcome of one generation."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of sequence, stop string or token) or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens already in the session's cache (not prefilled again)
    completion_tokens: int


class _TokenReader:
    """Reads a sampled token on the host. On CUDA it waits on an event, which
    releases the GIL (``.item()`` would hold it while the step runs, and
    sessions on other threads could not queue theirs)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._token: torch.Tensor | None = None
        if self._cuda:
            self._host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def start(self, token: torch.Tensor) -> None:
        """Queues the copy of ``token`` (a one-element device tensor) to the host."""
        self._token = token
        if self._cuda:
            self._host.copy_(token.reshape(1), non_blocking=True)
            self._done.record()

    def finish(self) -> int:
        """The token :meth:`start` queued, once it has arrived."""
        if not self._cuda:
            assert self._token is not None
            return int(self._token)
        self._done.synchronize()
        return int(self._host[0])


class Generation:
    """One reply being generated; made by :meth:`ChatSession.start`.

    Each :meth:`step` runs the model once (a chunk of the prompt, or one new
    token) and returns the text that became final, or ``None`` once finished.
    """

    def __init__(self, session: ChatSession, prompt: list[int], params: SamplingParams) -> None:
        llm = session.llm
        self._session = session
        self.params = params
        self.prompt_tokens = len(prompt)
        # Keep the common prefix; the prompt's last token is always fed again,
        # as its logits pick the first new token.
        keep = 0
        for a, b in zip(session._tokens, prompt[:-1]):
            if a != b:
                break
            keep += 1
        del session._tokens[keep:]
        self.cached_tokens = keep
        self.prefilled_tokens = 0
        self._pending = prompt[keep:]
        self._next: torch.Tensor | None = None  # the last token, on the device: the next step's input
        self._sampler = Sampler(params, llm.generation_config, llm.device)
        self._reader = _TokenReader(llm.device)
        self._text = TextStream(llm.tokenizer, params.stop)
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else llm.eos_token_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._closed = False

    @property
    def text(self) -> str:
        """The text generated so far."""
        return self._text.text

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self._closed

    def step(self) -> str | None:
        session = self._session
        with session._lock:
            if self.finished:
                return None
            with torch.no_grad():
                if self._pending:
                    with session._on_stream():
                        logits = self._feed_prompt()
                        if logits is None:
                            return ""  # more of the prompt to go
                        self._sample(logits)
                # The token sampled last (by the previous step, or from the
                # prompt just now) is read; unless it ends the reply, the step
                # that feeds it is queued before its text is returned, so the
                # device computes the next token while the caller sends this one.
                # Waiting and decoding text need no stream: other sessions on it
                # queue their work meanwhile.
                piece = self._accept(self._reader.finish())
                if not self.finished:
                    with session._on_stream():
                        self._sample(self._feed_last())
                return piece

    def _sample(self, logits: torch.Tensor) -> None:
        self._next = self._sampler(logits)
        self._reader.start(self._next)

    def _feed_last(self) -> torch.Tensor:
        assert self._next is not None
        logits = self._run(self._next.view(1, 1), 1)
        self._session._tokens.append(self.token_ids[-1])
        return logits

    def _feed_prompt(self) -> torch.Tensor | None:
        chunk = self._pending[:self._session.llm.spec.max_prefill]
        logits = self._run(torch.tensor([chunk], dtype=torch.int64, device=self._session.llm.device), len(chunk))
        self._session._tokens.extend(chunk)
        self.prefilled_tokens += len(chunk)
        del self._pending[:len(chunk)]
        return None if self._pending else logits

    def _run(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        """Feeds ``count`` tokens at the next positions; the last one's logits."""
        session = self._session
        start = len(session._tokens)
        positions = torch.arange(start, start + count, dtype=torch.int64, device=ids.device)
        return session._session.run("prefill" if count > 1 else "decode", ids, positions)  # type: ignore[no-any-return]

    def _accept(self, token: int) -> str:
        if token in self._stop_ids:
            return self._finish("stop", "")
        self.token_ids.append(token)
        piece = self._text.push(token)
        if self._text.stopped:
            return self._finish("stop", piece)
        max_tokens = self.params.max_tokens
        if (max_tokens is not None and len(self.token_ids) >= max_tokens) \
                or len(self._session._tokens) >= self._session.llm.max_context:
            return self._finish("length", piece)
        return piece

    def _finish(self, reason: str, piece: str) -> str:
        self.finish_reason = reason
        self._session._release(self)
        return piece + self._text.flush()

    def completion(self) -> Completion:
        """What was generated (``finish_reason`` is ``"stop"`` if closed early)."""
        return Completion(text=self.text, token_ids=list(self.token_ids), finish_reason=self.finish_reason or "stop",
                          prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                          completion_tokens=self.completion_tokens)

    def close(self) -> None:
        """Stops generating (after the step in flight); the session keeps
        what was fed and is free for the next request. Idempotent."""
        session = self._session
        with session._lock:
            self._closed = True
            session._release(self)

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
