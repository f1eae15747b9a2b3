"""Tool calls: what a tool-call format is (:class:`ToolFormat`, one small
class per model family's format, in _tool_formats.py and _harmony.py) and
the helpers the formats share. (_replies.py splits a reply's text with
one: ``ToolCallStream``.)

A format reads the calls in a reply's text, as it streams or whole (its
:meth:`ToolFormat.scanner`), and writes the grammar that holds a reply to
calls of the offered tools (:meth:`ToolFormat.calls_grammar`: ``tool_choice``
"required" or a named function), so that even a random-weight model's reply
is calls whose arguments fit their schemas. Its markup (``<tool_call>``,
``[TOOL_CALLS]``...) is written in a grammar as the tokenizer's own token
where it has one (:meth:`ToolFormat.marker`: a model emits the token, never
its spelling), and where that token is special, the reply's text keeps it
(:attr:`ToolFormat.markers`; the text leaves special tokens out otherwise).
Which format a model's replies use is chosen by name or read from its chat
template: _replies.py.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Union

__all__ = ["ToolCall", "Markup", "ToolFormat", "Scanner", "Piece", "call_of", "decode_json", "partial_end",
           "text_until", "Blocks", "NAME"]

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a function's name as a reply writes it
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


Piece = Union[str, ToolCall]


class Scanner(Protocol):
    """A format's reader of one reply. :meth:`scan` takes the reply's text
    not consumed yet and whether it is the whole rest (``final``), and
    returns the pieces found and how many characters they consumed; the rest
    comes again, with more, at the next call. It decides only on what it was
    given, so any split of a reply gives the same pieces as the whole."""

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]: ...


class Markup:
    """What a reply format shares: its markup, written in a grammar with the
    tokenizer's tokens. ``template``: the chat template (a form of the
    format may depend on it); ``tokens``: the tokenizer's added tokens,
    text -> id; ``vocabulary``: its whole vocabulary, on demand (harmony's
    may come from it)."""

    name: ClassVar[str]
    # Its markup, where a tokenizer holds it as special tokens: kept in the reply's text.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, template: str = "", tokens: Mapping[str, int] | None = None,
                 vocabulary: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.template = template
        self.tokens = dict(tokens or {})
        self.vocabulary = vocabulary

    @classmethod
    def detect(cls, template: str) -> bool:
        """Whether ``template`` teaches this format."""
        return False

    def marker(self, text: str) -> str:
        """``text`` in a grammar: its token where the tokenizer has it as one, else the string."""
        token = self.tokens.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)


class ToolFormat(Markup):
    """A family's tool-call format."""

    def scanner(self) -> Scanner:
        """A reader of one reply."""
        raise NotImplementedError

    def calls_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of a reply that is calls of
        ``tools`` (OpenAI's function definitions) and nothing else: one
        call, or (``parallel``) one or more."""
        raise NotImplementedError

    def call_id(self) -> str:
        """A new call's id, as the family's template takes it back."""
        return "call_" + secrets.token_hex(12)


def function_schemas(tools: Sequence[Mapping[str, Any]], arguments: str = "arguments") -> list[dict[str, Any]]:
    """Each tool's call as a JSON object ``{"name": ..., arguments: {...}}``
    and its schema (the function's ``parameters`` under ``arguments``)."""
    schemas = []
    for tool in tools:
        function = tool["function"]
        schemas.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         arguments: parameters(function)},
                        "required": ["name", arguments], "additionalProperties": False})
    if not schemas:
        raise ValueError("no tools to call")
    return schemas


def parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters") or {"type": "object"})


def json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule's body of JSON valid against ``schema``, written as the
    families' templates write calls (``{"a": 1, "b": 2}``)."""
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return f"%json {json.dumps({**schema, 'x-guidance': compact})}"


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def call_of(value: Any) -> ToolCall | None:
    """A call of a decoded JSON object ``{"name": str, "arguments": {...}}``
    (or ``"parameters"``, as Llama writes it; arguments as JSON text of an
    object are taken too), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not NAME.fullmatch(value["name"]):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def decode_json(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``text[at]`` and where it ends, or None
    (not JSON, or not whole yet)."""
    try:
        return _JSON.raw_decode(text, at)
    except json.JSONDecodeError:
        return None


def partial_end(text: str, *markers: str) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers``."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def text_until(text: str, at: int, marker: str, final: bool, out: list[Any]) -> tuple[int, int]:
    """Puts the text from ``at`` to the next ``marker`` in ``out``: where the
    marker starts (-1: none, and the text went in but for a tail that may
    begin it, unless ``final``) and how much of ``text`` is used."""
    start = text.find(marker, at)
    if start < 0:
        end = max(at, len(text) - (0 if final else partial_end(text[at:], marker)))
        out.append(text[at:end])
        return -1, end
    out.append(text[at:start])
    return start, start


class Blocks:
    """A scanner of text with blocks that each begin with ``marker``:
    ``read(text, start, final)`` gives the pieces of the block at ``start``
    and where it ends, or None while it cannot tell yet (``final``: it must)."""

    def __init__(self, marker: str, read: Callable[[str, int, bool], tuple[list[Piece], int] | None]) -> None:
        self._marker, self._read = marker, read

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        out: list[Piece] = []
        at = 0
        while True:
            start, used = text_until(text, at, self._marker, final, out)
            if start < 0:
                return out, used
            found = self._read(text, start, final)
            if found is None:
                return out, start
            pieces, at = found
            out += pieces
