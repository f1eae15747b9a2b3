"""How a chat model's replies are read: :class:`ReplyFormat`, its tool-call
format and its reasoning format (either may be none), chosen by name or
read from its chat template; a reply's text, streamed
(:meth:`ReplyFormat.stream`) or whole (:meth:`ReplyFormat.parse`), in typed
pieces: the answer's text (``str``), :class:`Reasoning` and
:class:`ToolCall`; and the grammars that hold a reply (``tool_choice``
required or named, ``response_format``) after its reasoning.

The reasoning comes first: the calls are read in the answer after it, never
in the reasoning. A constraint holds what follows the reasoning: the reply
may reason first, then the grammar takes over (as vLLM applies structured
output to reasoning models), so a schema's JSON or a required call is the
answer, not a thought.

Formats (``--tool-call-parser``): ``hermes`` (Qwen, Hermes), ``llama3_json``,
``mistral`` (_tool_formats.py), ``harmony`` (GPT-OSS: _harmony.py; its
analysis channel is its reasoning). Reasoning (``--reasoning-parser``):
``think`` (also named ``qwen3`` and ``deepseek_r1``: _reasoning.py),
``harmony``. ``none`` turns either off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from ._grammar import Constraint
from ._harmony import Harmony, HarmonyReasoning, HarmonyScanner
from ._reasoning import Reasoning, ReasoningFormat, ReasoningScanner, Think
from ._tool_formats import Hermes, Llama3Json, Mistral
from ._tools import Piece, ToolCall, ToolFormat

__all__ = ["ReplyFormat", "ReplyStream", "Reply", "ReplyPiece", "ToolCallStream", "TOOL_FORMATS",
           "REASONING_FORMATS", "parse_tool_calls", "tool_call_constraint"]

TOOL_FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, Harmony)}
TOOL_FORMATS["openai"] = Harmony  # (vLLM's name for it)
REASONING_FORMATS: dict[str, type[ReasoningFormat]] = {"think": Think, "qwen3": Think, "deepseek_r1": Think,
                                                       "harmony": HarmonyReasoning, "openai_gptoss": HarmonyReasoning}
NONE = "none"
# Read from a template in this order (harmony's templates mention the others' markers least).
_DETECTED = (Harmony, Mistral, Hermes, Llama3Json)

ReplyPiece = Union[str, Reasoning, ToolCall]


class ToolCallStream:
    """A reply's text as it streams, split into text and calls by ``format``
    (default: Hermes): :meth:`push` each piece, then :meth:`finish`. Text
    that may begin a call is held until it does or cannot; a call is held
    until it is whole. What is not a call is text, as written. ``calls``:
    the calls found so far."""

    def __init__(self, format: ToolFormat | None = None) -> None:
        self._scanner = (format or Hermes()).scanner()
        self._held = ""
        self.calls = 0

    def push(self, piece: str) -> list[Piece]:
        self._held += piece
        return self._scan(False)

    def finish(self) -> list[Piece]:
        """What is still held: the last calls, or text."""
        return self._scan(True)

    def _scan(self, final: bool) -> list[Piece]:
        pieces, used = self._scanner.scan(self._held, final)
        self._held = self._held[used:]
        self.calls += sum(isinstance(p, ToolCall) for p in pieces)
        return [p for p in pieces if p != ""]


class ReplyStream:
    """One reply's text as it streams, in pieces: :meth:`push` each piece of
    text, then :meth:`finish`; each returns the pieces that became final:
    the answer's text (``str``), :class:`Reasoning`, :class:`ToolCall`.
    ``calls``: the calls found so far."""

    def __init__(self, reasoning: ReasoningScanner | HarmonyScanner | None, tools: ToolFormat | None) -> None:
        self._reasoning = reasoning
        self._held = ""
        self._tools = ToolCallStream(tools) if tools is not None and not isinstance(reasoning, HarmonyScanner) \
            else None
        self.calls = 0

    def push(self, text: str) -> list[ReplyPiece]:
        return self._pieces(text, False)

    def finish(self) -> list[ReplyPiece]:
        return self._pieces("", True)

    def _pieces(self, text: str, final: bool) -> list[ReplyPiece]:
        split: list[Any]
        if self._reasoning is None:
            split = [text]
        else:
            self._held += text
            split, used = self._reasoning.scan(self._held, final)
            self._held = self._held[used:]
        out: list[ReplyPiece] = []
        for piece in split:
            if isinstance(piece, str) and self._tools is not None:
                out += self._tools.push(piece)
            elif piece != "" and piece != Reasoning(""):
                out.append(piece)
        if final and self._tools is not None:
            out += self._tools.finish()
        self.calls += sum(isinstance(p, ToolCall) for p in out)
        return _merged(out)


def _merged(pieces: list[ReplyPiece]) -> list[ReplyPiece]:
    """Neighbouring pieces of one kind as one; no empty ones."""
    out: list[ReplyPiece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif isinstance(p, Reasoning) and out and isinstance(out[-1], Reasoning):
            out[-1] = Reasoning(out[-1].text + p.text)
        elif p != "" and p != Reasoning(""):
            out.append(p)
    return out


@dataclass(frozen=True)
class Reply:
    """A whole reply, read: the answer's text, the reasoning (None where it
    had none) and the calls."""

    content: str
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)


class ReplyFormat:
    """How the replies of a chat template are read: ``tools`` (a tool-call
    format, or None: it renders none this runtime reads) and ``reasoning``
    (a reasoning format, or None). ``tool_parser`` / ``reasoning_parser``: a
    format's name, or ``"none"``; None reads it from ``template``.
    ``tokens``: the tokenizer's added tokens (text -> id), ``special``: the
    ones it leaves out of decoded text unless kept (:meth:`keep`);
    ``vocabulary``: its whole vocabulary, on demand (GPT-OSS's holds
    harmony's: _harmony.py)."""

    def __init__(self, template: str | None, tokens: Mapping[str, int] | None = None,
                 special: Sequence[str] = (), tool_parser: str | None = None, reasoning_parser: str | None = None,
                 vocabulary: Callable[[], Mapping[str, int]] | None = None) -> None:
        template = template or ""
        tokens = dict(tokens or {})
        self._vocabulary = vocabulary
        self._special = frozenset(special)
        self.tools: ToolFormat | None = None
        self.reasoning: ReasoningFormat | None = None
        if tool_parser is None:
            self.tools = next((f(template, tokens, vocabulary) for f in _DETECTED if f.detect(template)), None)
        elif tool_parser != NONE:
            self.tools = _named(TOOL_FORMATS, tool_parser, "tool_parser")(template, tokens, vocabulary)
        if reasoning_parser is None:
            if isinstance(self.tools, Harmony) or HarmonyReasoning.detect(template):
                self.reasoning = HarmonyReasoning(template, tokens)
            elif Think.detect(template):
                self.reasoning = Think(template, tokens)
        elif reasoning_parser != NONE:
            self.reasoning = _named(REASONING_FORMATS, reasoning_parser, "reasoning_parser")(template, tokens)
        if isinstance(self.tools, Harmony) != isinstance(self.reasoning, HarmonyReasoning) and \
                self.tools is not None and self.reasoning is not None:
            raise ValueError("harmony reads a reply's calls and reasoning together: give both parsers as harmony")
        self._tokens = tokens

    @property
    def harmony(self) -> bool:
        return isinstance(self.tools, Harmony) or isinstance(self.reasoning, HarmonyReasoning)

    def reads(self, tools: bool) -> bool:
        """Whether a reply (to a request with ``tools``) is read at all, not only text."""
        return self.reasoning is not None or (tools and self.tools is not None)

    def keep(self, tools: bool) -> list[int]:
        """The ids of the special tokens a reply's text must keep (the formats' markup)."""
        markers = list(self.reasoning.markers if self.reasoning is not None else ())
        if tools and self.tools is not None:
            markers += self.tools.markers
        return sorted({self._tokens[m] for m in markers if m in self._special and m in self._tokens})

    def stream(self, prompt: str = "", tools: bool = True) -> ReplyStream:
        """A reader of the reply to ``prompt`` (its text), with tool calls read where ``tools``."""
        scanner: Any = None
        if self.harmony:
            scanner = HarmonyScanner(tools=tools and self.tools is not None, vocabulary=self._vocabulary)
        elif self.reasoning is not None:
            scanner = self.reasoning.scanner(prompt)
        return ReplyStream(scanner, self.tools if tools else None)

    def parse(self, text: str, prompt: str = "", tools: bool = True) -> Reply:
        """A whole reply, read as :meth:`stream` reads it."""
        stream = self.stream(prompt, tools)
        pieces = [*stream.push(text), *stream.finish()]
        thoughts = [p.text for p in pieces if isinstance(p, Reasoning)]
        return Reply("".join(p for p in pieces if isinstance(p, str)), "".join(thoughts) if thoughts else None,
                     [p for p in pieces if isinstance(p, ToolCall)])

    def tool_constraint(self, tools: Sequence[Mapping[str, Any]], name: str | None = None,
                        parallel: bool = True) -> Constraint:
        """A reply that is calls of ``tools`` (of the one called ``name``, if
        given) in this format, and nothing else (before any reasoning:
        :meth:`after_reasoning`)."""
        if self.tools is None:
            raise ValueError("the chat template renders no tools in a format this runtime reads")
        return tool_call_constraint(tools, name, parallel, self.tools)

    def after_reasoning(self, constraint: Constraint | None, prompt: str, calls: bool = False) -> Constraint | None:
        """``constraint`` held after the reply's reasoning, for the reply to
        ``prompt`` (its text); ``calls``: the constraint is tool calls'."""
        if constraint is None or self.reasoning is None:
            return constraint
        return Constraint.after(self.reasoning.before(prompt, calls), constraint)


def _named(table: Mapping[str, type[Any]], name: str, what: str) -> type[Any]:
    found = table.get(name)
    if found is None:
        raise ValueError(f"{what}: unknown format {name!r}; known: {', '.join(sorted(table))}, {NONE}")
    return found


def parse_tool_calls(text: str, format: ToolFormat | None = None) -> tuple[str, list[ToolCall]]:
    """A whole reply's text outside its calls, and its calls (``format``: default Hermes)."""
    stream = ToolCallStream(format)
    pieces = [*stream.push(text), *stream.finish()]
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], name: str | None = None, parallel: bool = True,
                         format: ToolFormat | None = None) -> Constraint:
    """A reply that is calls of ``tools`` (OpenAI's ``{"type": "function",
    "function": {"name", "parameters"}}``) in ``format`` and nothing else:
    of the one called ``name`` if given, one call or (``parallel``) one or
    more, each call's arguments valid against its function's
    ``parameters``. ``format``: the model's (``llm.reply_format.tools``,
    whose markup is its tokenizer's tokens: a model emits ``<tool_call>`` as
    one token where it has one, and a grammar of its spelling would refuse
    that); default Hermes, its markup spelled out."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}" if name is not None else "no tools to call")
    return Constraint.lark((format or Hermes()).calls_grammar(chosen, parallel))
