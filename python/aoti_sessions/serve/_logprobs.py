"""Logprobs in OpenAI's shapes, from a generation's (llm/runtime/_logprobs.py):
chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and
completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

A token's ``bytes`` are its own (llguidance's tokenizer view: a byte-level
token that holds part of a character has the bytes of that part), its
``token`` their text (a partial character as U+FFFD). A completion's
``text_offset`` counts each token's text from the start of the completion.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._model import ServedLLM
    from ..llm.interface import TokenLogprob

__all__ = ["TokenTexts", "token_texts", "chat_logprobs", "completion_logprobs"]

_made: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class TokenTexts:
    """Each token id's text and bytes (made once each)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self._view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._known: dict[int, tuple[str, list[int]]] = {}

    def of(self, token: int) -> tuple[str, list[int]]:
        known = self._known.get(token)
        if known is None:
            raw = bytes(self._view.decode_bytes([token]))
            known = self._known[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return known


def token_texts(llm: ServedLLM) -> TokenTexts:
    """``llm``'s TokenTexts (its tokenizer's view made at the first call:
    about a second for a large vocabulary; call it in a worker thread)."""
    with _lock:
        texts = _made.get(llm)
        if texts is None:
            texts = _made[llm] = TokenTexts(llm.tokenizer, llm.spec.vocab_size)
        return texts


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``."""
    content = []
    for entry in logprobs:
        text, raw = texts.of(entry.token)
        top = []
        for token, logprob in entry.top:
            other, other_raw = texts.of(token)
            top.append({"token": other, "logprob": logprob, "bytes": other_raw})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob], offset: int) -> tuple[dict[str, Any],
                                                                                                     int]:
    """A completion choice's (or chunk's) ``logprobs``, its tokens' text
    counted from ``offset``; and the offset after them. Each step's top
    tokens (by their text, as OpenAI's) include the sampled one."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in logprobs:
        text, _ = texts.of(entry.token)
        top = {texts.of(token)[0]: logprob for token, logprob in entry.top}
        top.setdefault(text, entry.logprob)
        tokens.append(text)
        values.append(entry.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
