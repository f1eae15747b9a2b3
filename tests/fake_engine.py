"""A fake engine for the step loop (aoti_sessions.llm.runtime._scheduler): no
exported model, a model in a few lines whose next token is a hash of every
token its session's cache holds, so a token fed twice, fed to the wrong
session, left in the cache after a stop or dropped anywhere changes every
later token. FakeLLM is what ChatSession, Generation and the Scheduler read
of an LLM (tests/test_scheduler_fake.py; bench/profile_llm.py
--step-loop-fake times the loop's host work on it)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from aoti_sessions.llm.runtime._llm import ChatSession
from aoti_sessions.llm.runtime._plan import Limits
from aoti_sessions.llm.runtime._scheduler import Scheduler
from aoti_sessions.llm._spec import PAD_ID

VOCAB = 48
EOS = 0
CONTEXT = 96


def next_token(cache: Sequence[int]) -> int:
    """The fake model: a hash of the whole cache, position by position."""
    h = 17
    for position, token in enumerate(cache):
        h = (h * 1_000_003 + (position + 1) * 7919 + token) % 2_147_483_647
    return h % VOCAB


def one_hot(token: int) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    logits[0, token] = 1.0
    return logits


class FakeSession:
    """An engine session: its cache is the list of token ids fed to it."""

    def __init__(self, sid: int, engine: FakeEngine) -> None:
        self.id = sid
        self.cache: list[int] = []
        self.closed = False
        self.checkpoints: list[int] = []
        self._engine = engine

    def truncate(self, length: int) -> None:
        assert 0 <= length <= len(self.cache), (length, len(self.cache))
        del self.cache[length:]

    def run(self, method: str, ids: torch.Tensor) -> torch.Tensor:
        return self._engine.run_batch(method, [self], ids)

    def feed(self, row: list[int]) -> torch.Tensor:
        """Appends every position of ``row`` (padding too, as a compiled
        prefill writes it; the step loop truncates it); the logits at its
        last real token."""
        self.cache.extend(row)
        real = len(self.cache) - (len(row) - max(i for i, t in enumerate(row) if t != PAD_ID) - 1)
        assert len(self.cache) <= CONTEXT, "fed past the context"
        return one_hot(next_token(self.cache[:real]))


class FakeEngine:
    """What the step loop calls of an engine: batched decode and prefill over sessions."""

    def __init__(self, max_rows: int) -> None:
        self.pool = {"max_rows": max_rows}
        self.methods = ("prefill", "decode")  # (no decode_one: every step runs decode)
        self.device = torch.device("cpu")
        self.calls = 0
        self.widest = 0
        self.failing: set[int] = set()  # session ids whose rows raise
        self._ids = iter(range(1, 1 << 30))

    def new_session(self) -> FakeSession:
        return FakeSession(next(self._ids), self)

    def captures(self, method: str) -> bool:
        return False

    def run_batch(self, method: str, sessions: Sequence[FakeSession], ids: torch.Tensor) -> torch.Tensor:
        assert method in ("decode", "prefill") and ids.shape[0] == len(sessions) <= self.pool["max_rows"]
        assert method == "prefill" or ids.shape[1] == 1
        bad = [s.id for s in sessions if s.id in self.failing]
        if bad:
            raise RuntimeError(f"session {bad[0]}'s row failed")
        self.calls += 1
        self.widest = max(self.widest, len(sessions))
        return torch.cat([s.feed(row) for s, row in zip(sessions, ids.tolist())])


class Tokenizer:
    """Text of token ids: one word a token (what TextStream decodes)."""

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return "".join(f" t{i}" for i in ids)


class FakeLLM:
    """What ChatSession, Generation and the Scheduler read of an LLM."""

    def __init__(self, *, max_rows: int, limits: Limits, engine: FakeEngine | None = None) -> None:
        self.engine = engine or FakeEngine(max_rows)
        self.spec = SimpleNamespace(prefill_rows=limits.prefill_rows, max_prefill=limits.max_prefill, recurrent=False,
                                    vocab_size=VOCAB)
        self.max_context = CONTEXT
        self.tokenizer = Tokenizer()
        self.generation_config: dict[str, Any] = {}
        self.eos_token_ids = frozenset({EOS})
        self.device = self.engine.device
        self.rewind_checkpoints = 0
        self._scheduler = Scheduler(self)  # type: ignore[arg-type]
        self._scheduler.limits = limits

    def prepare(self, prompt: list[int]) -> list[int]:
        return list(prompt)

    def new_session(self) -> ChatSession:
        return ChatSession(self, self.engine.new_session(), [])  # type: ignore[arg-type]
