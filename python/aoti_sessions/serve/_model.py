"""What the server needs of the model it serves, of a chat session and of a
generation, as protocols: the in-process classes (``aoti_sessions.llm``'s
LLM, ChatSession, Generation) and the engine process's (RemoteLLM,
RemoteSession, RemoteGeneration) both implement them, and the server names
these instead of a union of the two (mypy checks each class where it is
handed to the server). Read-only members are properties: the classes keep
some as plain attributes, some as properties."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ..llm.interface import ChatPrompt, Event, LLMSpec, Prompt, ReplyFormat, SamplingParams, TokenLogprob

__all__ = ["ServedLLM", "ServedSession", "ServedGeneration"]


class ServedGeneration(Protocol):
    """One reply being generated: read by ``step`` or by a sink of its events."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def prefilled_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...

    @property
    def submitted(self) -> float: ...

    def step(self) -> str | None: ...

    def on_event(self, sink: Callable[[Event], None]) -> None: ...

    def close(self) -> None: ...


class ServedSession(Protocol):
    """One conversation's session: its cache and the tokens it holds."""

    @property
    def token_count(self) -> int: ...

    @property
    def resident(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    def start(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> ServedGeneration: ...

    def fork(self) -> ServedSession: ...

    def reset(self) -> None: ...

    def save(self, path: str | os.PathLike[str]) -> None: ...

    def close(self) -> None: ...


class ServedLLM(Protocol):
    """The model the server serves: its package's spec and prompt formats,
    its sessions, its counters."""

    @property
    def name(self) -> str: ...

    @property
    def spec(self) -> LLMSpec: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def max_context(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def generation_config(self) -> dict[str, Any]: ...

    @property
    def reply_format(self) -> ReplyFormat: ...

    @property
    def prompt_options(self) -> dict[str, Any]: ...

    @property
    def alive(self) -> bool: ...

    def prepare(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> list[int] | ChatPrompt: ...

    def new_session(self, prompt: Prompt | None = None, *, cache: str | None = None) -> ServedSession: ...

    def load_session(self, path: str | os.PathLike[str]) -> ServedSession: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


if TYPE_CHECKING:
    from ..llm import LLM, ChatSession, Generation, RemoteGeneration, RemoteLLM, RemoteSession

    def _implemented(llm: LLM, remote: RemoteLLM, session: ChatSession, remote_session: RemoteSession,
                     generation: Generation, remote_generation: RemoteGeneration) -> None:
        """mypy's check that both kinds implement the protocols."""
        served: ServedLLM = llm
        served = remote
        chat: ServedSession = session
        chat = remote_session
        reply: ServedGeneration = generation
        reply = remote_generation
