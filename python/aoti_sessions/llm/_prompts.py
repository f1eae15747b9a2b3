"""The text side of an LLM package: its tokenizer, chat template and limits,
turning a prompt into token ids. Needs no model: an LLM in another process
(RemoteLLM) makes its prompts here."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Union

from ._encode import PieceEncoder
from ._spec import read_llm_package

__all__ = ["Prompts", "Prompt", "ContextLengthError"]

# A prompt: text (tokenized as is), token ids, or chat messages
# ({"role": ..., "content": ...}) put through the model's chat template.
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]


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


class Prompts:
    """A package's tokenizer, generation config and limits."""

    def __init__(self, package: str | os.PathLike[str]) -> None:
        read = read_llm_package(package)
        self.spec = read.spec
        self.generation_config: dict[str, Any] = dict(read.generation_config)
        self.tokenizer = read.load_tokenizer()
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
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must have a string 'role' and a string 'content'")
            _check_unicode(m["content"], f"messages[{i}]['content']")
            _check_unicode(m["role"], f"messages[{i}]['role']")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name} has no chat template; send a text prompt instead")
        try:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # the template's own refusals (jinja2's TemplateError)
            if type(e).__module__.split(".")[0] != "jinja2":
                raise
            raise ValueError(f"the chat template of {self.name} refused the messages: {e}") from e
        # As apply_chat_template(tokenize=True) encodes it (the template wrote the special tokens).
        return self._pieces.encode(text)

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
        if isinstance(prompt, str):
            self._check_length(len(prompt))
            ids = self.encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            contents = (m.get("content") for m in prompt if isinstance(m, Mapping))
            self._check_length(sum(len(c) for c in contents if isinstance(c, str)))
            ids = self.chat_tokens(prompt)  # type: ignore[arg-type]
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            self._check_tokens(len(prompt))  # (before each id is checked)
            ids = list(prompt)  # type: ignore[arg-type]
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.spec.vocab_size:
                    raise ValueError(f"token ids must be ints in [0, {self.spec.vocab_size}), got {t!r}")
        else:
            raise TypeError(f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        self._check_tokens(len(ids))
        return ids
