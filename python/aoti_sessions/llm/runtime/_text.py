"""Generated token ids to text, a piece at a time: what is safe to show now,
and where a stop string ends the text."""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from typing import Any

# How many tokens before the newest ones are decoded again with them, so a
# character split over tokens, or a space the tokenizer merges, comes out right.
_CONTEXT_TOKENS = 6


class TextStream:
    """Decodes a growing list of token ids. ``push`` returns the text that is
    final: not the tail of a multi-byte character still being spelled, not a
    prefix of a stop string that the next tokens may complete. Special
    tokens are left out of the text, but for those in ``keep`` (a tool-call
    or reasoning format's markup: llm/runtime/_replies.py)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], keep: Collection[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._backend = _backend(tokenizer)
        self._stop = tuple(stop)
        # Kept: decoded with every special token, the others left out as they come.
        self._skip = not keep
        self._drop = special_ids(tokenizer) - frozenset(keep) if keep else frozenset()
        self._ids: list[int] = []
        self._text = ""       # decoded text of every id so far (complete characters)
        self._decoded = 0     # ids whose text is in _text
        self._shown = 0       # characters of _text already returned
        self.stopped = False  # a stop string was found; the text ends before it
        # Where the Rust tokenizer decodes directly: its incremental decoder, one
        # call a token (it holds back an unfinished character itself).
        self._stream = None
        if self._backend is not None:  # (tokenizers is there: imported here, so the CLI's demo needs no llm extra)
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._streamed = 0    # ids given to it

    @property
    def text(self) -> str:
        """Everything shown so far (after :meth:`flush`, the whole text)."""
        return self._text[:self._shown]

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self._skip))
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=self._skip,
                                          clean_up_tokenization_spaces=False))

    def push(self, token: int) -> str:
        if self._drop and token in self._drop:
            return ""  # (a special token not kept: left out, as decoding would)
        self._ids.append(token)
        if not self._catch_up(final=False):
            return ""  # a character is still being spelled: wait for the next token
        return self._release(final=False)

    def flush(self) -> str:
        """The text held back (an unfinished character, or the start of a stop
        string that never completed)."""
        self._catch_up(final=True)
        return self._release(final=True)

    def _catch_up(self, final: bool) -> bool:
        if self._decoded == len(self._ids):
            return True
        if self._stream is not None:
            while self._streamed < len(self._ids):
                piece = self._stream.step(self._backend, self._ids[self._streamed])
                self._streamed += 1
                if piece is not None:  # the text of every id so far
                    self._text += piece
                    self._decoded = self._streamed
            if self._decoded == len(self._ids):
                return True
            if not final:
                return False  # a character is still being spelled
            self._stream = None  # (an unfinished character at the end: decoded below, with its replacement)
        start = max(0, self._decoded - _CONTEXT_TOKENS)
        before = self._decode(self._ids[start:self._decoded])
        now = self._decode(self._ids[start:])
        if not final and (now.endswith("\ufffd") or not now.startswith(before)):
            return False
        self._text += now[len(before):] if now.startswith(before) else now
        self._decoded = len(self._ids)
        return True

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._text
        if not self._stop:  # (every step of most replies: nothing to look for)
            piece = text[self._shown:]
            self._shown = len(text)
            return piece
        longest = max((len(s) for s in self._stop), default=0)
        search_from = max(0, self._shown - longest)
        cut = -1
        for s in self._stop:
            at = text.find(s, search_from)
            if at >= 0 and (cut < 0 or at < cut):
                cut = at
        if cut >= 0:
            self.stopped = True
            self._text = text[:cut]
            end = cut
        elif final:
            end = len(text)
        else:
            # Hold back a tail that could begin a stop string: the earliest
            # start, among the last len(s) - 1 characters, of a suffix that
            # is a prefix of s.
            end = len(text)
            for s in self._stop:
                start = max(self._shown, len(text) - len(s) + 1)
                at = text.find(s[0], start)
                while at >= 0 and at < end:
                    if s.startswith(text[at:]):
                        end = at
                        break
                    at = text.find(s[0], at + 1)
        end = max(end, self._shown)
        piece = text[self._shown:end]
        self._shown = end
        return piece


def decoded(tokenizer: Any, ids: Sequence[int], final: bool = True, keep: Collection[int] = ()) -> str:
    """The text :class:`TextStream` makes of ``ids`` (without stop strings):
    all of it once ``final``, else without an unfinished character at the end.
    All of it from the Rust tokenizer is one call: its text is the
    incremental decoder's (tests/test_llm.py checks the two agree)."""
    backend = _backend(tokenizer) if final and not keep else None
    if backend is not None:
        return str(backend.decode(list(ids), skip_special_tokens=True))
    stream = TextStream(tokenizer, (), keep)
    for token in ids:
        stream.push(token)
    return stream.text + (stream.flush() if final else "")


def _backend(tokenizer: Any) -> Any:
    """The Rust tokenizer that ``tokenizer.decode`` (without clean-up) calls,
    where calling it directly gives the same text: a tokenizer whose class
    keeps transformers' own ``_decode`` (the wrapper costs more than the
    decoding, once or twice a token for every chat)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode:
        return tokenizer._tokenizer
    return None


_special: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens decoding leaves out with ``skip_special_tokens``
    (the special ones among the added tokens, and the named special tokens)."""
    ids = _special.get(tokenizer)
    if ids is None:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        ids = _special[tokenizer] = frozenset(int(i) for i, t in added.items() if getattr(t, "special", False)) \
            | frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()))
    return ids
