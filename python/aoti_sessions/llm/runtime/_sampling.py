"""The sampler: greedy, or temperature with min-p, top-k and top-p, seeded
per request; logit bias and the repetition, frequency and presence
penalties (_penalties.py); logprobs (_logprobs.py); many rows, each with its
own settings (:class:`SamplingParams`, _params.py), sampled at once on the
device."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._logprobs import StepLogprobs
from ._params import MIN_TEMPERATURE, ParamError, SamplingParams, generation_defaults, sampling_params
from ._penalties import Penalties

__all__ = ["Sampler", "sample", "draw", "SamplingParams", "ParamError", "sampling_params"]

# The random draws are a hash of (seed, step, token id), not a generator's
# state, so a row's draws do not depend on the batch it is in. The host turns
# (seed, step) into a 32-bit key per row (splitmix64); the device hashes (key,
# token id) with lowbias32 (C. Wellons' 32-bit integer hash) in int32 ops.
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX_INDEX = -1640531527  # 0x9E3779B9 as an int32: spreads consecutive token ids
_MIX_1 = 0x7FEB352D
_MIX_2 = -2073254261  # 0x846CA68B as an int32 (int32 products wrap)


class Sampler:
    """One generation's sampling settings and its random stream. The logits
    are biased and penalized first (if asked); greedy is then argmax;
    sampling scales by the temperature, keeps the tokens at least min-p times
    as likely as the most likely, then the top-k (every token tied with the
    k-th too), then the smallest set whose probability reaches top-p, and
    draws from the softmax of what is left.

    Draws are keyed by (seed, step, token id), never by a generator's state:
    the token drawn at ``step`` n depends only on the seed, n, this row's
    logits and the settings, so a generation draws the same tokens alone or in
    any batch (see :func:`sample`). ``step`` counts the tokens drawn so far;
    every call advances it by one (a caller that rewinds sets it back).

    A bias or a penalty keeps state on the device: a slot of ``penalties``
    (the step loop's; without one, its own), taken at the first draw, given
    back with :meth:`release`; ``prompt``: the tokens the repetition penalty
    counts as seen. The draws need no state on the device; ``device`` is not
    used (a slot of its own is on the logits' device)."""

    def __init__(self, params: SamplingParams, generation_config: Mapping[str, Any], device: torch.device,
                 prompt: Sequence[int] = (), penalties: Penalties | None = None) -> None:
        config = generation_defaults(generation_config)
        temperature = params.temperature if params.temperature is not None else config["temperature"]
        self.greedy = temperature < MIN_TEMPERATURE
        self.temperature = temperature
        self.top_k = params.top_k if params.top_k is not None else int(config["top_k"])
        self.top_p = params.top_p if params.top_p is not None else config["top_p"]
        self.min_p = params.min_p if params.min_p is not None else config["min_p"]
        self.repetition_penalty = params.repetition_penalty if params.repetition_penalty is not None else \
            config["repetition_penalty"]
        self.presence_penalty = params.presence_penalty
        self.frequency_penalty = params.frequency_penalty
        self.logit_bias = params.biases
        self.logprobs = params.logprobs
        self.penalized = self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
        self.adjusted = self.penalized or bool(self.logit_bias)  # has a slot of penalties
        # Anything past argmax or the draw: what the sampler's plain paths skip.
        self.extra = self.adjusted or self.logprobs is not None or (not self.greedy and self.min_p > 0)
        self.plain_greedy = self.greedy and not self.extra
        self._prompt = tuple(prompt) if self.repetition_penalty != 1.0 else ()
        self._penalties = penalties
        self._slot: int | None = None
        # Unseeded: a seed of its own, drawn once, so its draws are as independent
        # of other generations' as two seeds' are.
        self.seed = params.seed % (1 << 64) if params.seed is not None else secrets.randbits(64)
        self.step = 0
        self._stream = _mix64(self.seed)

    def _slot_in(self, vocab: int, device: torch.device) -> tuple[Penalties, int]:
        """Its penalties and slot (taken at the first call)."""
        if self._penalties is None:
            self._penalties = Penalties(device)
        if self._slot is None:
            self._slot = self._penalties.acquire(vocab, self._prompt, self.logit_bias)
        return self._penalties, self._slot

    def release(self) -> None:
        """Gives its slot of penalties back (its generation ended); idempotent."""
        if self._slot is not None:
            assert self._penalties is not None
            self._penalties.release(self._slot)
            self._slot = None

    def _next_key(self) -> int:
        """The 32-bit key of this step's draw (signed, as the device's int32
        holds it): the step-th output of splitmix64 started at the mixed seed
        (any step's, without the ones before); advances the step."""
        step, self.step = self.step, self.step + 1
        key = _mix64((self._stream + (step + 1) * _GOLDEN64) & _MASK64) >> 32
        return key - (1 << 32) if key >= 1 << 31 else key

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token, as a one-element int64 tensor on the logits' device
        (it is the next step's input as it is: no trip through the host). The
        same as this row's token in a batch (:func:`sample`)."""
        return sample(logits.reshape(1, -1), [self])


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a 64-bit bijection in which every input bit
    flips every output bit with probability about 1/2."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _log_exponentials(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log E for E ~ Exp(1), independent per (row, token id), float32: row r
    of ``keys`` (int32 ``[B]``) and each id of ``index`` (``[V]`` or ``[B, V]``)."""
    x = index.to(torch.int32, copy=True).mul_(_MIX_INDEX)
    x = x ^ keys[:, None] if x.dim() == 1 else x.bitwise_xor_(keys[:, None])
    # torch's >> on signed integers copies the sign bit in: mask it out (a
    # logical shift), or the xor-shift would stop being a bijection.
    shifted = torch.empty_like(x)
    for shift, multiplier in ((16, _MIX_1), (15, _MIX_2)):
        torch.bitwise_right_shift(x, shift, out=shifted)
        x ^= shifted.bitwise_and_((1 << (32 - shift)) - 1)
        x *= multiplier
    # The top 23 bits (the best mixed after a multiply) as the mantissa of a
    # float in [1, 2): minus (1 - 2^-24), that is u = (v + 1/2) / 2^23 exactly,
    # in (0, 1), so both logs stay finite (and no int-to-float conversion).
    torch.bitwise_right_shift(x, 9, out=shifted)
    u = shifted.bitwise_and_((1 << 23) - 1).bitwise_or_(0x3F800000).view(torch.float32)
    return u.sub_(1.0 - 2.0 ** -24).log_().neg_().log_()


def _drop_below_top_k(scores: torch.Tensor, ranked: torch.Tensor, kth: torch.Tensor) -> None:
    """Sets to -inf the scores below their row's k-th largest, read from
    ``ranked`` (each row's largest scores in descending order) at ``kth`` (k - 1,
    or -1 where the row keeps all)."""
    threshold = ranked.gather(1, kth.clamp(min=0)[:, None])
    threshold = torch.where(kth[:, None] >= 0, threshold, -math.inf)
    scores.masked_fill_(scores < threshold, -math.inf)


def _race(scores: torch.Tensor, keys: torch.Tensor, kth: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows without top-p: the exponential race over the whole vocabulary,
    after a top-k at the rows' largest k (``top_k``; 0: none)."""
    if top_k:
        _drop_below_top_k(scores, torch.topk(scores, top_k, dim=-1).values, kth)
    scores.sub_(_log_exponentials(keys, torch.arange(scores.shape[1], device=scores.device)))
    return scores.argmax(dim=-1)


def _nucleus(scores: torch.Tensor, keys: torch.Tensor, kth: torch.Tensor, top_k: int,
             top_p: torch.Tensor) -> torch.Tensor:
    """Rows with top-p: sorted (stably, so that tied tokens keep one order
    whatever the batch), top-k, top-p, then the race among what is left."""
    scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    if top_k:
        _drop_below_top_k(scores, scores, kth)
    probs = torch.softmax(scores, dim=-1)
    # Drop a token once the ones before it already reach top_p; the first
    # token always stays, even for a top_p that float32 rounds to 0.
    before = torch.cumsum(probs, dim=-1).sub_(probs)
    drop = before >= top_p[:, None]
    drop[:, 0] = False
    scores.masked_fill_(drop, -math.inf)
    scores.sub_(_log_exponentials(keys, order))
    return order.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


def sample(logits: torch.Tensor, samplers: Sequence[Sampler]) -> torch.Tensor:
    """Row r's next token, drawn from ``logits[r]`` (``[B, V]``, float32, bf16
    or fp16) with ``samplers[r]``'s settings at its step, as an int64 tensor
    ``[B]`` on the logits' device; advances every sampler's step (:func:`draw`)."""
    return draw(logits, samplers)[0]


def draw(logits: torch.Tensor, samplers: Sequence[Sampler]) -> tuple[torch.Tensor, StepLogprobs | None]:
    """:func:`sample`'s tokens, and the logprobs of the rows that ask for
    them (None where none does).

    It only queues device work (one copy of the rows' parameters, then
    whole-batch kernels, as many whatever B is): nothing waits for the device.
    Each row takes the path its own settings call for: greedy rows an argmax;
    rows without top-p the exponential race over the vocabulary (after one
    top-k at their largest k, if any uses top-k); rows with top-p a sort
    first (the only full sort). A drawn row's token is argmax(score - log E)
    over the tokens its filters keep, with E ~ Exp(1) per token (the winner
    is distributed as the softmax of the scores) hashed from (seed, step,
    token id): the same token whichever rows share the batch, or alone.
    Rows of several paths are gathered path by path (one copy of the logits),
    unless they already come greedy first, then without top-p, then with it.
    Rows with a bias or a penalty are adjusted apart (their rows gathered,
    adjusted, put back; their counts updated from the tokens drawn), min-p
    filters every drawn row where one has it, and logprobs are of the raw
    logits of the rows that ask: rows without any of these cost nothing more.
    """
    rows, vocab = logits.shape
    if len(samplers) != rows:
        raise ValueError(f"{rows} rows of logits but {len(samplers)} samplers")
    plain = [r for r, s in enumerate(samplers) if s.plain_greedy]
    if len(plain) == rows:  # (no draw: a step needs no key)
        for s in samplers:
            s.step += 1
        return logits.argmax(dim=-1), None
    keys = [s._next_key() for s in samplers]
    greedy = [r for r, s in enumerate(samplers) if s.greedy]
    race = [r for r, s in enumerate(samplers) if not s.greedy and s.top_p >= 1.0]
    nucleus = [r for r, s in enumerate(samplers) if not s.greedy and s.top_p < 1.0]
    order = greedy + race + nucleus
    kth = [s.top_k - 1 if 0 < s.top_k < vocab else -1 for s in samplers]

    # One host tensor, one copy: [key, k - 1, temperature, top-p, row] per row
    # in path order (float64 holds the int32 keys and the integers exactly),
    # then what rows with more settings need (_Extras).
    per_row = [(keys[r], kth[r], samplers[r].temperature, samplers[r].top_p, r) for r in order]
    values = [v for field in zip(*per_row) for v in field]
    extras = _Extras(samplers, order, len(greedy), vocab, logits.device, values) \
        if any(samplers[r].extra for r in order) else None
    cuda = logits.device.type == "cuda"
    params = torch.tensor(values, dtype=torch.float64, pin_memory=cuda).to(logits.device, non_blocking=True)
    rows_of = params[4 * rows:5 * rows].long() if order != list(range(rows)) else None
    x = logits.index_select(0, rows_of) if rows_of is not None else logits
    start, end = len(greedy), len(greedy) + len(race)
    parts = []
    if greedy:
        chosen = x[:start].argmax(dim=-1)
        if extras is not None:
            extras.greedy_adjusted(x[:start], chosen, params)
        parts.append(chosen)
    if start < rows:
        drawn = x[start:]
        # bf16 / fp16 logits are widened inside the division (no float32 copy first).
        drawn = drawn if drawn.dtype in (torch.bfloat16, torch.float16) else drawn.float()
        temperature = params[2 * rows + start:3 * rows, None].float()
        scores = torch.div(drawn, temperature)
        if extras is not None:
            extras.drawn_adjusted(scores, params)
        row_keys = params[start:rows].to(torch.int32)
        kths = params[rows + start:2 * rows].long()
        if race:
            top_k = max(kth[r] for r in race) + 1
            parts.append(_race(scores[:end - start], row_keys[:end - start], kths[:end - start], top_k))
        if nucleus:
            top_k = max(kth[r] for r in nucleus) + 1
            parts.append(_nucleus(scores[end - start:], row_keys[end - start:], kths[end - start:], top_k,
                                  params[3 * rows + end:4 * rows].float()))
    tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
    if extras is not None:
        extras.count(tokens, params)
    if rows_of is not None:
        tokens = torch.empty_like(tokens).index_copy_(0, rows_of, tokens)
    return tokens, extras.logprobs(logits, tokens, params) if extras is not None else None


class _Extras:
    """What one :func:`draw` does for rows with more than the plain
    settings: their parameters, appended to the host tensor's ``values``
    (its sections by offset), and the work on the device.

    - min-p (drawn rows, where one has it): log(min_p) per drawn row (-inf:
      none), a threshold under each row's largest score;
    - biased or penalized rows: [position in path order, slot, repetition,
      frequency, presence, temperature] each, their slots taken here;
    - logprobs: the batch rows that ask, in order."""

    def __init__(self, samplers: Sequence[Sampler], order: list[int], greedy: int, vocab: int,
                 device: torch.device, values: list[float]) -> None:
        rows = len(order)
        self.rows = rows
        drawn = [samplers[r] for r in order[greedy:]]
        self.min_p = -1
        if any(s.min_p > 0 for s in drawn):
            self.min_p = len(values)
            values.extend(math.log(s.min_p) if s.min_p > 0 else -math.inf for s in drawn)
        adjusted = [i for i, r in enumerate(order) if samplers[r].adjusted]
        self.greedy_count = sum(1 for i in adjusted if i < greedy)
        self.adjusted = len(adjusted)
        self.penalties: Penalties | None = None
        self.kinds = (False, False)  # whether any row has a repetition penalty; a frequency or presence one
        if adjusted:
            self.at = len(values)
            slots = []
            for i in adjusted:
                s = samplers[order[i]]
                penalties, slot = s._slot_in(vocab, device)
                if self.penalties is None:
                    self.penalties = penalties
                elif penalties is not self.penalties:
                    raise ValueError("rows with penalties of different step loops in one batch")
                slots.append(slot)
            chosen = [samplers[order[i]] for i in adjusted]
            self.kinds = (any(s.repetition_penalty != 1.0 for s in chosen),
                          any(s.frequency_penalty or s.presence_penalty for s in chosen))
            values.extend(adjusted)
            values.extend(slots)
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "temperature"):
                values.extend(getattr(s, name) for s in chosen)
        self.logprob_rows = [r for r, s in enumerate(samplers) if s.logprobs is not None]
        self.logprob_counts = [samplers[r].logprobs or 0 for r in self.logprob_rows]
        self.logprob_at = len(values)
        if self.logprob_rows and self.logprob_rows != list(range(rows)):
            values.extend(self.logprob_rows)

    def _adjusted(self, params: torch.Tensor, first: int, last: int) -> list[torch.Tensor]:
        """Sections of the adjusted rows first..last: position, slot, repetition, frequency, presence, temperature."""
        n = self.adjusted
        return [params[self.at + k * n + first:self.at + k * n + last] for k in range(6)]

    def greedy_adjusted(self, logits: torch.Tensor, chosen: torch.Tensor, params: torch.Tensor) -> None:
        """The adjusted greedy rows' argmax in ``chosen``, of their adjusted logits."""
        if not self.greedy_count:
            return
        assert self.penalties is not None
        where, slots, repetition, frequency, presence, _ = self._adjusted(params, 0, self.greedy_count)
        where = where.long()
        sub = self.penalties.adjusted(logits, where, slots.long(), repetition.float(), frequency.float(),
                                      presence.float(), None, self.kinds)
        chosen.index_copy_(0, where, sub.argmax(dim=-1))

    def drawn_adjusted(self, scores: torch.Tensor, params: torch.Tensor) -> None:
        """The drawn rows' scores (logits / temperature): the adjusted rows'
        adjusted, then min-p; in place."""
        greedy = self.rows - scores.shape[0]
        if self.adjusted > self.greedy_count:
            assert self.penalties is not None
            where, slots, repetition, frequency, presence, temperature = \
                self._adjusted(params, self.greedy_count, self.adjusted)
            where = where.long() - greedy
            sub = self.penalties.adjusted(scores, where, slots.long(), repetition.float(), frequency.float(),
                                          presence.float(), temperature.float(), self.kinds)
            scores.index_copy_(0, where, sub)
        if self.min_p >= 0:
            floor = params[self.min_p:self.min_p + scores.shape[0], None].float()
            scores.masked_fill_(scores < scores.amax(dim=-1, keepdim=True) + floor, -math.inf)

    def count(self, tokens: torch.Tensor, params: torch.Tensor) -> None:
        """The penalized rows' counts take their tokens (``tokens`` in path order)."""
        if any(self.kinds):
            assert self.penalties is not None
            where, slots = self._adjusted(params, 0, self.adjusted)[:2]
            self.penalties.count(slots.long(), tokens.index_select(0, where.long()))

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, params: torch.Tensor) -> StepLogprobs | None:
        if not self.logprob_rows:
            return None
        every = self.logprob_rows == list(range(self.rows))
        where = None if every else params[self.logprob_at:self.logprob_at + len(self.logprob_rows)].long()
        return StepLogprobs.of(logits, self.logprob_rows, where, self.logprob_counts, tokens)
