"""The step loop (llm/runtime/_scheduler.py) fuzzed: random prefill budgets, prompt
lengths (one token, a few, several chunks; after a cached first turn or
not), arrival orders (alone, in bursts that join one step, staggered), stop
tokens, max_tokens and cancels, on a dense (qwen3), a recurrent (lfm2), a
ring (gpt_oss) and a state-space (mamba2) package. Every reply equals the
same prompt generated alone; a cancelled one is a prefix of it, and its
session's token list and cache agree.

A short run in the default suite (ROUNDS rounds a package);
``AOTI_SESSIONS_SCHEDULER_FUZZ_SECONDS=3600 pytest tests/test_scheduler_fuzz.py``
runs rounds until that many seconds have passed for each package."""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field, replace

import pytest

from aoti_sessions.llm import LLM, ChatSession
from conftest import requires_cuda
from llm_models import llm_package

CONTEXT = 128
ROUNDS = int(os.environ.get("AOTI_SESSIONS_SCHEDULER_FUZZ_ROUNDS", "3"))
SECONDS = float(os.environ.get("AOTI_SESSIONS_SCHEDULER_FUZZ_SECONDS", "0"))
TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot named Bolt "
        "who lived by the harbour, and every evening Bolt painted the boats and the waves.")


@pytest.fixture(scope="module", params=["qwen3", "lfm2", "gpt_oss", "mamba2",
                                        pytest.param("qwen3-cuda", marks=requires_cuda),
                                        pytest.param("lfm2-cuda", marks=requires_cuda)])
def llm(request: pytest.FixtureRequest):
    arch, _, device = str(request.param).partition("-")
    device = device or "cpu"
    with LLM(llm_package(arch, device=device, max_cache_len=CONTEXT), device=device,
             **({"threads": 1} if device == "cpu" else {})) as m:
        yield m


@dataclass
class Case:
    """One generation of a round, and what it must give."""

    first: list[int]            # a first turn generated alone beforehand ([]: a fresh session)
    prompt: list[int]           # the turn under test: first turn's history + more, or a fresh prompt
    max_tokens: int
    stop: int | None            # a stop token id (one of the solo reply's tokens), or None
    cancel_after: int | None    # pieces read before closing it, or None
    delay: float                # seconds before it starts (0 for a burst's members)
    want: list[int] = field(default_factory=list)  # the solo reply
    session: ChatSession | None = None
    got: list[int] = field(default_factory=list)
    finish: str | None = None
    error: BaseException | None = None


def solo(llm: LLM, prompt: list[int], n: int, stop: int | None = None) -> list[int]:
    with llm.new_session() as s:
        return s.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True,
                          stop_token_ids=[] if stop is None else [stop]).token_ids


def _prompt(rng: random.Random, pool: list[int], most: int) -> list[int]:
    kind = rng.random()
    n = rng.randint(1, 3) if kind < 0.25 else rng.randint(4, 24) if kind < 0.7 else rng.randint(25, most)
    return rng.choices(pool, k=min(n, most))


def _cases(llm: LLM, rng: random.Random) -> list[Case]:
    pool = llm.encode(TEXT)
    cases = []
    for _ in range(rng.randint(3, 10)):
        max_tokens = rng.randint(1, 10)
        first: list[int] = []
        if rng.random() < 0.3:  # a second turn: the cache holds the first, which the prompt extends
            first = _prompt(rng, pool, 40)
            first = first + solo(llm, first, 4)
        prompt = first + _prompt(rng, pool, CONTEXT - max_tokens - len(first))
        want = solo(llm, prompt, max_tokens)
        stop = None
        if rng.random() < 0.3:
            stop = rng.choice(want)
            want = want[:want.index(stop)]
        cancel_after = rng.randint(0, 3) if rng.random() < 0.2 else None
        delay = 0.0 if rng.random() < 0.5 else rng.choice([0.0005, 0.002, 0.01, 0.03])
        cases.append(Case(first, prompt, max_tokens, stop, cancel_after, delay, want))
    return cases


def _run(llm: LLM, cases: list[Case]) -> None:
    """Starts every case on a thread of its own: the burst (delay 0) while
    the step loop is held, so they join one step, the rest after their delay."""
    for c in cases:
        c.session = llm.new_session()
        if c.first:  # the first turn, alone (its tokens fill the cache)
            c.session.generate(c.first[:-4], max_tokens=4, temperature=0, ignore_eos=True)

    def work(c: Case) -> None:
        assert c.session is not None
        try:
            time.sleep(c.delay)
            g = c.session.start(c.prompt, max_tokens=c.max_tokens, temperature=0, ignore_eos=True,
                                stop_token_ids=[] if c.stop is None else [c.stop])
            read = 0
            while True:
                if c.cancel_after is not None and read >= c.cancel_after:
                    g.close()
                    break
                if g.step() is None:
                    break
                read += 1
            c.got, c.finish = list(g.token_ids), g.finish_reason
        except BaseException as e:  # noqa: BLE001 - reported below
            c.error = e

    threads = [threading.Thread(target=work, args=(c,)) for c in cases]
    with llm._scheduler._cond:  # the burst waits at the loop's door, then joins one step
        for t in threads:
            t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a generation hung"


def _check(llm: LLM, cases: list[Case], budget: int) -> list[str]:
    problems = []
    for i, c in enumerate(cases):
        assert c.session is not None
        where = (f"budget {budget}, case {i}: prompt {len(c.prompt)} tokens ({len(c.first)} cached before), "
                 f"max_tokens {c.max_tokens}, stop {c.stop}, cancel after {c.cancel_after}")
        if c.error is not None:
            problems.append(f"{where}: {c.error!r}")
        elif c.cancel_after is None and c.got != c.want:
            problems.append(f"{where}: {c.got} != solo {c.want}")
        elif c.cancel_after is not None and c.got != c.want[:len(c.got)]:
            problems.append(f"{where}: cancelled {c.got} is no prefix of solo {c.want}")
        held = list(c.session.tokens)
        if c.session._session.length != len(held):
            problems.append(f"{where}: the session lists {len(held)} tokens, its cache holds "
                            f"{c.session._session.length}")
        elif held != (c.prompt + c.got)[:len(held)] or (c.cancel_after is None and len(held) < len(c.prompt)):
            problems.append(f"{where}: the session's tokens are not its prompt and reply")
        c.session.close()
    return problems


def test_random_schedules_give_every_reply_its_solo_tokens(llm: LLM) -> None:
    scheduler = llm._scheduler
    default = scheduler.limits
    rng = random.Random(f"{llm.spec.model_type}-{llm.device}")
    rounds = 0
    problems: list[str] = []
    started = time.monotonic()
    while rounds < ROUNDS or time.monotonic() - started < SECONDS:
        cases = _cases(llm, rng)  # (solo runs under the default budget)
        budget = rng.choice([1, 2, 3, rng.randint(4, 40), default.budget])
        scheduler.limits = replace(default, budget=budget)
        try:
            _run(llm, cases)
        finally:
            scheduler.limits = default
        problems += _check(llm, cases, budget)
        rounds += 1
        assert not problems, f"{len(problems)} problems in {rounds} rounds: " + "; ".join(problems[:3])
    print(f"{llm.spec.model_type} on {llm.device}: {rounds} rounds, 0 problems in {time.monotonic() - started:.0f} s")
