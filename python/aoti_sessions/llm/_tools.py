"""Tool calls: the tools a request offers go to the model's own chat
template (``Prompts.chat_prompt(messages, tools=...)``); the calls in its
reply are parsed out of the text in the format its template teaches it
(:func:`tool_format`), as the reply streams or at its end; and
:func:`tool_call_constraint` holds a reply to calls of the offered tools (a
grammar: ``tool_choice`` "required" or a named function), so that even a
random-weight model's reply is a call whose arguments fit their schema.

Formats: ``hermes`` (Qwen2.5 / Qwen3, Hermes, and the templates that copy
them): each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from ._grammar import Constraint

__all__ = ["ToolCall", "ToolCallStream", "parse_tool_calls", "tool_call_constraint", "tool_format", "HERMES"]

HERMES = "hermes"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches, or None (it renders no
    tools this module can parse)."""
    if chat_template and _OPEN in chat_template and "tools" in chat_template:
        return HERMES
    return None


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


Piece = Union[str, ToolCall]


class ToolCallStream:
    """A reply's text as it streams, split into text and calls: :meth:`push`
    each piece, then :meth:`finish`. Text that may begin a call is held
    until it does or cannot; a call's block is held until it closes. A block
    that is not a call (its JSON is not ``{"name": str, "arguments": {...}}``)
    or never closes is text, as written."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.calls = 0

    def push(self, piece: str) -> list[Piece]:
        self._held += piece
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._held.find(_CLOSE)
                if end < 0:
                    return out
                block, self._held = self._held[:end + len(_CLOSE)], self._held[end + len(_CLOSE):]
                self._in_call = False
                call = _call_of(block[len(_OPEN):-len(_CLOSE)])
                if call is not None:
                    self.calls += 1
                out.append(call if call is not None else block)
                continue
            start = self._held.find(_OPEN)
            if start >= 0:
                if start:
                    out.append(self._held[:start])
                self._held, self._in_call = self._held[start:], True
                continue
            keep = _partial_open(self._held)
            text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            if text:
                out.append(text)
            return out

    def finish(self) -> list[Piece]:
        """What is still held, as text."""
        held, self._held, self._in_call = self._held, "", False
        return [held] if held else []


def _partial_open(text: str) -> int:
    """The length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0


def _call_of(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply's text outside its calls, and its calls."""
    stream = ToolCallStream()
    pieces = [*stream.push(text), *stream.finish()]
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], name: str | None = None,
                         parallel: bool = True) -> Constraint:
    """A reply that is calls of ``tools`` (OpenAI's ``{"type": "function",
    "function": {"name", "parameters"}}``) and nothing else: of the one
    called ``name`` if given, one call or (``parallel``) one or more, each
    call's arguments valid against its function's ``parameters``."""
    schemas = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        schemas.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not schemas:
        raise ValueError(f"no tool named {name!r}" if name is not None else "no tools to call")
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    calls = 'call ("\\n" call)*' if parallel else "call"
    grammar = (f'start: {calls}\ncall: "{_OPEN}\\n" body "\\n{_CLOSE}"\n'
               f"body: %json {json.dumps(schema)}")
    return Constraint.lark(grammar)
