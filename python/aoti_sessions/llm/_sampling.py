"""Sampling parameters and the sampler: greedy, or temperature with top-k and
top-p, seeded per request; many rows, each with its own settings, sampled at
once on the device."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._grammar import Constraint

# The largest ``max_tokens`` accepted: anything past the context ends with
# finish reason "length" anyway, but a number this large is a client bug.
MAX_TOKENS_LIMIT = 1 << 20
# Stop strings: at most this many, of at most this many characters (each new
# token is checked against every one of them).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# Temperatures below this sample as greedy: dividing by them overflows the
# scores to inf, and the softmax of those is NaN.
MIN_TEMPERATURE = 1e-5

# The random draws are a hash of (seed, step, token id), not a generator's
# state, so a row's draws do not depend on the batch it is in. The host turns
# (seed, step) into a 32-bit key per row (splitmix64); the device hashes (key,
# token id) with lowbias32 (C. Wellons' 32-bit integer hash) in int32 ops.
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX_INDEX = -1640531527  # 0x9E3779B9 as an int32: spreads consecutive token ids
_MIX_1 = 0x7FEB352D
_MIX_2 = -2073254261  # 0x846CA68B as an int32 (int32 products wrap)


class ParamError(ValueError):
    """A sampling parameter out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def sampling_params(params: SamplingParams | None, fields: dict[str, Any]) -> SamplingParams:
    """A start's parameters: ``params``, or :class:`SamplingParams` of the
    keyword ``fields`` (not both)."""
    if params is not None and fields:
        raise TypeError("give either params or SamplingParams fields as keywords, not both")
    return params if params is not None else SamplingParams(**fields)


def _number(name: str, value: object, low: float, high: float, *, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if not (low <= value <= high) or (isinstance(value, float) and math.isnan(value)):
        raise ParamError(name.removesuffix("[]"), f"{name} must be in [{low:g}, {high:g}], got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``None`` fields take the package's generation config
    (its ``temperature``, ``top_p``, ``top_k``; greedy if it does not sample).

    ``temperature=0`` (or below 1e-5) is greedy whatever the generation config says.
    ``max_tokens=None`` generates until a stop or the end of the context.
    ``stop``: strings that end the text (not included in it);
    ``stop_token_ids``: token ids that end it, besides the model's
    end-of-sequence tokens (``ignore_eos=True`` drops those).
    ``constraint``: a grammar the text must match (:class:`Constraint`: a
    JSON schema, any JSON object, a regex, a Lark grammar); the reply ends
    where the grammar is complete, whatever ``ignore_eos`` says.
    ``keep_special_tokens``: ids of special tokens the text keeps (a
    tool-call or reasoning format's markup, as ``[TOOL_CALLS]``); it
    leaves out the others.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None
    keep_special_tokens: Sequence[int] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _number("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT, integer=True)
        if self.temperature is not None:
            _number("temperature", self.temperature, 0.0, 100.0)
        if self.top_p is not None:
            _number("top_p", self.top_p, 0.0, 1.0)
            if self.top_p == 0:
                raise ParamError("top_p", "top_p must be in (0, 1], got 0")
        if self.top_k is not None:
            _number("top_k", self.top_k, 0, 1 << 31, integer=True)
        if self.seed is not None:
            _number("seed", self.seed, -(1 << 63), (1 << 64) - 1, integer=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH:
                raise ParamError("stop", f"stop strings must be non-empty strings of at most {MAX_STOP_LENGTH} "
                                         f"characters, got {s!r:.60}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        for t in ids:
            _number("stop_token_ids[]", t, 0, 1 << 31, integer=True)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        keep = tuple(self.keep_special_tokens)
        for t in keep:
            _number("keep_special_tokens[]", t, 0, 1 << 31, integer=True)
        object.__setattr__(self, "keep_special_tokens", keep)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise TypeError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")


class Sampler:
    """One generation's sampling settings and its random stream. Greedy is
    argmax; sampling scales by the temperature, keeps the top-k (every token
    tied with the k-th too), then the smallest set whose probability reaches
    top-p, and draws from the softmax of what is left.

    Draws are keyed by (seed, step, token id), never by a generator's state:
    the token drawn at ``step`` n depends only on the seed, n, this row's
    logits and the settings, so a generation draws the same tokens alone or in
    any batch (see :func:`sample`). ``step`` counts the tokens drawn so far;
    every call advances it by one (a caller that rewinds sets it back).
    ``device`` is not used: draws need no state on the device."""

    def __init__(self, params: SamplingParams, generation_config: Mapping[str, Any], device: torch.device) -> None:
        config = generation_config
        temperature = params.temperature
        if temperature is None:
            temperature = float(config.get("temperature") or 1.0) if config.get("do_sample") else 0.0
        self.greedy = temperature < MIN_TEMPERATURE
        self.temperature = temperature
        self.top_k = params.top_k if params.top_k is not None else int(config.get("top_k") or 0)
        self.top_p = params.top_p if params.top_p is not None else float(config.get("top_p") or 1.0)
        # Unseeded: a seed of its own, drawn once, so its draws are as independent
        # of other generations' as two seeds' are.
        self.seed = params.seed % (1 << 64) if params.seed is not None else secrets.randbits(64)
        self.step = 0
        self._stream = _mix64(self.seed)

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
    ``[B]`` on the logits' device; advances every sampler's step.

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
    """
    rows, vocab = logits.shape
    if len(samplers) != rows:
        raise ValueError(f"{rows} rows of logits but {len(samplers)} samplers")
    greedy = [r for r, s in enumerate(samplers) if s.greedy]
    if len(greedy) == rows:  # (no draw: a step needs no key)
        for s in samplers:
            s.step += 1
        return logits.argmax(dim=-1)
    keys = [s._next_key() for s in samplers]
    race = [r for r, s in enumerate(samplers) if not s.greedy and s.top_p >= 1.0]
    nucleus = [r for r, s in enumerate(samplers) if not s.greedy and s.top_p < 1.0]
    order = greedy + race + nucleus
    kth = [s.top_k - 1 if 0 < s.top_k < vocab else -1 for s in samplers]

    # One host tensor, one copy: [key, k - 1, temperature, top-p, row] per row
    # in path order (float64 holds the int32 keys and the integers exactly).
    per_row = [(keys[r], kth[r], samplers[r].temperature, samplers[r].top_p, r) for r in order]
    values = [v for field in zip(*per_row) for v in field]
    cuda = logits.device.type == "cuda"
    params = torch.tensor(values, dtype=torch.float64, pin_memory=cuda).to(logits.device, non_blocking=True)
    params = params.view(5, rows)
    permuted = order != list(range(rows))
    rows_of = params[4].long() if permuted else None
    x = logits.index_select(0, rows_of) if rows_of is not None else logits
    start, end = len(greedy), len(greedy) + len(race)
    drawn = x[start:]
    # bf16 / fp16 logits are widened inside the division (no float32 copy first).
    drawn = drawn if drawn.dtype in (torch.bfloat16, torch.float16) else drawn.float()
    scores = torch.div(drawn, params[2, start:, None].float())
    row_keys = params[0, start:].to(torch.int32)
    kths = params[1, start:].long()
    parts = [x[:start].argmax(dim=-1)] if greedy else []
    if race:
        top_k = max(kth[r] for r in race) + 1
        parts.append(_race(scores[:end - start], row_keys[:end - start], kths[:end - start], top_k))
    if nucleus:
        top_k = max(kth[r] for r in nucleus) + 1
        parts.append(_nucleus(scores[end - start:], row_keys[end - start:], kths[end - start:], top_k,
                              params[3, end:].float()))
    tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
    return torch.empty_like(tokens).index_copy_(0, rows_of, tokens) if rows_of is not None else tokens
