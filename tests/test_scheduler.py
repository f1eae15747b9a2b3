"""Continuous batching (aoti_sessions.llm.runtime._scheduler) on an exported tiny
Qwen3: chats running at once share decode steps, join and leave between
steps, get cancelled, forked, saved, loaded and offloaded, and every chat's
greedy tokens equal the same conversation run alone."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aoti_sessions.llm import LLM
from conftest import on_threads, requires_cuda
from llm_models import llm_package

CONTEXT = 128
PROMPTS = ["The quick brown fox", "Once upon a time", "Hello there, friend", "A B C D E F G",
           "the river and the mill", "Tell me a story about the sea"]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def llm(request: pytest.FixtureRequest):
    with LLM(llm_package("qwen3", device=request.param, max_cache_len=CONTEXT), device=request.param) as m:
        yield m


def solo(llm: LLM, history: list[int], n: int) -> list[int]:
    """The greedy reply to ``history`` on a fresh session, alone."""
    with llm.new_session() as s:
        return s.generate(history, max_tokens=n, temperature=0, ignore_eos=True).token_ids


def test_chats_at_once_share_decode_steps(llm: LLM) -> None:
    want = [solo(llm, llm.encode(p), 16) for p in PROMPTS]
    before = llm.engine.stats()
    together = threading.Barrier(len(PROMPTS))  # (threads started one by one on a loaded machine may not overlap)

    def chat(i: int) -> list[int]:
        history = llm.encode(PROMPTS[i])
        together.wait()
        return solo(llm, history, 16)

    got = on_threads(len(PROMPTS), "cpu", chat)
    after = llm.engine.stats()
    assert got == want
    runs = after["batch_runs"] - before["batch_runs"]
    rows = after["batch_rows"] - before["batch_rows"]
    assert rows > 1.5 * runs, (rows, runs)  # rows of several chats in one step


def test_prompts_arriving_together_share_prefill_calls(llm: LLM) -> None:
    """Prompts of different lengths submitted at once are fed in shared
    prefill calls (shorter rows padded, then truncated): every chat's tokens
    and cache equal its run alone."""
    prompts = [llm.encode(p + " and more" * i) for i, p in enumerate(PROMPTS)]
    assert len(set(map(len, prompts))) > 1
    want = [solo(llm, p, 12) for p in prompts]
    scheduler = llm._scheduler
    calls, rows = scheduler.prefill_calls, scheduler.prefill_rows_fed
    before = llm.stats()
    sessions = [llm.new_session() for _ in prompts]
    generations = [s.start(p, max_tokens=12, temperature=0, ignore_eos=True) for s, p in zip(sessions, prompts)]
    for g in generations:
        while g.step() is not None:
            pass
    got = [g.token_ids for g in generations]
    calls, rows = scheduler.prefill_calls - calls, scheduler.prefill_rows_fed - rows
    assert got == want
    assert rows == len(prompts) and calls < rows, (calls, rows)  # some call fed several chats
    # LLM.stats() counts the same, with the decode rows: every token but
    # each prompt's first came from a decode row (prompts of 2+ tokens).
    after = llm.stats()
    assert after["prefill_calls"] - before["prefill_calls"] == calls
    assert after["prefill_rows"] - before["prefill_rows"] == rows
    assert after["prefill_tokens"] - before["prefill_tokens"] == sum(map(len, prompts))
    assert after["decode_rows"] - before["decode_rows"] == sum(len(w) - 1 for w in want)
    assert after["step_queue_seconds"] > before["step_queue_seconds"]
    engine = after["step_engine_seconds"] - before["step_engine_seconds"]
    assert 0 < engine <= after["step_queue_seconds"] - before["step_queue_seconds"]  # (a part of queueing)
    cpu = after["step_queue_cpu_seconds"] - before["step_queue_cpu_seconds"]
    assert 0 < cpu <= after["step_queue_seconds"] - before["step_queue_seconds"] + 0.01  # (clocks' grain)
    # The core's time in the batches is within the engine's calls that made them.
    assert 0 < after["batch_seconds"] - before["batch_seconds"] <= engine
    for s, p, w in zip(sessions, prompts, want):
        assert s.token_count == s._session.length == len(p) + len(w) - 1  # no padding position kept
        s.close()


def prompt_of(llm: LLM, n: int, seed: int = 0) -> list[int]:
    """``n`` prompt tokens: the test prompts' text, shuffled by ``seed``."""
    tokens = llm.encode(" ".join(PROMPTS))
    return random.Random(seed).choices(tokens, k=n)


def test_a_one_token_chunk_within_a_prompt_picks_no_token(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's prefill budget with one token left gives the next prompt a
    one-token chunk that is not its end (run as a decode row): its logits
    pick nothing, and the rest of the prompt is fed before the reply."""
    scheduler = llm._scheduler
    budget = 24
    first, second = prompt_of(llm, budget - 1, 1), prompt_of(llm, 20, 2)
    want = [solo(llm, first, 8), solo(llm, second, 8)]
    monkeypatch.setattr(scheduler, "limits", replace(scheduler.limits, budget=budget))
    sessions = [llm.new_session(), llm.new_session()]
    with scheduler._cond:  # both join the same first step
        generations = [s.start(p, max_tokens=8, temperature=0, ignore_eos=True)
                       for s, p in zip(sessions, (first, second))]
    for g in generations:
        while g.step() is not None:
            pass
    assert [g.token_ids for g in generations] == want
    for s, p, w in zip(sessions, (first, second), want):
        assert s.tokens == tuple(p + w[:-1]) and s._session.length == len(p) + len(w) - 1
        s.close()


def test_a_cancelled_generation_leaves_the_others_and_its_session_consistent(llm: LLM) -> None:
    want = solo(llm, llm.encode(PROMPTS[1]), 20)
    a, b = llm.new_session(), llm.new_session()
    ga = a.start(PROMPTS[0], max_tokens=100, temperature=0, ignore_eos=True)
    gb = b.start(PROMPTS[1], max_tokens=20, temperature=0, ignore_eos=True)
    for _ in range(3):
        ga.step()
    ga.close()
    assert not a.busy and ga.finished
    assert a.token_count == a._session.length  # what the cache holds is what the session lists
    while gb.step() is not None:
        pass
    assert gb.token_ids == want
    # The cancelled session serves the next request, reusing what it fed.
    held = list(a.tokens)
    history = held + llm.encode(" and then")
    again = a.generate(history, max_tokens=6, temperature=0, ignore_eos=True)
    assert again.cached_tokens == len(held)
    assert again.token_ids == solo(llm, history, 6)
    a.close()
    b.close()


def test_a_stop_token_fed_ahead_leaves_the_cache(llm: LLM) -> None:
    """The loop feeds a step's sampled tokens before reading them: a reply
    that a stop token ends had that token fed already; the cache forgets it
    (length and token list agree), the chats stepped with it go on, and the
    next turn reuses the cache as a solo run would."""
    prompts = [llm.encode(p) for p in PROMPTS]
    full = [solo(llm, p, 12) for p in prompts]
    stops = [w[3 + i % 5] for i, w in enumerate(full)]  # each chat stops at its own token
    sessions = [llm.new_session() for _ in prompts]
    generations = [s.start(p, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop])
                   for s, p, stop in zip(sessions, prompts, stops)]
    for g in generations:
        while g.step() is not None:
            pass
    for s, p, g, w, stop in zip(sessions, prompts, generations, full, stops):
        assert g.finish_reason == "stop" and g.token_ids == w[:w.index(stop)]
        assert s.tokens == tuple(p + g.token_ids) and s._session.length == len(s.tokens)
        history = p + g.token_ids + llm.encode(" again")
        out = s.generate(history, max_tokens=5, temperature=0, ignore_eos=True)
        assert out.cached_tokens == len(p) + len(g.token_ids)
        assert out.token_ids == solo(llm, history, 5)
        s.close()


def test_a_fork_while_generating_sees_cache_and_tokens_agree(llm: LLM) -> None:
    """A fork between a step's queueing and its tokens' reading waits for
    them: each fork's token list is what its cache holds, and it goes on
    as a solo run of that history does."""
    s = llm.new_session()
    g = s.start(PROMPTS[5], max_tokens=40, temperature=0, ignore_eos=True)
    forks = []
    while not g.finished:
        forks.append(s.fork())
    while g.step() is not None:
        pass
    assert len(forks) > 1
    for f in forks[:: max(1, len(forks) // 4)]:
        held = list(f.tokens)
        assert f._session.length == len(held)
        history = held + llm.encode(" so")
        assert f.generate(history, max_tokens=4, temperature=0, ignore_eos=True).token_ids == solo(llm, history, 4)
    for f in forks:
        f.close()
    s.close()


def test_a_failing_row_ends_only_its_generation(llm: LLM) -> None:
    """A session closed under a running generation fails that generation;
    the chats batched with it go on."""
    want = solo(llm, llm.encode(PROMPTS[2]), 24)
    a, b = llm.new_session(), llm.new_session()
    ga = a.start(PROMPTS[3], max_tokens=100, temperature=0, ignore_eos=True)
    gb = b.start(PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True)
    ga.step()
    a._session.close()  # under the chat session's feet
    with pytest.raises(Exception, match="closed"):
        while ga.step() is not None:
            pass
    while gb.step() is not None:
        pass
    assert gb.token_ids == want
    b.close()


def test_closing_the_llm_ends_running_generations(tmp_path: Path) -> None:
    with LLM(llm_package("qwen3", device="cpu", max_cache_len=CONTEXT)) as llm:
        s = llm.new_session()
        g = s.start(PROMPTS[0], max_tokens=100, temperature=0, ignore_eos=True)
        g.step()
        llm.close()
        with pytest.raises(Exception, match="closed"):
            while g.step() is not None:
                pass
        with pytest.raises(Exception, match="closed"):
            s.generate("more", max_tokens=2)


def test_randomized_chats_equal_solo_runs(llm: LLM, tmp_path: Path) -> None:
    """Chats start, go on, fork, save, load, offload and get cancelled at
    random moments while others generate; every completed reply equals the
    same history generated alone."""
    lock = threading.Lock()
    problems: list[str] = []
    saved = [0]

    def chat(worker: int) -> None:
        local = random.Random(worker)
        s = llm.new_session()
        history = llm.encode(PROMPTS[worker % len(PROMPTS)])
        for turn in range(6):
            n = local.randint(2, 10)
            action = local.random()
            if action < 0.15:  # cancelled part-way: the next turn rewinds to what is held
                g = s.start(history, max_tokens=n + 20, temperature=0, ignore_eos=True)
                for _ in range(local.randint(1, 3)):
                    g.step()
                g.close()
                history = list(s.tokens)
                if len(history) < 1:
                    history = llm.encode(PROMPTS[0])
                continue
            out = s.generate(history, max_tokens=n, temperature=0, ignore_eos=True)
            want = solo(llm, history, n)
            if out.token_ids != want:
                with lock:
                    problems.append(f"worker {worker} turn {turn}: {out.token_ids} != {want}")
            history = history + out.token_ids + llm.encode(" ok")
            if len(history) > CONTEXT - 24:
                history = history[:8]
            if action < 0.3:
                child = s.fork()
                s.close()
                s = child
            elif action < 0.45:
                with lock:
                    path = tmp_path / f"w{worker}-{saved[0]}.ais"
                    saved[0] += 1
                s.save(path)
                s.close()
                s = llm.load_session(path)
            elif action < 0.55:
                s._session.offload()
        s.close()

    on_threads(8, "cpu", chat)
    assert not problems, problems[:3]


@requires_cuda
def test_prefill_graphs_serve_every_session_and_length_of_a_bucket() -> None:
    """On CUDA prefill chunks are padded to a power of two and each (rows,
    length, page-table width) bucket is captured once: later prompts of other
    lengths in the bucket, on new sessions, replay it, and every reply equals
    an eager LLM's."""
    package = llm_package("qwen3", device="cuda", max_cache_len=CONTEXT)
    with LLM(package, device="cuda", cuda_graphs=False) as eager:
        assert not eager.engine.captures("prefill")
        prompts = [eager.encode(p) for p in PROMPTS]
        assert len(set(map(len, prompts))) > 1 and max(map(len, prompts)) <= 16  # one bucket: 16
        want = [solo(eager, p, 6) for p in prompts]
    with LLM(package, device="cuda") as m:
        assert m.engine.captures("prefill") and m.engine.captures("decode")
        for _ in range(2):  # warm-up runs are eager; a shape is captured at its second run
            warm = [solo(m, p, 6) for p in prompts]
        before = m.engine.stats()
        got = [solo(m, p, 6) for p in prompts]
        after = m.engine.stats()
        assert got == want and warm == want
        assert after["graph_captures"] == before["graph_captures"]
        runs = after["runs"] - before["runs"]
        assert runs == len(prompts) * 6 and after["graph_replays"] - before["graph_replays"] == runs

