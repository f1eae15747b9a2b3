"""GPT-OSS's harmony format, read with OpenAI's ``openai-harmony`` package:
a reply is messages on channels: ``analysis`` (the reasoning),
``commentary`` (a call, addressed ``to=functions.NAME``, its arguments JSON;
or a preamble to the user) and ``final`` (the answer), each
``<|channel|>NAME<|message|>...<|end|>`` and the next after
``<|start|>assistant``; a call ends the reply (``<|call|>``, a stop token).

The reply's text (its special tokens kept) is encoded again with harmony's
own tokenizer and fed to its streaming parser, token by token: the text of
an analysis message is reasoning, of final and preamble messages the
answer; a call comes out once its message ends. A tail of the text that
may begin a special token is held until it does or cannot (encoded alone,
half a ``<|end|>`` would be text). Where the parser refuses the reply (a
random model's text need not be harmony), what it has not given out, and
everything after, is the answer's text, as written.

openai-harmony loads its vocabulary, o200k_base.tiktoken, on first use:
from the folder named by ``TIKTOKEN_ENCODINGS_BASE``, else from the
internet, once (cached in ``TIKTOKEN_RS_CACHE_DIR``, the file named by the
SHA-1 of its URL); either way its SHA-256 is checked, so only the real file
will do. GPT-OSS's own tokenizer holds that vocabulary (its first 199,998
tokens, byte-level): where ``TIKTOKEN_ENCODINGS_BASE`` is not set and the
model's tokenizer spells the file exactly (the same SHA-256), it is written
from there (into aoti_sessions' cache folder) and harmony pointed at it, so
a GPT-OSS package serves offline.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._reasoning import Reasoning, ReasoningFormat
from ._tools import NAME, ToolCall, ToolFormat, json_rule, parameters, partial_end

__all__ = ["Harmony", "HarmonyReasoning", "encoding", "vocabulary_file"]

SPECIAL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_FUNCTIONS = "functions."
VOCABULARY = "o200k_base.tiktoken"
VOCABULARY_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # (as harmony checks it)
VOCABULARY_TOKENS = 199_998  # (harmony's special tokens follow them)

_lock = threading.Lock()
_encoding: Any = None


def _harmony() -> Any:
    try:
        return importlib.import_module("openai_harmony")
    except ImportError as e:  # pragma: no cover - a dependency of the llm and serve extras
        raise ImportError("GPT-OSS's harmony format needs openai-harmony: pip install 'aoti-sessions[llm]'") from e


def encoding(vocabulary: Callable[[], Mapping[str, int]] | None = None) -> Any:
    """harmony's GPT-OSS encoding, loaded once; ``vocabulary``: the model's
    tokenizer's (text -> id), which may hold harmony's (module docstring)."""
    global _encoding
    with _lock:
        if _encoding is None:
            harmony = _harmony()
            if vocabulary is not None and not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
                from ..._extraction import cache_dir

                written = vocabulary_file(vocabulary(), cache_dir() / "harmony")
                if written is not None:
                    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(written.parent)
            try:
                _encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
            except harmony.HarmonyError as e:
                raise RuntimeError(f"openai-harmony could not load its vocabulary (o200k_base.tiktoken): {e}; "
                                   "offline, set TIKTOKEN_ENCODINGS_BASE to a folder holding that file") from e
        return _encoding


def vocabulary_file(vocabulary: Mapping[str, int], folder: Path) -> Path | None:
    """``folder``/o200k_base.tiktoken written from a byte-level BPE
    ``vocabulary`` (text -> id) where it is that file's vocabulary (the same
    SHA-256), else None."""
    target = folder / VOCABULARY
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == VOCABULARY_SHA256:
        return target
    if len(vocabulary) < VOCABULARY_TOKENS:
        return None
    byte_level = importlib.import_module("transformers.convert_slow_tokenizer").bytes_to_unicode()
    byte_of = {c: b for b, c in byte_level.items()}
    ranked = sorted((i, text) for text, i in vocabulary.items() if i < VOCABULARY_TOKENS)
    try:
        data = b"".join(base64.b64encode(bytes(byte_of[c] for c in text)) + b" %d\n" % i for i, text in ranked)
    except KeyError:  # not a byte-level vocabulary
        return None
    if len(ranked) != VOCABULARY_TOKENS or hashlib.sha256(data).hexdigest() != VOCABULARY_SHA256:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{VOCABULARY}.{os.getpid()}"
    staging.write_bytes(data)
    os.replace(staging, target)
    return target


class Harmony(ToolFormat):
    """Calls on the commentary channel (module docstring)."""

    name = "harmony"
    markers = SPECIAL

    @classmethod
    def detect(cls, template: str) -> bool:
        return "<|channel|>" in template and "<|message|>" in template

    def scanner(self) -> Any:
        return HarmonyScanner(tools=True, vocabulary=self.vocabulary)

    def calls_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        # One call: its <|call|> ends the reply (parallel calls are calls in turn).
        each = [f'"{t["function"]["name"]} " {self.marker("<|constrain|>")} "json" {self.marker("<|message|>")} '
                f"{json_rule(parameters(t['function']))}" for t in tools]
        return (f'start: {self.marker("<|channel|>")} "commentary to={_FUNCTIONS}" ({" | ".join(each)}) '
                f'{self.marker("<|call|>")}')


class HarmonyReasoning(ReasoningFormat):
    """The analysis channel (module docstring): read together with the rest by :class:`HarmonyScanner`."""

    name = "harmony"
    markers = SPECIAL
    detect = Harmony.detect

    def before(self, prompt: str, calls: bool = False) -> str:
        m = self.marker
        special = "|".join(s[2:-2] for s in SPECIAL)
        analysis = (f'analysis: {m("<|channel|>")} "analysis" {m("<|message|>")} TEXT {m("<|end|>")} '
                    f'{m("<|start|>")} "assistant"\n'
                    f"TEXT: /(?s:.*)/ & ~/(?s:.*)<\\|({special})\\|>(?s:.*)/\n")
        answer = "" if calls else f'{m("<|channel|>")} "final" {m("<|message|>")} '
        return f"start: analysis? {answer}@body\n{analysis}"


class HarmonyScanner:
    """A reply in harmony split into the answer's text, reasoning and (``tools``) calls."""

    def __init__(self, tools: bool, vocabulary: Callable[[], Mapping[str, int]] | None = None) -> None:
        harmony = _harmony()
        self._error = harmony.HarmonyError
        self._encoding = encoding(vocabulary)
        self._parser = harmony.StreamableParser(self._encoding, harmony.Role.ASSISTANT)
        self._tools = tools
        self._failed = False
        self._messages = 0  # the parser's messages given out
        self._unsaid: list[int] = []  # tokens fed since the last piece given out (said as text if it fails)

    def scan(self, text: str, final: bool) -> tuple[list[Any], int]:
        if self._failed:
            return [text], len(text)
        cut = len(text) if final else len(text) - partial_end(text, *SPECIAL)
        out: list[Any] = []
        tokens = self._encoding.encode(text[:cut], allowed_special="all")
        for i, token in enumerate(tokens):
            if not self._feed(token, out):
                out.append(self._text(self._unsaid + tokens[i:]) + text[cut:])
                return out, len(text)
        if final and not self._feed(None, out):
            out.append(self._text(self._unsaid))
        return out, cut

    def _feed(self, token: int | None, out: list[Any]) -> bool:
        """Feeds a token (None: the end); False where the parser refused it."""
        parser = self._parser
        try:
            parser.process(token) if token is not None else parser.process_eos()
        except self._error:
            self._failed = True
            return False
        if token is not None:
            self._unsaid.append(token)
        delta = parser.last_content_delta if token is not None else None
        if delta and not self._call(parser.current_recipient):
            out.append(Reasoning(delta) if parser.current_channel == "analysis" else delta)
            self._unsaid = []
        for message in parser.messages[self._messages:]:
            self._messages += 1
            self._unsaid = []
            if self._call(message.recipient):
                arguments = "".join(c.text for c in message.content if hasattr(c, "text"))
                out.append(_call(message.recipient[len(_FUNCTIONS):], arguments) or arguments)
        return True

    def _call(self, recipient: str | None) -> bool:
        return self._tools and bool(recipient) and str(recipient).startswith(_FUNCTIONS)

    def _text(self, tokens: list[int]) -> str:
        return str(self._encoding.decode(tokens)) if tokens else ""


def _call(name: str, arguments: str) -> ToolCall | None:
    name = name.strip()
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    if not NAME.fullmatch(name) or not isinstance(value, dict):
        return None
    return ToolCall(name, json.dumps(value, ensure_ascii=False))
