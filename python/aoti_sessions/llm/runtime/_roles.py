"""What the runtime's parts need of each other, as protocols: a part names
what it uses of another without importing it, so no import runs in a circle
(the LLM makes its step loop and its chat sessions, which make generations,
which call back into their session and the loop). The LLM, ChatSession and
Scheduler implement them; mypy checks that they do where each is handed over.
(A generation is typed ``Any`` here: this module imports no part.)"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ..._engine import Engine
    from ._grammar import Grammars
    from ._penalties import Penalties
    from .._spec import LLMSpec

__all__ = ["StepModel", "GenerationSession"]


class StepModel(Protocol):
    """What the step loop reads of the LLM it runs (llm/runtime/_llm.py's LLM)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def spec(self) -> LLMSpec: ...

    @property
    def max_context(self) -> int: ...


class _StepLoop(Protocol):
    """What a generation asks of the step loop that feeds it."""

    @property
    def penalties(self) -> Penalties: ...

    def cancel(self, generation: Any) -> None: ...


class _Model(Protocol):
    """What a generation reads of its LLM."""

    @property
    def spec(self) -> LLMSpec: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def generation_config(self) -> dict[str, Any]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def max_context(self) -> int: ...

    @property
    def _grammars(self) -> Grammars: ...

    @property
    def _scheduler(self) -> _StepLoop: ...


class GenerationSession(Protocol):
    """What a generation (llm/runtime/_generation.py) reads and tells of its chat
    session (:class:`~aoti_sessions.llm.ChatSession` is one)."""

    @property
    def id(self) -> int: ...

    @property
    def llm(self) -> _Model: ...

    @property
    def token_count(self) -> int: ...

    @property
    def _tokens(self) -> list[int]: ...

    @property
    def _lock(self) -> threading.Lock: ...

    def _keep(self, keep: int) -> int: ...

    def _took(self, tokens: list[int], width: int) -> None: ...

    def _prompt_fed(self, generation: Any) -> None: ...

    def _settle(self, token: int, keep: bool) -> None: ...

    def _release(self, generation: Any) -> None: ...
