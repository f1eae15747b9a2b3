"""The text side of an LLM package: its tokenizer, chat template and limits,
turning a prompt into token ids. Needs no model: an LLM in another process
(RemoteLLM) makes its prompts here.

A chat's follow-up turn sends the history back as text, the session's own
replies included, and encoding that text again may give other ids than the
ones the session generated (byte-level BPE merges a reply's tokens
differently): its cache would then be reused only up to there. So a chat
session remembers the text it was fed with its ids (:class:`Spelling`), and
a chat prompt whose text starts with that text, up to one of the template's
added tokens, keeps those ids for that part (:meth:`Prompts._respell`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from ._encode import PieceEncoder
from ._replies import ReplyFormat
from .._spec import read_llm_package

__all__ = ["Prompts", "Prompt", "ChatPrompt", "Spelling", "ContextLengthError"]


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages through the template (:meth:`Prompts.chat_prompt`): the
    text, its ids, and where its added tokens start (character offset ->
    index in ``ids``; empty where the tokenizer does not encode by pieces)."""

    text: str
    ids: list[int]
    starts: dict[int, int]


@dataclass(frozen=True)
class Spelling:
    """Token ids and the chat text they spell, as a chat session fed them: a
    prompt's ids, then a reply's as generated. At each mark ``(o, n)``,
    ``ids[:n]`` spell ``text[:o]`` (the ends of prompts and replies)."""

    text: str
    ids: tuple[int, ...]
    marks: tuple[tuple[int, int], ...]


# A prompt: text (tokenized as is), token ids, or chat messages
# ({"role": ..., "content": ...}) put through the model's chat template (or
# those made into a ChatPrompt already).
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]], ChatPrompt]


class ContextLengthError(ValueError):
    """A prompt longer than the context."""


def _check_unicode(text: str, what: str) -> None:
    """Refuses text that is not valid Unicode (a lone surrogate, which JSON's
    \\ud800 escapes can make): a tokenizer cannot take it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid Unicode text: a lone surrogate at character {e.start}") from None


# What apply_chat_template itself takes: not a template's variable (chat_template_kwargs).
TEMPLATE_CALL_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                 "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                                 "tokenizer_kwargs"})


class Prompts:
    """A package's tokenizer, generation config and limits, and how its
    chat prompts are made and its replies read.

    ``chat_template``: a Jinja chat template used instead of the package's
    (checked here: a template that cannot render a user's message is a
    ValueError). ``tool_parser`` / ``reasoning_parser``: the format of the
    replies' tool calls and reasoning, by name (``"none"``: not read), else
    read from the template (llm/runtime/_replies.py).
    """

    def __init__(self, package: str | os.PathLike[str], *, chat_template: str | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        read = read_llm_package(package)
        self.spec = read.spec
        self.generation_config: dict[str, Any] = dict(read.generation_config)
        self.tokenizer = read.load_tokenizer()
        # What another process's Prompts of this package is given to make prompts and read replies the same.
        self.prompt_options: dict[str, Any] = {k: v for k, v in (
            ("chat_template", chat_template), ("tool_parser", tool_parser),
            ("reasoning_parser", reasoning_parser)) if v is not None}
        if chat_template is not None:
            self._use_template(chat_template)
        added = self.tokenizer.added_tokens_decoder
        self.reply_format = ReplyFormat(getattr(self.tokenizer, "chat_template", None),
                                        {t.content: int(i) for i, t in added.items()},
                                        [t.content for t in added.values() if t.special], tool_parser,
                                        reasoning_parser, self.tokenizer.get_vocab)
        # Encodes a turn's new messages only (_encode.py), where that gives the same ids.
        self._pieces = PieceEncoder(self.tokenizer)
        # The most characters one token stands for (its vocabulary's longest
        # piece; a byte-level piece has a character a byte, which a text
        # character is at least): text longer than the context's tokens
        # times this cannot fit, known before anything is tokenized.
        self._piece_chars = max(1, max((len(p) for p in self.tokenizer.get_vocab()), default=1))

    @property
    def name(self) -> str:
        """The model's id, as exported."""
        return self.spec.name

    @property
    def max_context(self) -> int:
        """Tokens a session holds: prompt and completion together."""
        return self.spec.max_cache_len

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids (with the tokenizer's special tokens, as HF does)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        _check_unicode(text, "the text")
        return [int(t) for t in self.tokenizer.encode(text)]

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """``messages`` through the chat template, ending with the prompt for
        the assistant's reply."""
        return self.chat_prompt(messages).ids

    def _use_template(self, template: str) -> None:
        if not isinstance(template, str) or not template.strip():
            raise ValueError("chat_template must be a Jinja template's text")
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template,
                                               tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2's syntax and template errors
            raise ValueError(f"chat_template: cannot render a user's message: {type(e).__name__}: {e}") from None
        self.tokenizer.chat_template = template

    @property
    def tool_format(self) -> str | None:
        """The name of the tool-call format of the model's replies (``hermes``,
        ``llama3_json``, ``mistral``, ``harmony``), or None where its chat
        template renders no tools this runtime reads (llm/runtime/_replies.py)."""
        tools = self.reply_format.tools
        return tools.name if tools is not None else None

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> ChatPrompt:
        """``messages`` through the chat template (with ``tools``, OpenAI's
        function definitions, where given: the model's template renders
        them; ``template_kwargs``: more of the template's variables, as
        ``enable_thinking`` or ``reasoning_effort``): the text, its ids (as
        :meth:`chat_tokens`) and where its added tokens start. A message's
        content may be None where it has ``tool_calls``."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(messages):
            calls = m.get("tool_calls") if isinstance(m, Mapping) else None
            content = m.get("content") if isinstance(m, Mapping) else None
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                    or not (isinstance(content, str) or (content is None and calls)):
                raise ValueError(f"messages[{i}] must have a string 'role' and a string 'content'")
            if calls is not None and not isinstance(calls, list):
                raise ValueError(f"messages[{i}]['tool_calls'] must be a list")
            if content is not None:
                _check_unicode(content, f"messages[{i}]['content']")
            _check_unicode(m["role"], f"messages[{i}]['role']")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name} has no chat template; send a text prompt instead")
        if tools and self.tool_format is None:
            raise ValueError(f"the chat template of {self.name} renders no tools in a format this runtime reads "
                             "(hermes, llama3_json, mistral, harmony)")
        extra = dict(template_kwargs or {})
        if not all(isinstance(k, str) for k in extra):
            raise ValueError("template_kwargs: its keys must be strings")
        reserved = sorted(TEMPLATE_CALL_ARGS.intersection(extra))
        if reserved:
            raise ValueError(f"template_kwargs: {', '.join(reserved)}: the template's caller's own arguments, "
                             "not its variables")
        try:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                      add_generation_prompt=True, **extra,
                                                      **({"tools": [dict(t) for t in tools]} if tools else {}))
        except Exception as e:  # the template's own refusals (jinja2's TemplateError)
            # (and what its code raises on variables it was not written for: template_kwargs are the caller's)
            if type(e).__module__.split(".")[0] != "jinja2" and not (extra and isinstance(e, (TypeError, ValueError,
                                                                                               KeyError, AttributeError))):
                raise
            raise ValueError(f"the chat template of {self.name} refused the messages: {type(e).__name__}: {e}") from e
        # As apply_chat_template(tokenize=True) encodes it (the template wrote the special tokens).
        starts: dict[int, int] = {}
        ids = self._pieces.encode(text, starts)
        return ChatPrompt(text, ids, starts)

    def _check_tokens(self, count: int) -> None:
        """Refuses a prompt of ``count`` tokens that the context cannot hold."""
        if count > self.max_context:
            raise ContextLengthError(f"the prompt has {count} tokens; the context holds {self.max_context}")

    def _check_length(self, chars: int) -> None:
        """Refuses, before tokenizing, text of ``chars`` characters that
        makes more tokens than the context holds whatever they are."""
        if chars > self.max_context * self._piece_chars:
            raise ContextLengthError(f"the prompt has {chars} characters: at least {-(-chars // self._piece_chars)} "
                                     f"tokens (one token stands for {self._piece_chars} at most); the context "
                                     f"holds {self.max_context}")

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages."""
        prepared = self.prepare(prompt)
        return prepared.ids if isinstance(prepared, ChatPrompt) else prepared

    def prepare(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> list[int] | ChatPrompt:
        """A prompt made ready for a chat session: chat messages as a
        :class:`ChatPrompt` (with ``tools`` and ``template_kwargs`` rendered
        by the chat template: a session keeps its own ids for the part of
        its text that it fed: :meth:`_respell`), anything else as token ids;
        checked as :meth:`prompt_ids` checks them."""
        chat = None
        if isinstance(prompt, ChatPrompt):
            chat = prompt
            if not isinstance(chat.text, str) or not isinstance(chat.starts, dict):
                raise TypeError("a ChatPrompt holds the prompt's text and its added tokens' starts")
            self._check_ids(chat.ids)
            ids = chat.ids
        elif isinstance(prompt, str):
            self._check_length(len(prompt))
            ids = self.encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            contents = (m.get("content") for m in prompt if isinstance(m, Mapping))
            self._check_length(sum(len(c) for c in contents if isinstance(c, str)))
            chat = self.chat_prompt(prompt, tools, template_kwargs)  # type: ignore[arg-type]
            ids = chat.ids
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = list(prompt)  # type: ignore[arg-type]
            self._check_ids(ids)
        else:
            raise TypeError(f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}")
        if (tools or template_kwargs) and chat is None:
            raise ValueError("tools go with chat messages, not a text prompt or token ids; so do template_kwargs")
        if not ids:
            raise ValueError("the prompt is empty")
        self._check_tokens(len(ids))
        return chat if chat is not None else ids

    def _check_ids(self, ids: Sequence[Any]) -> None:
        self._check_tokens(len(ids))  # (before each id is checked)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.spec.vocab_size:
                raise ValueError(f"token ids must be ints in [0, {self.spec.vocab_size}), got {t!r}")

    def _respell(self, spelling: Spelling | None, prompt: ChatPrompt) -> tuple[list[int], Spelling]:
        """The ids to feed for ``prompt`` on a session that fed ``spelling``,
        and the spelling of those: where the prompt's text starts with the
        spelling's up to one of its marks, and an added token of the prompt
        starts there, the spelling's ids to there and the prompt's from there
        on (the ids of the rest of the text alone, as the tokenizer splits
        its input at added tokens): the text's own parts' ids, end to end,
        so a valid encoding of it. Else the prompt's ids."""
        ids = prompt.ids
        kept: tuple[tuple[int, int], ...] = ()
        if spelling is not None and prompt.starts:
            same = _common_start(prompt.text, spelling.text)
            for chars, count in reversed(spelling.marks):
                at = prompt.starts.get(chars)
                if chars <= same and at is not None:
                    respelled = [*spelling.ids[:count], *prompt.ids[at:]]
                    if len(respelled) <= self.max_context:
                        ids = respelled
                        kept = tuple(m for m in spelling.marks if m[0] <= chars)
                    break
        return ids, Spelling(prompt.text, tuple(ids), (*kept, (len(prompt.text), len(ids))))

    def _with_reply(self, spelling: Spelling, reply: Sequence[int], text: str) -> Spelling:
        """``spelling`` (a prompt's) and the reply generated after it: its
        ids and ``text``, its text as handed out, where they spell it there:
        the ids decode to it after the prompt's last token, whole characters
        (no U+FFFD, which a character's bytes split over ids decode to)
        with no special token left out."""
        if not reply or not text or not spelling.ids or "\ufffd" in text:
            return spelling
        last = [spelling.ids[-1]]
        if self._decode([*last, *reply]) != self._decode(last) + text:
            return spelling
        ids = (*spelling.ids, *reply)
        whole = spelling.text + text
        return Spelling(whole, ids, (*spelling.marks, (len(whole), len(ids))))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _common_start(a: str, b: str) -> int:
    """The length of the longest common start of ``a`` and ``b`` (compared
    in halves, each compare a C loop)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low], a[:high] != b[:high]
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low
