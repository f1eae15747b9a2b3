"""Sampling parameters and the sampler: greedy, or temperature with top-k and
top-p, seeded per request."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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


class ParamError(ValueError):
    """A sampling parameter out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False

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


class Sampler:
    """Picks the next token from one position's logits. Greedy is argmax;
    sampling scales by the temperature, keeps the top-k, then the smallest set
    whose probability reaches top-p, and draws with the request's generator
    (seeded: the same request gives the same tokens)."""

    def __init__(self, params: SamplingParams, generation_config: Mapping[str, Any], device: torch.device) -> None:
        config = generation_config
        temperature = params.temperature
        if temperature is None:
            temperature = float(config.get("temperature") or 1.0) if config.get("do_sample") else 0.0
        self.greedy = temperature < MIN_TEMPERATURE
        self.temperature = temperature
        self.top_k = params.top_k if params.top_k is not None else int(config.get("top_k") or 0)
        self.top_p = params.top_p if params.top_p is not None else float(config.get("top_p") or 1.0)
        self.generator: torch.Generator | None = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed % (1 << 64))
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token, as a one-element int64 tensor on the logits' device
        (it is the next step's input as it is: no trip through the host)."""
        row = logits.reshape(-1)
        if self.greedy:
            return row.argmax().reshape(1)
        scores = (row.float() - row.max().float()) / self.temperature
        if 0 < self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token once the ones before it already reach top_p (the
            # first token always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= self.top_p
            sorted_scores = sorted_scores.masked_fill(drop, -math.inf)
            scores = torch.empty_like(scores).scatter_(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)
