"""Reasoning: the part of a reply a model thinks in before it answers, read
apart from the answer (:class:`ReasoningFormat`, one class per family's
format; GPT-OSS's analysis channel is in _harmony.py), and the grammar
that lets a reply reason before the part a constraint holds (the answer, or
the tool calls: the constraint starts where the reasoning ends, as vLLM
applies it).

``think`` (Qwen3, DeepSeek-R1 and the models distilled from it, QwQ): the
reasoning is ``<think>...</think>`` at the reply's start. Where the prompt
already opened ``<think>`` (templates whose generation prompt does, as
DeepSeek-R1's and Qwen3's thinking-only models'), the reply starts inside
it; where the prompt ends closing it (Qwen3's ``enable_thinking=False``
renders an empty ``<think></think>``), the reply is all answer. Reasoning
never closed is reasoning to the reply's end; a ``<think>`` after the
reply's start is text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

from ._tools import Markup, partial_end

__all__ = ["Reasoning", "ReasoningFormat", "ReasoningScanner", "Think"]


@dataclass(frozen=True)
class Reasoning:
    """A piece of a reply's reasoning."""

    text: str


Split = Union[str, Reasoning]  # the answer's text, or reasoning


class ReasoningScanner(Protocol):
    """A reader of one reply, as tool-call scanners are (_tools.Scanner):
    the answer's text as str, the reasoning as :class:`Reasoning`."""

    def scan(self, text: str, final: bool) -> tuple[list[Split], int]: ...


class ReasoningFormat(Markup):
    """A family's reasoning format."""

    def scanner(self, prompt: str) -> ReasoningScanner:
        """A reader of the reply to ``prompt`` (its text: whether it opened the reasoning)."""
        raise NotImplementedError

    def before(self, prompt: str, calls: bool = False) -> str:
        """A Lark grammar (llguidance's) of the reply to ``prompt``: its
        reasoning, then ``@body`` (the grammar that holds the rest: the
        answer, or where ``calls``, tool calls)."""
        raise NotImplementedError


class Think(ReasoningFormat):
    """``<think>...</think>`` at the reply's start (module docstring)."""

    name = "think"
    OPEN, CLOSE = "<think>", "</think>"

    @classmethod
    def detect(cls, template: str) -> bool:
        return cls.CLOSE in template

    def state(self, prompt: str) -> str:
        """Where the reply to ``prompt`` starts: ``"inside"`` reasoning the
        prompt opened, ``"answer"`` (the prompt ends closing it), or
        ``"start"`` (it may open it)."""
        if prompt.rfind(self.OPEN) > prompt.rfind(self.CLOSE):
            return "inside"
        return "answer" if prompt.rstrip().endswith(self.CLOSE) else "start"

    def scanner(self, prompt: str) -> ReasoningScanner:
        return _ThinkScanner(self.state(prompt))

    def before(self, prompt: str, calls: bool = False) -> str:
        close = self.marker(self.CLOSE)
        # Reasoning is any text without the closing marker's spelling (which would end it too, read as text).
        rules = (f"REASONING: /(?s:.*)/ & ~/(?s:.*){_escaped(self.CLOSE)}(?s:.*)/\n"
                 'BLANK: /[ \\t\\r\\n]*/\n')
        state = self.state(prompt)
        if state == "inside":
            return f"start: REASONING {close} BLANK @body\n{rules}"
        if state == "answer":
            return f"start: BLANK @body\n{rules}"
        return f"start: BLANK (think BLANK)? @body\nthink: {self.marker(self.OPEN)} REASONING {close}\n{rules}"


def _escaped(text: str) -> str:
    """``text`` in a Lark regex literal (Rust's syntax: its metacharacters, and the literal's ``/``)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


class _ThinkScanner:
    def __init__(self, state: str) -> None:
        self._mode = "blank" if state == "answer" else state  # then "blank" and "answer"

    def scan(self, text: str, final: bool) -> tuple[list[Split], int]:
        out: list[Split] = []
        at = 0
        if self._mode == "start":
            head = text.lstrip()
            if not final and Think.OPEN.startswith(head):  # (blanks only, or the marker's start)
                return out, 0
            if not head.startswith(Think.OPEN):
                self._mode = "answer"
            else:
                self._mode, at = "inside", len(text) - len(head) + len(Think.OPEN)
        if self._mode == "inside":
            end = text.find(Think.CLOSE, at)
            if end < 0:
                cut = len(text) - (0 if final else partial_end(text[at:], Think.CLOSE))
                out.append(Reasoning(text[at:cut]))
                return out, max(cut, at)
            out.append(Reasoning(text[at:end]))
            self._mode, at = "blank", end + len(Think.CLOSE)
        if self._mode == "blank":  # the blanks between the reasoning and the answer are neither
            head = text[at:].lstrip()
            if not head and not final:
                return out, len(text)
            self._mode, at = "answer", len(text) - len(head)
        out.append(text[at:])
        return out, len(text)
