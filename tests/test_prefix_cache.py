"""The prefix cache (llm/runtime/_prefix.py): a session without a session id starts
from a kept session sharing its prompt's start (pages shared copy-on-write)
and prefills only the rest. On real compiled tiny models (the 2048-token
Qwen3 of tool_models.py for the long system prompt, the 128-token Qwen3 and
Mamba2 of llm_models.py), through the server in its three modes and the
Python API: replies equal their solo runs from an empty session, sharing
stays within a namespace (a tenant and its prompt_cache_key), no page a
session shares is changed by another, and the cache never costs a request
room it would have had without it."""

from __future__ import annotations

import random
import time
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from aoti_sessions.llm import LLM, RemoteLLM, SamplingParams
from aoti_sessions.serve import create_app
from conftest import requires_cuda
from llm_models import TEXT, llm_package
from serving import metrics, running, running_front_ends, transport_for
from tool_models import tools_package

KEYS = ("prefix-key-a-51c2", "prefix-key-b-9e07")
TOKENS = 8  # per reply


@pytest.fixture(scope="module")
def package() -> Path:
    return tools_package()  # (2048 positions: room for a 1,000-token system prompt)


@pytest.fixture(scope="module")
def llm(package: Path) -> Iterator[LLM]:
    with LLM(package, threads=1, max_sessions=32) as model:
        yield model


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def llm_on(request: pytest.FixtureRequest, llm: LLM) -> Iterator[LLM]:
    """``llm``, and where there is a GPU the same model on it (its pool in device memory)."""
    if request.param == "cpu":
        yield llm
        return
    with LLM(tools_package("cuda"), "cuda", max_sessions=32) as model:
        yield model


def system_prompt(llm: LLM, name: str, tokens: int = 1000) -> str:
    """A system prompt of about ``tokens`` tokens, its own for ``name``."""
    words = TEXT.split()
    text, i = f"You are the assistant of {name}.", 0
    while (count := len(llm.encode(text))) < tokens:
        step = 16 if count < tokens - 64 else 1
        text += " " + " ".join(words[i % len(words):i % len(words) + step])
        i += step
    return text


def solo(llm: LLM, prompt: Any, params: SamplingParams) -> list[int]:
    """The reply to ``prompt`` from an empty session, without the cache."""
    with llm.new_session() as s:
        return s.generate(prompt, params).token_ids


GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


# -- the server, in each of its modes ------------------------------------------------

@pytest.fixture(scope="module", params=["one-process", "engine-process", "two-front-ends"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def server(mode: str, llm: LLM, package: Path) -> Iterator[str]:
    if mode == "one-process":
        with running(create_app(llm, api_keys=KEYS)) as url:
            yield url
        return
    with RemoteLLM(package, "cpu", threads=1, max_sessions=32) as remote:
        if mode == "two-front-ends":
            with running_front_ends(remote, 2, api_keys=KEYS) as url:
                yield url
        else:
            with running(create_app(remote, api_keys=KEYS)) as url:
                yield url


def _client(server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120,
                         http_client=httpx.Client(transport=transport_for(server), timeout=120))


def _chat(client: openai.OpenAI, llm: LLM, messages: list[dict[str, str]], **extra: Any) -> tuple[str, int]:
    reply = client.chat.completions.create(model=llm.name, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=TOKENS, temperature=0, extra_body=extra or None)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return str(reply.choices[0].message.content), int(reply.usage.prompt_tokens_details.cached_tokens or 0)


def test_a_repeated_system_prompt_is_prefilled_once(server: str, mode: str, llm: LLM) -> None:
    """The target: a stateless request repeating a 1,000-token system prompt
    with a new user message reuses at least 95% of its tokens; streamed too;
    concurrent requests sharing it each equal their solo run; another key,
    another prompt_cache_key and a named session share nothing."""
    system = system_prompt(llm, f"the {mode} server")
    system_tokens = len(llm.encode(system))
    assert 1000 <= system_tokens < 1020

    def messages(user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def want(user: str) -> str:
        with llm.new_session() as s:
            return s.generate(messages(user), max_tokens=TOKENS, temperature=0).text

    a, b = _client(server, KEYS[0]), _client(server, KEYS[1])
    with a, b:
        text, cached = _chat(a, llm, messages("Hello, how are you today?"))
        assert cached == 0 and text == want("Hello, how are you today?")
        text, cached = _chat(a, llm, messages("Please tell me a story."))
        assert cached >= 0.95 * system_tokens, (cached, system_tokens)
        assert text == want("Please tell me a story.")
        stream = a.chat.completions.create(model=llm.name, messages=messages("One, two, three?"),  # type: ignore
                                           max_tokens=TOKENS, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want("One, two, three?")
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens_details.cached_tokens or 0) >= 0.95 * system_tokens

        # Several at once, each from the kept prompt (or from one another's).
        users = [f"Question number {n}: what is {n} and {n + 1}?" for n in range(4)]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda u: _chat(a, llm, messages(u)), users))
        for user, (text, cached) in zip(users, got):
            assert text == want(user) and cached >= 0.95 * system_tokens

        # Another key, another prompt_cache_key: nothing shared (no cached_tokens oracle across them).
        text, cached = _chat(b, llm, messages("Please tell me a story."))
        assert cached == 0 and text == want("Please tell me a story.")
        assert _chat(a, llm, messages("Hello again."), prompt_cache_key="team-1")[1] == 0
        text, cached = _chat(a, llm, messages("Hello once more."), prompt_cache_key="team-1")
        assert cached >= 0.95 * system_tokens and text == want("Hello once more.")
        # A named session keeps its own cache, as before: its first turn prefills all.
        assert _chat(a, llm, messages("Please tell me a story."), session_id=f"named-{mode}")[1] == 0

        with httpx.Client(base_url=server, transport=transport_for(server),
                          headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
            counts = metrics(http)
            assert counts["aoti_sessions_prefix_cache_hits_total"] >= 7
            assert counts["aoti_sessions_prefix_cache_tokens_total"] >= 7 * 0.95 * system_tokens
            assert counts["aoti_sessions_prefix_cache_entries"] >= 1
            bad = http.post("/v1/chat/completions", json={"messages": messages("x"), "prompt_cache_key": 5})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"


def test_kept_sessions_never_cost_a_request_a_429(small_package: Path) -> None:
    """--max-sessions 2 with a named session idle: every stateless request
    is served (the kept ones make way), from the cache where it can be."""
    with LLM(small_package, threads=1, max_sessions=2) as small, running(create_app(small)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        base = [{"role": "system", "content": TEXT[:200]}]
        _chat(client, small, base + [{"role": "user", "content": "Hello"}], session_id="named")
        cached = [_chat(client, small, base + [{"role": "user", "content": f"Question {n}?"}])[1] for n in range(6)]
        assert all(c > 0 for c in cached[1:]), cached
        with httpx.Client(base_url=url) as http:
            assert metrics(http)["aoti_sessions_prefix_cache_hits_total"] >= 5


# -- the Python API ------------------------------------------------------------------

def test_concurrent_requests_from_shared_prefixes_equal_their_solo_runs(llm_on: LLM) -> None:
    """Many requests at once, greedy and seeded, whose prompts share whole
    bases, parts of them (a cut anywhere, mid-page too) or nothing, in two
    namespaces: each reply equals its solo run, and most start from the cache."""
    rng = random.Random(36)
    words = llm_on.encode(TEXT)
    bases = [rng.choices(words, k=rng.randint(40, 300)) for _ in range(3)]
    cases = []
    for n in range(36):
        base = rng.choice(bases)
        cut = len(base) if rng.random() < 0.5 else rng.randint(1, len(base))
        prompt = base[:cut] + rng.choices(words, k=rng.randint(1, 40)) if rng.random() < 0.9 \
            else rng.choices(words, k=rng.randint(2, 60))
        params = GREEDY if n % 2 else SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.9, seed=n,
                                                     ignore_eos=True)
        cases.append((prompt, params, f"concurrent-{n % 2}"))
    wants = [solo(llm_on, prompt, params) for prompt, params, _ in cases]

    def run(case: tuple[list[int], SamplingParams, str]) -> tuple[list[int], int]:
        prompt, params, namespace = case
        with llm_on.new_session(prompt, cache=namespace) as s:
            c = s.generate(prompt, params)
            return c.token_ids, c.cached_tokens

    before = llm_on.stats()
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(run, cases))
    assert [g for g, _ in got] == wants
    hits = llm_on.stats()["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits >= len(cases) // 3 and sum(c for _, c in got) > 0


def test_no_session_changes_the_pages_another_shares(llm_on: LLM) -> None:
    """Poisoned pages: sessions forked from one kept prefix write past the
    common part into its shared last page (cut mid-page), one resets and is
    fed other tokens, one is cut back further and fed others: the kept
    session's pages, and so every later request sharing them, give the solo
    replies, and the copies on write happened."""
    words = llm_on.encode(TEXT)
    rng = random.Random(7)
    base = rng.choices(words, k=100)  # 6 pages and 4 positions
    namespace = "poison"
    with llm_on.new_session(base, cache=namespace) as first:
        assert first.generate(base, GREEDY).token_ids == solo(llm_on, base, GREEDY)
    copied = llm_on.stats()["pages_copied"]
    barrier = threading.Barrier(3)

    def poison(kind: int) -> None:
        prompt = base[:90] + rng.choices(words, k=20) if kind == 0 else base[:37] + words[:5]
        with llm_on.new_session(prompt, cache=namespace) as s:
            barrier.wait(30)
            s.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
            if kind == 1:
                s.reset()
                s.generate(words[:70], max_tokens=4, temperature=0)
            elif kind == 2:  # its own history, cut back and fed other tokens
                s.generate(prompt[:20] + words[30:60], max_tokens=4, temperature=0)

    threads = [threading.Thread(target=poison, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert llm_on.stats()["pages_copied"] > copied  # (they did share the pages they wrote)
    for extra in (words[:3], words[10:40], []):
        prompt = base + extra if extra else base[:64] + words[50:52]
        with llm_on.new_session(prompt, cache=namespace) as s:
            c = s.generate(prompt, GREEDY)
            assert c.cached_tokens >= 64
            assert c.token_ids == solo(llm_on, prompt, GREEDY)


def test_a_kept_session_is_nobodys_after_close(llm: LLM) -> None:
    """A closed session with a namespace is the cache's: its old handle is
    closed (it starts, forks, saves and resets nothing), and a prompt
    without a namespace is refused."""
    prompt = llm.encode(TEXT)[:40]
    s = llm.new_session(prompt, cache="closed")
    s.generate(prompt, max_tokens=2, temperature=0)
    s.close()
    assert s.closed and not s.resident
    from aoti_sessions.errors import SessionClosedError

    for call in (lambda: s.start(prompt), s.fork, s.reset, lambda: s.save("/nonexistent/x")):
        with pytest.raises(SessionClosedError):
            call()
    with pytest.raises(TypeError, match="cache="):
        llm.new_session(prompt)


@pytest.fixture(scope="module")
def small_package() -> Path:
    return llm_package("qwen3")  # (128 positions)


def _fits(llm: LLM, cases: list[tuple[list[int], SamplingParams]], namespace: str) -> list[tuple[list[int], int]]:
    """Each case's reply from the cache (one at a time), and its cached tokens."""
    out = []
    for prompt, params in cases:
        with llm.new_session(prompt, cache=namespace) as s:
            c = s.generate(prompt, params)
        out.append((c.token_ids, c.cached_tokens))
    return out


def test_the_cache_never_costs_a_request_room(small_package: Path) -> None:
    """At max_sessions, and under a memory budget that never offloads
    (host_budget 0), every request that fits without the cache fits with
    it: the engine closes kept sessions first (discards), never offloading
    a live session for them, and they are still reused (forked, or handed
    over whole where a fork has no room)."""
    with LLM(small_package, threads=1, max_sessions=2) as llm:
        text = llm.encode(TEXT)
        held = llm.new_session()  # a live conversation, idle: one slot left
        held.generate(text[50:90], max_tokens=2, temperature=0)
        cases = [(text[:48] + text[60 + n:64 + n] if n % 3 else text[n:n + 30], GREEDY) for n in range(9)]
        wants = [solo(llm, prompt, params) for prompt, params in cases]
        got = _fits(llm, cases, "slots")
        assert [g for g, _ in got] == wants
        assert all(cached >= 48 for (_, cached), n in zip(got, range(9)) if n % 3 == 2)
        assert held.resident and held.token_count > 0
        held.close()
        errors: list[BaseException] = []

        def one(prompt: list[int]) -> None:
            try:
                with llm.new_session(prompt, cache="slots") as s:
                    s.generate(prompt, GREEDY)
            except BaseException as e:  # noqa: BLE001 - collected, asserted below
                errors.append(e)

        for n in range(8):  # two at once, the most that fit
            threads = [threading.Thread(target=one, args=(text[:48] + text[n + k:n + k + 5],)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert not errors, errors
        stats = llm.stats()
        assert stats["discards"] >= 1 and stats["prefix_cache_hits"] >= 8 and stats["evictions"] == 0

    with LLM(small_package, threads=1) as probe:
        page_bytes = int(probe.engine.pool["page_bytes"])  # type: ignore[index]
    # Room for a live session of 58 tokens (4 pages) and a request of 56 with its reply (4 more).
    with LLM(small_package, threads=1, memory_budget=8 * page_bytes, host_budget=0,
             prefix_cache_bytes=8 * page_bytes) as llm:
        text = llm.encode(TEXT)
        held = llm.new_session()
        held.generate(text[:50], max_tokens=8, temperature=0, ignore_eos=True)
        # Requests sharing a start (A) and others (B): a B makes the engine close the kept A.
        cases = [(text[60:100] + text[n:n + 8] if kind == "A" else text[n:n + 48], GREEDY)
                 for n, kind in enumerate("AAABAABA")]
        wants = [solo(llm, prompt, params) for prompt, params in cases]
        got = _fits(llm, cases, "bytes")
        assert [g for g, _ in got] == wants
        stats = llm.stats()
        assert held.resident and stats["evictions"] == 0 and stats["discards"] >= 1
        assert stats["prefix_cache_hits"] >= 3
        held.close()


def test_recurrent_state_is_shared_only_where_exact() -> None:
    """Mamba2 (slots: no rewind to an arbitrary position): a prompt that
    extends a kept session's whole history (a conversation's next turn sent
    without a session id) starts from it; one that shares only part of it
    starts empty. Both equal their solo runs."""
    with LLM(llm_package("mamba2"), threads=1) as llm:
        text = llm.encode(TEXT)
        first = text[:40]
        with llm.new_session(first, cache="ssm") as s:
            reply = s.generate(first, GREEDY).token_ids
            kept = len(s.tokens)  # (the prompt and the reply's tokens fed: all but the last)
        history = first + reply
        for prompt, cached in ((history + text[50:60], kept), (first[:30] + text[70:80], 0),
                               (history[:kept - 1] + text[80:85], 0)):
            with llm.new_session(prompt, cache="ssm") as s:
                c = s.generate(prompt, GREEDY)
            assert c.cached_tokens == cached
            assert c.token_ids == solo(llm, prompt, GREEDY)
        assert llm.stats()["prefix_cache_hits"] == 1


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
