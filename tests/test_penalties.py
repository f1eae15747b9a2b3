"""The sampler's logit bias, penalties, min-p and logprobs
(aoti_sessions.llm.runtime._penalties, _logprobs, _sampling), against plain PyTorch
references of their definitions on random logits: every row of a batch that
mixes rows with and without each of them equals its reference and its solo
sample, step after step (the penalties' counts kept on the device)."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
import torch

from aoti_sessions.llm.runtime._logprobs import MAX_LOGPROBS
from aoti_sessions.llm.runtime._params import ParamError, SamplingParams, generation_defaults
from aoti_sessions.llm.runtime._penalties import Penalties
from aoti_sessions.llm.runtime._sampling import Sampler, _log_exponentials, draw

VOCAB = 1000


def reference_scores(logits: torch.Tensor, params: dict[str, Any], prompt: list[int], generated: list[int]) -> \
        torch.Tensor:
    """One row's logits as the definitions adjust them, in float64: the bias
    added; each token of the prompt or generated divided by the repetition
    penalty where positive, multiplied where not; each generated token less
    count * frequency + presence."""
    x = logits.double().clone()
    for token, bias in params.get("logit_bias", {}).items():
        x[token] += bias
    repetition = params.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(generated):
        x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
    for token, count in Counter(generated).items():
        x[token] -= count * params.get("frequency_penalty", 0.0) + params.get("presence_penalty", 0.0)
    return x


def reference_token(logits: torch.Tensor, params: dict[str, Any], prompt: list[int], generated: list[int],
                    key: int | None) -> int:
    """The token the definitions pick: greedy the argmax; drawn, the
    exponential race (the sampler's own noise for ``key``) among the tokens
    min-p keeps (probability >= min_p times the largest), then top-k, then
    top-p (the smallest set in descending order whose probability reaches it)."""
    x = reference_scores(logits, params, prompt, generated)
    if params.get("temperature", 1.0) == 0:
        return int(x.argmax())
    scores = x / params["temperature"]
    keep = torch.ones_like(scores, dtype=torch.bool)
    if params.get("min_p"):
        probs = torch.softmax(scores, dim=-1)
        keep &= probs >= params["min_p"] * probs.max()
    scores = scores.masked_fill(~keep, -math.inf)
    if params.get("top_k"):
        kth = scores.sort(descending=True).values[params["top_k"] - 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.get("top_p", 1.0) < 1:
        ranked, order = scores.sort(descending=True, stable=True)
        probs = torch.softmax(ranked, dim=-1)
        drop = (probs.cumsum(-1) - probs) >= params["top_p"]
        drop[0] = False
        scores = scores.clone()
        scores[order[drop]] = -math.inf
    assert key is not None
    noise = _log_exponentials(torch.tensor([key], dtype=torch.int32), torch.arange(VOCAB))[0].double()
    return int((scores - noise).argmax())


def random_settings(rng: random.Random) -> dict[str, Any]:
    """A random mix of the sampling settings, each feature in about half."""
    params: dict[str, Any] = {"temperature": rng.choice([0, 0, 0.7, 1.3]), "seed": rng.randrange(1 << 30)}
    if params["temperature"]:
        for name, values in (("top_k", [5, 50]), ("top_p", [0.5, 0.9]), ("min_p", [0.02, 0.2])):
            if rng.random() < 0.4:
                params[name] = rng.choice(values)
    if rng.random() < 0.5:
        params["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.5:
        params["presence_penalty"] = rng.choice([-1.0, 0.5, 2.0])
    if rng.random() < 0.5:
        params["frequency_penalty"] = rng.choice([-0.5, 1.0, 2.0])
    if rng.random() < 0.4:
        params["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, 3.0, 8.0, 100.0]) for _ in range(
            rng.choice([1, 3, 20]))}
    if rng.random() < 0.4:
        params["logprobs"] = rng.choice([0, 3, MAX_LOGPROBS])
    return params


@pytest.mark.parametrize("seed", range(4))
def test_mixed_batches_equal_the_definitions_and_each_rows_solo_sample(device: str, seed: int) -> None:
    """12 rows of random mixes (more than a Penalties' first 8 slots), 16
    steps: every row's token is its reference's and its solo sampler's,
    whatever the others use; the penalties count what each row drew."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = 12
    settings = [random_settings(rng) for _ in range(rows)]
    if seed == 0:  # (one batch of rows without any of the new settings but one)
        settings = [{"temperature": rng.choice([0, 0.8]), "seed": r} for r in range(rows - 1)] + [settings[0]]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))] for _ in range(rows)]
    shared = Penalties(torch.device(device))
    batched = [Sampler(SamplingParams(**p), {}, torch.device(device), prompt, shared)
               for p, prompt in zip(settings, prompts)]
    alone = [Sampler(SamplingParams(**p), {}, torch.device(device), prompt) for p, prompt in zip(settings, prompts)]
    keys = [Sampler(SamplingParams(**p), {}, torch.device(device)) for p in settings]  # (the draws' keys)
    generated: list[list[int]] = [[] for _ in range(rows)]
    for step in range(16):
        # (Flat logits, where penalties and biases decide, and spread ones, where they rarely do.)
        logits = (torch.randn(rows, VOCAB, generator=gen) * (0.5 if step % 2 else 4.0)).to(device)
        tokens, logprobs = draw(logits, batched)
        tokens_list = tokens.tolist()
        for r in range(rows):
            solo, solo_logprobs = draw(logits[r:r + 1], [alone[r]])
            assert int(solo) == tokens_list[r], (step, r, settings[r])
            key = keys[r]._next_key()
            assert tokens_list[r] == reference_token(logits[r].cpu(), settings[r], prompts[r], generated[r], key), \
                (step, r, settings[r])
            generated[r].append(tokens_list[r])
            if settings[r].get("logprobs") is not None:
                assert logprobs is not None and solo_logprobs is not None
                mine = logprobs.read(logprobs.packed(tokens).cpu(), tokens_list)[r]
                theirs = solo_logprobs.read(solo_logprobs.packed(solo).cpu(), [tokens_list[r]])[0]
                assert mine.token == theirs.token and [t for t, _ in mine.top] == [t for t, _ in theirs.top]
                assert [mine.logprob, *(v for _, v in mine.top)] == pytest.approx(
                    [theirs.logprob, *(v for _, v in theirs.top)], abs=1e-6)
                assert len(mine.top) == settings[r]["logprobs"]
        assert (logprobs is not None) == any(p.get("logprobs") is not None for p in settings)
    assert shared.in_use == sum(1 for s in batched if s.adjusted)


def test_logprobs_are_log_softmax_of_the_raw_logits_and_the_true_top(device: str) -> None:
    """Of the raw logits (before temperature, bias and penalties), in float32
    whatever the logits' dtype; the top ones the largest, in order; the copy
    to the host (packed after the tokens) keeps every bit."""
    torch.manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(5, VOCAB) * 3).to(device, dtype)
        settings = [{"temperature": 0, "logprobs": 5}, {"temperature": 0}, {"temperature": 0.5, "logprobs": 0,
                     "seed": 1, "logit_bias": {3: 100.0}, "presence_penalty": 1.0},
                    {"temperature": 2.0, "top_p": 0.5, "seed": 2, "logprobs": MAX_LOGPROBS}, {"temperature": 1.0}]
        samplers = [Sampler(SamplingParams(**p), {}, torch.device(device)) for p in settings]
        penalties = Penalties(torch.device(device))
        for s in samplers:
            s._penalties = penalties
        tokens, logprobs = draw(logits, samplers)
        assert logprobs is not None and logprobs.rows == [0, 2, 3]
        tokens_list = tokens.tolist()
        assert tokens_list[2] == 3  # (the bias of 100 wins; the logprob stays the raw logits')
        read = logprobs.read(logprobs.packed(tokens).cpu(), tokens_list)
        expected = torch.log_softmax(logits.float().cpu(), dim=-1)
        for row, count in ((0, 5), (2, 0), (3, MAX_LOGPROBS)):
            entry = read[row]
            assert entry.token == tokens_list[row]
            assert entry.logprob == pytest.approx(float(expected[row, entry.token]), abs=1e-5)
            values, ids = expected[row].topk(count)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
        if device == "cpu":
            assert logprobs.here(tokens_list) == read


def test_a_released_slot_starts_clean_and_slots_grow() -> None:
    """A slot given back and taken by the next generation holds nothing of
    the one before (its counts, its prompt, its bias); slots grow past the
    first 8 as generations take them."""
    penalties = Penalties(torch.device("cpu"))
    cpu = torch.device("cpu")
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 1.0, 0.8
    first = Sampler(SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={9: 1.5}), {}, cpu, [7], penalties)
    assert [int(draw(logits, [first])[0]) for _ in range(2)] == [9, 7]  # (9 biased past 7, then penalized)
    slot = first._slot
    first.release()
    # A count of 7 left over would take 2 off its logit; the bias of 9 would win.
    second = Sampler(SamplingParams(temperature=0, frequency_penalty=2.0), {}, cpu, [], penalties)
    assert int(draw(logits, [second])[0]) == 7 and second._slot == slot
    many = [Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), {}, cpu, [7], penalties) for _ in range(20)]
    assert draw(logits.expand(20, -1), many)[0].tolist() == [8] * 20  # (7, in the prompt, halved below 8)
    assert penalties.in_use == 21


def test_parameters_are_checked_naming_the_field() -> None:
    bad = [("min_p", 1.5), ("min_p", -0.1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
           ("repetition_penalty", 0), ("repetition_penalty", 11), ("repetition_penalty", -1), ("logprobs", 21),
           ("logprobs", -1), ("logit_bias", {5: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: math.nan}),
           ("logit_bias", {i: 1.0 for i in range(1025)})]
    for name, value in bad:
        with pytest.raises(ParamError) as caught:
            SamplingParams(**{name: value})
        assert caught.value.field == name, (name, value)
    for name, value in (("min_p", "0.1"), ("logprobs", 2.0), ("logit_bias", {"5": 1.0}), ("logit_bias", [5])):
        with pytest.raises(TypeError):
            SamplingParams(**{name: value})
    assert SamplingParams(logit_bias={7: 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    assert SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)]).biases == ((3, 2.0),)


def test_generation_config_defaults_apply_where_a_request_sets_none() -> None:
    """HF's generation config: temperature, top_k, top_p and min_p where it
    samples, repetition_penalty always (HF applies it to greedy decoding
    too); a request's own values win; values out of range are ignored."""
    config = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
              "repetition_penalty": 1.05}
    s = Sampler(SamplingParams(), config, torch.device("cpu"), [1, 2])
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (0.7, 20, 0.8, 0.05, 1.05)
    assert s.penalized and s._prompt == (1, 2)
    s = Sampler(SamplingParams(repetition_penalty=1.0, min_p=0.0, temperature=0), config, torch.device("cpu"))
    assert not s.penalized and s.plain_greedy
    greedy = Sampler(SamplingParams(), {"repetition_penalty": 1.2}, torch.device("cpu"))
    assert greedy.greedy and greedy.repetition_penalty == 1.2 and not greedy.plain_greedy
    assert generation_defaults({"repetition_penalty": 0, "min_p": 7, "top_p": 2}) == {
        "temperature": 0.0, "top_k": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
