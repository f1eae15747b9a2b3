"""Structured output: a generation's tokens held to a grammar (a JSON schema,
any JSON object, a regular expression or a Lark grammar).

The grammar engine is llguidance (a maintained Rust engine with an abi3
wheel and no Python dependencies; the structured-output engine behind
several serving stacks): it compiles a constraint against the tokenizer's
vocabulary once (:class:`Grammars` keeps compiled grammars, each generation
a copy), and for each step gives a bit mask of the tokens that keep the text
within the grammar. The step loop computes the masks of a step's
constrained rows on the host once the step before is read (while the
device runs the forward pass), and :class:`Masks` sets every other
token's logit to -inf before the batch is sampled: even a random-weight
model's text then matches its grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Constraint", "Grammars", "Guide", "Masks"]

KINDS = ("json_schema", "json_object", "regex", "lark", "llguidance")
MAX_CONSTRAINT_CHARS = 100_000  # a schema, pattern or grammar's text at most
GRAMMARS_CACHED = 128  # compiled grammars an LLM keeps (least recently used dropped)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of the llm and serve extras
        raise ImportError("structured output needs llguidance: pip install 'aoti-sessions[llm]'") from e
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a generation's text must match. Made with :meth:`json_schema`,
    :meth:`json_object`, :meth:`regex`, :meth:`lark` (or :meth:`after`,
    a grammar followed by another); checked when made
    (a ValueError names what is wrong). A JSON constraint's text has no
    whitespace between its tokens (``{"a":1}``), so a model cannot spend
    its tokens on blanks."""

    kind: str
    # The schema as JSON text, the pattern or the grammar ("" for json_object; llguidance's own grammar as JSON).
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise TypeError(f"a constraint's value must be a str, got {type(self.value).__name__}")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{self.kind}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(self.value)}")
        if self.kind in ("regex", "lark", "llguidance") and not self.value:
            raise ValueError(f"{self.kind}: empty")
        error = _llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"{self.kind}: {error}")

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str) -> Constraint:
        """JSON text valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema: not JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        return Constraint("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @staticmethod
    def json_object() -> Constraint:
        """Any JSON object."""
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        """Text the regular expression matches as a whole (Rust regex syntax)."""
        return Constraint("regex", pattern)

    @staticmethod
    def lark(grammar: str) -> Constraint:
        """Text of a Lark grammar (llguidance's dialect: ``start: ...``; ``%json {...}`` embeds a schema)."""
        return Constraint("lark", grammar)

    @staticmethod
    def after(lark: str, body: Constraint) -> Constraint:
        """Text of the Lark grammar ``lark``, where ``@body`` stands for text
        ``body`` holds (how a reply may reason before what a constraint
        holds: llm/runtime/_reasoning.py)."""
        inner = body.grammar()
        entry: dict[str, Any]
        try:
            entry = dict(json.loads(inner)["grammars"][0])
        except (ValueError, KeyError, TypeError, IndexError):
            entry = {"lark_grammar": inner}  # (a Lark grammar's text)
        return Constraint("llguidance", json.dumps({"grammars": [{"lark_grammar": lark}, {**entry, "name": "body"}]}))

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        if self.kind == "llguidance":
            return self.value
        matcher = _llguidance().LLMatcher
        compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if self.kind == "json_schema":
            return str(matcher.grammar_from_json_schema(self.value, defaults=compact))
        if self.kind == "json_object":
            return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=compact))
        if self.kind == "regex":
            return str(matcher.grammar_from_regex(self.value))
        return str(matcher.grammar_from_lark(self.value))


class Guide:
    """One generation's place in its grammar: the tokens it allows next, and
    each token taken (:meth:`take`)."""

    def __init__(self, matcher: Any, eos_ids: Collection[int]) -> None:
        self.matcher = matcher
        self._eos = eos_ids

    @property
    def usable(self) -> bool:
        """Whether its mask means anything (not failed)."""
        return not self.matcher.is_error()

    def take(self, token: int) -> str:
        """Takes a sampled token: ``"more"`` (the text goes on), ``"done"``
        (the grammar is complete with it: nothing but the end may follow),
        ``"end"`` (the token is the end itself, no text). Raises ValueError
        for a token the grammar refused (its mask allowed it not)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not fit the generation's constraint: {self.matcher.get_error()}")
        if self.matcher.is_stopped():
            return "end" if token in self._eos else "done"
        return "more"


class Grammars:
    """An LLM's grammar engine: its vocabulary in llguidance's terms (made at
    the first constraint: about a second for a large vocabulary) and the
    grammars compiled against it, the most recent :data:`GRAMMARS_CACHED`
    kept, so a schema used again costs a copy."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Collection[int]) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = frozenset(eos_ids)
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()  # (compiling happens on callers' threads)

    def _vocabulary(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size,
                                                           eos_token=sorted(self._eos) or None)
        return self._tokenizer

    def guide(self, constraint: Constraint) -> Guide:
        """A generation's guide to ``constraint`` (compiled once; ValueError
        for one the vocabulary cannot spell)."""
        if not isinstance(constraint, Constraint):
            raise TypeError(f"constraint must be a Constraint, got {type(constraint).__name__}")
        with self._lock:
            template = self._compiled.get(constraint)
            if template is None:
                template = _llguidance().LLMatcher(self._vocabulary(), constraint.grammar())
                if template.is_error():
                    raise ValueError(f"{constraint.kind}: {template.get_error()}")
                self._compiled[constraint] = template
                while len(self._compiled) > GRAMMARS_CACHED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint)
            return Guide(template.deep_copy(), self._eos)


MASK_THREADS = 4  # llguidance's threads computing a step's masks (more only contend with the step loop)
# Up to this many rows a step's masks are computed one after another on the loop's thread: waking the
# threads cost more than they saved (an H200's host, 16 rows in the step loop alone, bench/profile_grammar.py:
# 0.63 ms a step reading and sampling against 0.77 ms on 4 threads, tokens/s -8% against -18% of the
# unconstrained loop's; this 2-CPU machine, 4 rows: 0.44 ms against 0.75 ms).
MASK_SERIAL_ROWS = 32


class Masks:
    """A step loop's masks: one host buffer (pinned on CUDA), reused: a
    step's masks are copied before its tokens, which the loop reads before
    it computes the next step's."""

    def __init__(self) -> None:
        self._executor: Any = None
        self._host: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, guides: Sequence[Guide | None]) -> None:
        """Sets to -inf, in place, each row's logits of the tokens its guide
        does not allow next (rows without one, or whose guide failed, stay as
        they are). The masks are computed on the host (llguidance, in
        parallel over the rows), copied in one piece and unpacked on the
        device."""
        rows, vocab = logits.shape
        guided = [(g.matcher, r) for r, g in enumerate(guides) if g is not None and g.usable]
        if not guided:
            return
        words = (vocab + 31) // 32
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words:
            host = self._host = torch.empty((max(rows, 64), words), dtype=torch.int32,
                                            pin_memory=logits.device.type == "cuda")
        bits = host[:rows]
        bits.fill_(-1)
        if len(guided) <= MASK_SERIAL_ROWS:
            for matcher, row in guided:
                matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor(num_threads=MASK_THREADS)
            self._executor.unsafe_compute_mask_ptr(guided, bits.data_ptr(), words * 4, rows)
        _unpack_into(logits, bits.to(logits.device, non_blocking=True))


_BITS: dict[torch.device, torch.Tensor] = {}  # per device: 1 << i for i in 0..31, as int32 (bit 31 negative)


def _unpack_into(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """-inf where a token's bit is clear: three kernels (a step's host time
    goes by the launch on the GPU, not by the bytes)."""
    rows, vocab = logits.shape
    words = bits.shape[1]
    powers = _BITS.get(logits.device)
    if powers is None:
        powers = _BITS[logits.device] = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                                     device=logits.device)
    blocked = (bits[:, :, None] & powers).eq(0).view(rows, words * 32)[:, :vocab]
    logits.masked_fill_(blocked, float("-inf"))
