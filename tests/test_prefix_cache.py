"""The prefix cache (llm/_prefix.py) and what it stands on: discardable
sessions, which the engine closes first when it needs room."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aoti_sessions.llm import LLM
from llm_models import TEXT, llm_package


@pytest.fixture(scope="module")
def small_package() -> Path:
    return llm_package("qwen3")  # (128 positions)


def test_a_discardable_session_is_closed_before_any_other_is_offloaded(small_package: Path) -> None:
    """Engine level: a discardable session is closed (not offloaded) to make
    room, before an idle session used longer ago is offloaded; at
    max_sessions a new session closes one instead of being refused; the
    idle reaper closes one; a fork of one is not discardable."""
    with LLM(small_package, threads=1) as probe:
        page_bytes = int(probe.engine.pool["page_bytes"])  # type: ignore[index]
    with LLM(small_package, threads=1, max_sessions=3, memory_budget=6 * page_bytes) as llm:
        engine, text = llm.engine, llm.encode(TEXT)
        older = llm.new_session()
        older.generate(text[:40], max_tokens=1, temperature=0)  # 3 pages, used first
        kept = llm.new_session()
        kept.generate(text[:40], max_tokens=1, temperature=0)  # 3 pages, used last
        core = kept._session
        core.discardable = True
        assert core.discardable
        newer = llm.new_session()
        newer.generate(text[50:90], max_tokens=1, temperature=0)  # 3 more pages: room for 6
        assert core.closed and older.resident  # the discardable one went, not the least recently used
        assert engine.stats()["discards"] == 1 and engine.stats()["evictions"] == 0
        third = engine.new_session()
        third.discardable = True
        fourth = engine.new_session()  # max_sessions=3 reached: the discardable one makes way
        assert third.closed and engine.stats()["discards"] == 2
        with pytest.raises(Exception, match="max_sessions"):
            engine.new_session()  # none discardable is left
        fourth.close()
    with LLM(small_package, threads=1, idle_timeout=0.05) as llm:
        s = llm.engine.new_session()
        s.discardable = True
        fork = s.fork()
        assert not fork.discardable
        deadline = time.monotonic() + 10
        while not s.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.closed and llm.engine.stats()["discards"] == 1 and not fork.closed
