"""The tool-call formats of the model families that write calls as JSON in
their text (GPT-OSS's harmony format is in _harmony.py), one class each:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes and the templates that copy them): each
  call ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  anywhere in the text.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole reply is calls, JSON
  objects ``{"name": ..., "parameters": {...}}`` separated by ``;``,
  optionally after ``<|python_tag|>``; else it is text.
- ``mistral``: text, then ``[TOOL_CALLS]`` and a JSON list of ``{"name",
  "arguments"}``; or (templates of v11 and later, which write ``[ARGS]``)
  ``[TOOL_CALLS]name[ARGS]{...}`` for each call. Mistral's templates take
  back only call ids of nine letters and digits, so its calls get those.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any

from ._tools import (NAME, Blocks, Piece, Scanner, ToolCall, ToolFormat, any_of, call_of, decode_json, function_schemas,
                     json_rule, parameters)

__all__ = ["Hermes", "Llama3Json", "Mistral"]


class Hermes(ToolFormat):
    """Calls in ``<tool_call>`` blocks; a block that is not a call (its JSON
    is not ``{"name": str, "arguments": {...}}``), or never closes, is text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    @classmethod
    def detect(cls, template: str) -> bool:
        return cls.OPEN in template and "tools" in template

    def scanner(self) -> Scanner:
        return Blocks(self.OPEN, _hermes_block)

    def calls_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {calls}\n"
                f'call: {self.marker(self.OPEN)} "\\n" body "\\n" {self.marker(self.CLOSE)}\n'
                f"body: {json_rule(any_of(function_schemas(tools)))}")


def _hermes_block(text: str, start: int, final: bool) -> tuple[list[Piece], int] | None:
    close = text.find(Hermes.CLOSE, start + len(Hermes.OPEN))
    if close < 0:  # not closed yet; at the end, never: text
        return ([text[start:]], len(text)) if final else None
    end = close + len(Hermes.CLOSE)
    body = text[start + len(Hermes.OPEN):close].strip()
    value = decode_json(body, 0)
    call = call_of(value[0]) if value is not None and value[1] == len(body) else None
    return [call if call is not None else text[start:end]], end


class Llama3Json(ToolFormat):
    """A reply that starts with ``{`` or ``<|python_tag|>`` is calls, one
    JSON object each, separated by ``;``; text after them is text, and a
    reply whose first object is not a call is text as a whole."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    @classmethod
    def detect(cls, template: str) -> bool:
        return '"parameters"' in template and "<|start_header_id|>" in template and "tools" in template

    def scanner(self) -> Scanner:
        return _Llama3Scanner()

    def calls_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        calls = 'call ("; " call)*' if parallel else "call"
        return f"start: {calls}\ncall: {json_rule(any_of(function_schemas(tools, 'parameters')))}"


class _Llama3Scanner:
    def __init__(self) -> None:
        self._mode = "start"  # then "calls" (the reply began with a call) or "text"

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        if self._mode == "start":
            head = text.lstrip()
            if not final and Llama3Json.TAG.startswith(head):  # (nothing yet but blanks, or a tag's start)
                return [], 0
            self._mode = "calls" if head.startswith(("{", Llama3Json.TAG)) else "text"
        if self._mode == "text":
            return [text], len(text)
        out: list[Piece] = []
        at = 0
        while True:
            p = _skip(text, at, " \t\r\n;")
            if text.startswith(Llama3Json.TAG, p):
                p = _skip(text, p + len(Llama3Json.TAG), " \t\r\n")
            if p == len(text) or (not final and Llama3Json.TAG.startswith(text[p:])):
                if not final:
                    return out, at
                if text[at:].strip(" \t\r\n;"):
                    out.append(text[at:])  # (a tag and nothing after it: as written)
                return out, len(text)
            value = decode_json(text, p) if text[p] == "{" else None
            call = call_of(value[0]) if value is not None else None
            if call is None and value is None and text[p] == "{" and not final:
                return out, at  # (an object not whole yet)
            if call is None:  # not a call: the rest is text, as written
                self._mode = "text"
                out.append(text[at:])
                return out, len(text)
            assert value is not None
            out.append(call)
            at = value[1]


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


class Mistral(ToolFormat):
    """Text, then ``[TOOL_CALLS]`` and calls: a JSON list, or (v11 and later)
    ``name[ARGS]{...}`` (``name[CALL_ID]id[ARGS]{...}`` taken too) after each
    ``[TOOL_CALLS]``. A ``[TOOL_CALLS]`` that no call follows is text."""

    name = "mistral"
    CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (CALLS, ARGS, CALL_ID)

    @classmethod
    def detect(cls, template: str) -> bool:
        return cls.CALLS in template

    def scanner(self) -> Scanner:
        return Blocks(self.CALLS, _mistral_block)

    def call_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def calls_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        if self.ARGS in self.template:  # v11 and later: [TOOL_CALLS]name[ARGS]{...} for each call
            calls = "call+" if parallel else "call"
            args = self.marker(self.ARGS)
            each = [f'{json.dumps(t["function"]["name"])} {args} {json_rule(parameters(t["function"]))}' for t in tools]
            return f"start: {calls}\ncall: {self.marker(self.CALLS)} ({' | '.join(each)})"
        items = 'call (", " call)*' if parallel else "call"
        return (f'start: {self.marker(self.CALLS)} "[" {items} "]"\n'
                f"call: {json_rule(any_of(function_schemas(tools)))}")


def _mistral_block(text: str, start: int, final: bool) -> tuple[list[Piece], int] | None:
    found = _mistral_calls(text, start + len(Mistral.CALLS), final)
    if found is None:  # not whole yet
        return None
    calls, end = found
    return (list(calls), end) if calls else ([Mistral.CALLS], start + len(Mistral.CALLS))  # (no call: text)


def _mistral_calls(text: str, at: int, final: bool) -> tuple[list[ToolCall], int] | None:
    """The calls after a ``[TOOL_CALLS]`` ending before ``at``, and where
    they end; ``([], at)`` for none; None where it cannot tell yet."""
    p = _skip(text, at, " \t\r\n")
    if p == len(text):
        return None if not final else ([], at)
    if text[p] == "[":
        value = decode_json(text, p)
        if value is None:
            return None if not final else ([], at)
        calls = [call_of(v) for v in value[0]] if isinstance(value[0], list) else []
        return ([c for c in calls if c is not None], value[1]) if calls and None not in calls else ([], at)
    args = text.find(Mistral.ARGS, p)
    head = text[p:args if args >= 0 else len(text)]
    name = head.split(Mistral.CALL_ID)[0].strip()
    if args < 0:  # a name may still be coming
        may_be = not final and "\n" not in head and len(head) < 200  # (a name has no line break)
        return None if may_be else ([], at)
    if not NAME.fullmatch(name):
        return [], at
    q = _skip(text, args + len(Mistral.ARGS), " \t\r\n")
    value = decode_json(text, q) if q < len(text) else None
    if value is None:
        return None if not final and (q == len(text) or text[q] == "{") else ([], at)
    call = call_of({"name": name, "arguments": value[0]})
    return ([call], value[1]) if call is not None else ([], at)
