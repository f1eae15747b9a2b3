"""The step loop (aoti_sessions.llm.runtime._scheduler) over a fake engine: no
exported model, a model in a few lines whose next token is a hash of every
token its session's cache holds, so a token fed twice, fed to the wrong
session, left in the cache after a stop or dropped anywhere changes every
later token. Random chats run together, many turns each, under budgets that
split prompts over steps and decode rows over calls; each reply must equal
the fake model's own greedy run of the same history, and each session's cache
its token list. (tests/test_scheduler.py runs the loop on exported models;
tests/test_plan.py the plan alone.)"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from aoti_sessions.errors import SessionClosedError
from aoti_sessions.llm.runtime._generation import TokenEvent
from aoti_sessions.llm.runtime._plan import Limits
from fake_engine import CONTEXT, EOS, VOCAB, FakeLLM, FakeSession, next_token

@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    model = FakeLLM(max_rows=4, limits=Limits(budget=12, max_prefill=8, prefill_rows=3, max_context=CONTEXT))
    yield model
    model._scheduler.close()


def solo(history: list[int], max_tokens: int, stop_ids: frozenset[int]) -> tuple[list[int], str]:
    """The fake model's greedy reply to ``history`` alone, and its finish
    reason (a full cache still gives one more token, never fed)."""
    cache, reply = list(history), []
    while True:
        token = next_token(cache)
        if token in stop_ids:
            return reply, "stop"
        reply.append(token)
        if len(reply) == max_tokens or len(cache) >= CONTEXT:
            return reply, "length"
        cache.append(token)


def chat(llm: FakeLLM, seed: int, turns: int, problems: list[str]) -> None:
    """One chat of random turns: each reply checked against solo()."""
    rng = random.Random(seed)
    session = llm.new_session()
    history: list[int] = []
    for turn in range(turns):
        if rng.random() < 0.25 and history:  # an edit: the next prompt keeps only a prefix
            history = history[:rng.randrange(len(history))]
        room = CONTEXT - len(history) - 2
        if room < 4:
            history = []
            room = CONTEXT - 2
        history = history + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, min(30, room - 2)))]
        max_tokens = rng.randint(1, 16)
        stop = frozenset({rng.randrange(1, VOCAB)}) if rng.random() < 0.3 else frozenset()
        g = session.start(history, max_tokens=max_tokens, temperature=0, stop_token_ids=tuple(stop))
        while g.step() is not None:
            pass
        want, reason = solo(history, max_tokens, stop | {EOS})
        if g.token_ids != want or g.finish_reason != reason:
            problems.append(f"chat {seed} turn {turn}: {g.token_ids} ({g.finish_reason}) != {want} ({reason})")
            return
        history = history + want
        fake: FakeSession = session._session  # type: ignore[assignment]
        if list(session.tokens) != fake.cache or session.tokens != tuple(history[:len(session.tokens)]):
            problems.append(f"chat {seed} turn {turn}: the cache {fake.cache} != the tokens {session.tokens}")
            return


def test_random_chats_together_equal_their_solo_runs(llm: FakeLLM) -> None:
    problems: list[str] = []
    threads = [threading.Thread(target=chat, args=(llm, seed, 6, problems)) for seed in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a chat did not end"
    assert not problems, problems[:3]
    stats = llm._scheduler.stats()
    # They ran together: decode steps of several rows, calls of max_rows, prefill split over steps.
    assert stats["decode_rows"] > 2 * stats["steps"] / 3 and llm.engine.widest == 4, stats
    assert stats["prefill_calls"] > 0 and stats["prefill_rows"] > stats["prefill_calls"], stats


def test_a_failing_row_ends_its_generation_alone(llm: FakeLLM) -> None:
    """A row whose call raises ends its generation with the error; the
    others in the same calls go on to their solo replies."""
    sessions = [llm.new_session() for _ in range(6)]
    prompts = [[5 + i, 9, 11 + i] for i in range(6)]
    for s, p in zip(sessions[:3], prompts):  # (their prompts in the cache: the next turn feeds one token)
        s.generate(p, max_tokens=1, temperature=0, ignore_eos=True)
    llm.engine.failing.add(sessions[1]._session.id)
    gens = [s.start(p + [3], max_tokens=12, temperature=0, ignore_eos=True) for s, p in zip(sessions, prompts)]
    for i, g in enumerate(gens):
        if i == 1:
            with pytest.raises(RuntimeError, match="row failed"):
                while g.step() is not None:
                    pass
            continue
        while g.step() is not None:
            pass
        assert g.token_ids == solo(prompts[i] + [3], 12, frozenset())[0], i
    assert not sessions[1].busy


def test_a_generation_closed_while_running_leaves_its_session_consistent(llm: FakeLLM) -> None:
    """Closed between steps (its token maybe fed ahead, unread): the cache
    holds exactly the session's tokens; its next turn and the others' are
    their solo runs."""
    rng = random.Random(3)
    sessions = [llm.new_session() for _ in range(5)]
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 20))] for _ in sessions]
    gens = [s.start(p, max_tokens=40, temperature=0, ignore_eos=True) for s, p in zip(sessions, prompts)]
    for _ in range(5):
        gens[0].step()
    gens[0].close()
    time.sleep(0.01)
    for g, p in zip(gens[1:], prompts[1:]):
        while g.step() is not None:
            pass
        assert g.token_ids == solo(p, 40, frozenset())[0]
    fake: FakeSession = sessions[0]._session  # type: ignore[assignment]
    assert fake.cache == list(sessions[0].tokens)
    history = list(sessions[0].tokens) + [7]
    g = sessions[0].start(history, max_tokens=6, temperature=0, ignore_eos=True)
    while g.step() is not None:
        pass
    assert g.token_ids == solo(history, 6, frozenset())[0]
    with pytest.raises(SessionClosedError):
        llm._scheduler.close()
        sessions[1].start([1, 2], max_tokens=2).step()


def test_what_a_step_hands_out_is_flushed_before_the_loop_waits(llm: FakeLLM) -> None:
    """Scheduler.before_wait (where an engine process sends its events): run
    on the loop's thread after each step is queued and before the loop waits
    for work, so nothing a step handed out is left unflushed once the loop
    is idle; each generation's tokens arrive whole and in order."""
    lock = threading.Lock()
    handed: list[tuple[int, TokenEvent]] = []  # put by the sinks
    flushed: list[tuple[int, TokenEvent]] = []
    calls = [0]

    def flush() -> None:
        assert llm._scheduler.on_loop()
        calls[0] += 1
        with lock:
            flushed.extend(handed)
            handed.clear()

    def sink(i: int) -> Callable[[TokenEvent], None]:
        def put(event: TokenEvent) -> None:
            with lock:
                handed.append((i, event))
        return put

    llm._scheduler.before_wait.append(flush)
    sessions = [llm.new_session() for _ in range(5)]
    prompts = [[3 + i, 17, 5 * i + 1] for i in range(5)]
    gens = [s.start(p, max_tokens=9 + i, temperature=0, ignore_eos=True)
            for i, (s, p) in enumerate(zip(sessions, prompts))]
    for i, g in enumerate(gens):
        g.on_tokens(sink(i))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with lock:
            if sum(event is None for _, event in flushed) == len(gens):
                break
        time.sleep(0.01)
    with lock:
        assert not handed, "a step's hand-out was not flushed before the loop went idle"
        for i, (g, p) in enumerate(zip(gens, prompts)):
            events = [event for j, event in flushed if j == i]
            assert events == [*solo(p, 9 + i, frozenset())[0], None] and g.token_ids == events[:-1]
    assert calls[0] >= llm._scheduler.stats()["steps"]
    assert not llm._scheduler.on_loop()
