"""Bursts of concurrent completions with mixed prompt lengths through the
server (in one process and with an engine process): every greedy reply
equals the same prompt answered alone. Prompt lengths are drawn so that a
step's prefill budget is often left with a token or two, the case where a
prompt's one-token chunk once gave a reply from the prompt's first tokens.

ROUNDS bursts of BURST requests in the suite (``AOTI_SESSIONS_BURST_ROUNDS``
sets how many)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aoti_sessions.llm import LLM, RemoteLLM
from aoti_sessions.serve import create_app
from conftest import on_threads
from serving import SERVER_CONTEXT, client, package, running, serving  # noqa: F401 (package: a fixture)

CONTEXT = SERVER_CONTEXT
BURST = 24
ROUNDS = int(os.environ.get("AOTI_SESSIONS_BURST_ROUNDS", "10"))
TOKENS = 8


@pytest.fixture(scope="module", params=["one-process", "engine-process"])
def served(request: pytest.FixtureRequest, package: Path, device: str) -> Iterator[LLM | RemoteLLM]:
    if request.param == "one-process":
        with LLM(package, device, max_sessions=2 * BURST, **({"threads": 1} if device == "cpu" else {})) as llm:
            yield llm
    else:
        with RemoteLLM(package, device, threads=1, max_sessions=2 * BURST) as remote:
            yield remote


def test_bursts_of_mixed_prompts_get_their_solo_replies(served: LLM | RemoteLLM) -> None:
    """(With AOTI_SESSIONS_TEST_FRONT_ENDS=N, the engine process is served
    by N front ends, each client's requests going to them in turn.)"""
    rng = random.Random(34)
    vocab = [t for t in range(served.spec.vocab_size) if t not in served.spec.eos_token_ids]
    longest = min(served.spec.max_prefill, CONTEXT - TOKENS)
    budget = served.spec.max_prefill  # a step's prefill budget on the CPU (on CUDA, several calls' worth)
    wrong: list[str] = []
    server = serving(served) if isinstance(served, RemoteLLM) else running(create_app(served))
    with server as url, client(url, timeout=300) as alone:
        def complete(http: httpx.Client, prompt: list[int]) -> str:
            response = http.post("/v1/completions", json={"model": served.name, "prompt": prompt,
                                                            "max_tokens": TOKENS, "temperature": 0,
                                                            "ignore_eos": True})
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        for round_ in range(ROUNDS):
            # Lengths from one token to a whole prefill call, many of them a
            # half or a third of the step's budget: prompts that arrive
            # together often leave the budget a token or two for the next.
            half, third = budget // 2, budget // 3
            lengths = [min(longest, rng.choice([1, 2, rng.randint(3, 40), rng.randint(41, longest), half - 1, half,
                                                third, third + 1]))
                       for _ in range(BURST)]
            prompts = [rng.choices(vocab, k=n) for n in lengths]
            want = [complete(alone, p) for p in prompts]

            def request(i: int) -> str:
                with client(url, timeout=300) as http:
                    return complete(http, prompts[i])

            got = on_threads(BURST, "cpu", request)
            wrong += [f"round {round_}, a prompt of {len(p)} tokens: {g!r} != solo {w!r}"
                      for p, g, w in zip(prompts, got, want) if g != w]
    assert not wrong, f"{len(wrong)} wrong replies of {ROUNDS * BURST}: " + "; ".join(wrong[:3])
