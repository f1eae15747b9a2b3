"""The batched sampler (aoti_sessions.llm.runtime._sampling): greedy rows are argmax,
drawn rows follow softmax(logits / T) within top-k and top-p, and a seeded
row draws the same tokens alone or in any batch, at any row."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from aoti_sessions.llm.runtime._sampling import Sampler, SamplingParams, sample

CPU = torch.device("cpu")


def sampler(device: torch.device | str = CPU, config: dict[str, Any] | None = None, **params: Any) -> Sampler:
    return Sampler(SamplingParams(**params), config or {}, torch.device(device))


def test_settings_come_from_the_params_then_the_generation_config() -> None:
    config = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    s = sampler(config=config)
    assert (s.greedy, s.temperature, s.top_k, s.top_p) == (False, 0.6, 20, 0.95)
    s = sampler(config=config, temperature=1.5, top_k=0, top_p=1.0)
    assert (s.greedy, s.temperature, s.top_k, s.top_p) == (False, 1.5, 0, 1.0)
    assert sampler(config={"do_sample": False, "temperature": 0.6}).greedy
    assert sampler(config=config, temperature=0).greedy
    assert sampler(temperature=1e-6).greedy and not sampler(temperature=1e-4).greedy
    assert sampler(seed=-1, temperature=1).seed == sampler(seed=2**64 - 1, temperature=1).seed == 2**64 - 1
    assert sampler(temperature=1).seed != sampler(temperature=1).seed  # unseeded: a seed of its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_argmax_in_any_batch(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000, device=device).to(dtype)
    logits[1, 10] = logits[1, 500] = logits[1].max() + 1  # a tie: the lowest index wins
    argmax = logits.argmax(dim=-1)
    assert argmax[1] == 10
    everyone = [sampler(device, temperature=0) for _ in range(6)]
    assert torch.equal(sample(logits, everyone), argmax)
    for drawn in ({}, {"top_k": 5}, {"top_p": 0.9}):  # each path of the drawn rows
        rows = [sampler(device, temperature=0) if r % 2 else sampler(device, temperature=1, seed=r, **drawn)
                for r in range(6)]
        tokens = sample(logits, rows)
        assert torch.equal(tokens[1::2], argmax[1::2])
    assert torch.equal(sampler(device, temperature=0)(logits[1:2]), argmax[1:2])


def test_the_output_is_int64_on_the_logits_device(device: str) -> None:
    logits = torch.randn(3, 50, device=device)
    for params in ({"temperature": 0}, {"temperature": 1}, {"temperature": 1, "top_k": 3},
                   {"temperature": 1, "top_p": 0.5}):
        tokens = sample(logits, [sampler(device, **params) for _ in range(3)])
        assert tokens.dtype == torch.int64 and tokens.shape == (3,) and tokens.device == logits.device
        one = sampler(device, **params)(logits[:1])
        assert one.dtype == torch.int64 and one.shape == (1,) and one.device == logits.device
    with pytest.raises(ValueError, match="3 rows"):
        sample(logits, [sampler(device)])


def test_each_call_advances_the_step_and_rewinding_repeats_the_draw() -> None:
    logits = torch.zeros(1, 1000)  # uniform: consecutive draws differ
    s = sampler(temperature=1, seed=5)
    draws = [int(s(logits)) for _ in range(4)]
    assert s.step == 4 and len(set(draws)) > 1
    s.step = 2
    assert int(s(logits)) == draws[2]
    greedy = sampler(temperature=0)
    sample(torch.zeros(2, 10), [greedy, sampler(temperature=0)])
    assert greedy.step == 1


# A seeded row's settings (one per path: the race, with top-k, sorted for
# top-p, both), and companions of every kind: greedy, other seeds, unseeded,
# other top-k and top-p (so the batch's largest k is not the row's own), in an
# order that makes the batch gather its rows path by path.
SEEDED = [{"temperature": 0.8}, {"temperature": 1.3, "top_k": 7}, {"temperature": 1.0, "top_p": 0.8},
          {"temperature": 0.7, "top_k": 40, "top_p": 0.9}]
BEFORE = [{"temperature": 0}, {"temperature": 1.0, "seed": 99}, {"temperature": 2.0, "top_k": 100},
          {"temperature": 0.5, "top_p": 0.5}]
AFTER = [{"temperature": 1.1}, {"temperature": 0}, {"temperature": 2.0, "top_k": 100}, {"temperature": 1.0, "seed": 7}]


def draws_alone_and_batched(device: str, params: dict[str, Any], steps: int = 50) -> None:
    vocab = 3000
    gen = torch.Generator().manual_seed(1)
    alone = sampler(device, seed=1234, **params)
    at_0 = sampler(device, seed=1234, **params)
    at_4 = sampler(device, seed=1234, **params)
    first = [sampler(device, **c) for c in BEFORE]
    last = [sampler(device, **c) for c in AFTER]
    for step in range(steps):
        row = (torch.randn(1, vocab, generator=gen) * 3).to(device)
        others = (torch.randn(4, vocab, generator=gen) * 3).to(device)
        if step % 2:
            row, others = row.bfloat16(), others.bfloat16()
        token = alone(row)
        assert torch.equal(sample(torch.cat([row, others]), [at_0, *first])[:1], token), step
        assert torch.equal(sample(torch.cat([others, row]), [*last, at_4])[4:], token), step


@pytest.mark.parametrize("params", SEEDED, ids=["plain", "top_k", "top_p", "top_k_top_p"])
def test_a_seeded_row_draws_the_same_alone_or_at_any_row_of_a_batch(params: dict[str, Any]) -> None:
    draws_alone_and_batched("cpu", params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", SEEDED, ids=["plain", "top_k", "top_p", "top_k_top_p"])
def test_a_seeded_row_draws_the_same_alone_or_batched_on_cuda(params: dict[str, Any]) -> None:
    draws_alone_and_batched("cuda", params)


def test_a_batch_draws_the_same_tokens_in_any_row_order() -> None:
    torch.manual_seed(4)
    settings = [{"temperature": 0}, {"temperature": 0.9}, {"temperature": 1.2, "top_k": 9},
                {"temperature": 0.8, "top_p": 0.7}, {"temperature": 1.0, "top_k": 30, "top_p": 0.95}] * 3
    logits = torch.randn(len(settings), 500) * 2
    # In path order (greedy, without top-p, with it): no gather.
    in_order = sorted(range(len(settings)), key=lambda r: (r % 5 > 0) + (r % 5 > 2))
    shuffled = torch.randperm(len(settings)).tolist()
    draws = []
    for rows in (list(range(len(settings))), in_order, shuffled):
        samplers = [sampler(seed=r, **settings[r]) for r in rows]
        tokens = torch.stack([sample(logits[rows], samplers) for _ in range(20)], dim=1)
        draws.append(torch.empty_like(tokens).index_copy_(0, torch.tensor(rows), tokens))
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])


def test_different_seeds_and_steps_draw_differently() -> None:
    logits = torch.zeros(8, 100_000)
    a = sample(logits, [sampler(temperature=1, seed=s) for s in range(8)])
    assert len(set(a.tolist())) == 8
    s = sampler(temperature=1, seed=3)
    assert len({int(s(logits[:1])) for _ in range(8)}) == 8


def frequencies(logits: torch.Tensor, params: dict[str, Any], rows: int = 250, steps: int = 80) -> torch.Tensor:
    """How often each token is drawn over rows x steps (seed, step) pairs."""
    samplers = [sampler(seed=seed, **params) for seed in range(rows)]
    counts = torch.zeros(logits.numel())
    batch = logits.expand(rows, -1)
    for _ in range(steps):
        counts += torch.bincount(sample(batch, samplers), minlength=logits.numel())
    return counts / (rows * steps)


def chi_square(observed: torch.Tensor, expected: torch.Tensor, n: int) -> float:
    keep = expected > 0
    assert observed[~keep].sum() == 0, observed
    return float((n * (observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Kept tokens at most 8, so 7 degrees of freedom at most: a chi-square past 40
# has probability about 1e-6 (the seeds are fixed, so it never flakes).
LOGITS = torch.tensor([1.5, 0.2, -0.7, 2.1, 0.0, 1.0, -2.0, 0.9])


@pytest.mark.parametrize("params, kept", [
    ({"temperature": 0.7}, range(8)),
    ({"temperature": 1.6}, range(8)),
    ({"temperature": 1.0, "top_k": 3}, [3, 0, 5]),
    ({"temperature": 1.0, "top_p": 0.7}, [3, 0, 5]),  # 0.61 before token 5, 0.74 before 7
    ({"temperature": 1.0, "top_k": 5, "top_p": 0.95}, [3, 0, 5, 7, 1]),
], ids=["T0.7", "T1.6", "top_k", "top_p", "top_k_top_p"])
def test_draws_follow_the_softmax_of_the_kept_tokens(params: dict[str, Any], kept: Any) -> None:
    mask = torch.full_like(LOGITS, -math.inf)
    mask[list(kept)] = 0
    expected = torch.softmax(LOGITS / params["temperature"] + mask, dim=-1)
    observed = frequencies(LOGITS[None], params)
    assert chi_square(observed, expected, 250 * 80) < 40, (observed, expected)


def test_equal_logits_draw_every_token_alike() -> None:
    # The hash of (key, token id) is as uniform over a larger vocabulary: 1000
    # bins, 20000 draws, a chi-square of 999 degrees of freedom (sd 45).
    counts = frequencies(torch.zeros(1, 1000), {"temperature": 1.0}, rows=250, steps=80)
    assert chi_square(counts, torch.full((1000,), 1e-3), 250 * 80) < 1250


def test_top_k_and_top_p_never_draw_outside_the_kept_set() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 2000) * 2
    order = logits.argsort(dim=-1, descending=True)
    for step in range(10):
        rows = [sampler(temperature=1.5, seed=r * 100 + step, top_k=r % 7 + 1) for r in range(64)]
        tokens = sample(logits, rows)
        rank = (order == tokens[:, None]).int().argmax(dim=-1)
        assert (rank < torch.tensor([r % 7 + 1 for r in range(64)])).all()
    # top_p: the kept set is the smallest prefix (by probability) reaching it.
    probs = torch.softmax(logits / 1.5, dim=-1).gather(1, order)
    limit = ((probs.cumsum(dim=-1) - probs) < 0.3).sum(dim=-1)
    for step in range(10):
        tokens = sample(logits, [sampler(temperature=1.5, seed=r * 100 + step, top_p=0.3) for r in range(64)])
        rank = (order == tokens[:, None]).int().argmax(dim=-1)
        assert (rank < limit).all()


def test_a_tiny_top_p_a_top_k_of_1_and_a_tiny_temperature_are_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(16, 5000)
    argmax = logits.argmax(dim=-1)
    for params in ({"top_p": 1e-6}, {"top_k": 1}, {"temperature": 1e-6}, {"temperature": 1e-40}):
        for step in range(5):
            rows = [sampler(**{"temperature": 2.0, "seed": r + 16 * step, **params}) for r in range(16)]
            assert torch.equal(sample(logits, rows), argmax), params


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    drawn = {int(sampler(temperature=1, seed=s, top_k=2)(logits)) for s in range(200)}
    assert drawn == {0, 2, 3, 5}


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(device: str) -> None:
    """top_p is in (0, 1], but float32 holds 1e-46 as 0: the most likely
    token still stays (a valid request never ends in an error or a token
    outside the nucleus)."""
    torch.manual_seed(1)
    logits = torch.randn(8, 300, device=device)
    for top_p in (1e-46, 5e-324, 1e-30):
        rows = [sampler(device, temperature=1, top_p=top_p, seed=r) for r in range(8)]
        assert torch.equal(sample(logits, rows), logits.argmax(dim=-1))
