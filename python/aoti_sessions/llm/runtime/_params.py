"""Sampling parameters (:class:`SamplingParams`), checked when made: a value
out of range is a :class:`ParamError` naming its field."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ._grammar import Constraint
from ._logprobs import MAX_LOGPROBS

__all__ = ["SamplingParams", "ParamError", "sampling_params", "generation_defaults"]

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
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias at most
MAX_REPETITION_PENALTY = 10.0


class ParamError(ValueError):
    """A sampling parameter out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:  # (raised in an engine process, re-raised in its parent)
        return ParamError, (self.field, str(self))


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

    ``min_p`` (0..1): drops the tokens less likely than ``min_p`` times the
    most likely one (after the temperature, before top-k and top-p, as vLLM).
    ``presence_penalty`` / ``frequency_penalty`` (-2..2, OpenAI's): subtracted
    from the logit of each token generated so far, once / once a time it was.
    ``repetition_penalty`` (> 0, HF's and vLLM's; 1: none): the logit of a
    token in the prompt or generated so far is divided by it where positive,
    multiplied where negative. ``logit_bias``: token id -> bias (-100..100)
    added to its logit (a dict, or pairs; kept as pairs by id). All on the
    raw logits, bias first, before the temperature (_penalties.py); ``None``
    for ``min_p`` and ``repetition_penalty`` takes the generation config's.
    ``logprobs``: each generated token's logprob and the ``logprobs`` most
    likely tokens' at its step (0 to 20; None: none), log_softmax of the
    model's raw logits (_logprobs.py): :attr:`Generation.logprobs`.
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
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    logprobs: int | None = None

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
        if self.min_p is not None:
            _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.repetition_penalty is not None:
            _number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
            if self.repetition_penalty == 0:
                raise ParamError("repetition_penalty", "repetition_penalty must be > 0 (1: none), got 0")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.logprobs is not None:
            _number("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)

    @property
    def biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, in id order (as it is kept)."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias)


def _logit_bias(bias: Mapping[int, float] | Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """A logit bias checked, as (token id, bias) pairs in id order (a repeated id: its last)."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ParamError("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"logit_bias must map token ids to biases, got {pair!r:.60}")
        token, value = pair
        _number("logit_bias[]", token, 0, (1 << 31) - 1, integer=True)
        _number("logit_bias[]", value, -100.0, 100.0)
        out[token] = float(value)
    return tuple(sorted(out.items()))


def generation_defaults(config: Mapping[str, Any]) -> dict[str, float]:
    """What a request that sets none of them samples with, from a package's
    generation config (HF's: ``temperature``, ``top_k``, ``top_p`` and
    ``min_p`` where it samples, ``do_sample``; else greedy; and
    ``repetition_penalty``, which HF applies to greedy decoding too); a
    value out of its range is left out, as if unset."""
    sampling = bool(config.get("do_sample"))
    return {"temperature": config_number(config, "temperature", 1.0, 0.0, 100.0) if sampling else 0.0,
            "top_k": float(config.get("top_k") or 0) if isinstance(config.get("top_k"), int) else 0.0,
            "top_p": config_number(config, "top_p", 1.0, 0.0, 1.0),
            "min_p": config_number(config, "min_p", 0.0, 0.0, 1.0),
            "repetition_penalty": config_number(config, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)}


def config_number(config: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    """The generation config's ``name`` where it is a number in (low, high], else ``default``."""
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        return default
    return float(value)
