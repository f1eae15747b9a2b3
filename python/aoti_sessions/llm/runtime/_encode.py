"""Chat prompts to token ids without tokenizing the whole conversation again
each turn.

A chat template writes the conversation with the tokenizer's added tokens
(``<|im_start|>``, ``<|im_end|>``, ...) between the messages, and a fast
tokenizer first splits its input at those tokens, then encodes each piece
between them on its own (normalizer, pre-tokenizer, model). So the ids of a
prompt are the ids of its pieces, end to end, and a piece seen in an earlier
turn (every earlier message) needs no encoding: :class:`PieceEncoder` keeps
them. A follow-up turn then encodes only its new messages; the whole prompt
cost ~0.8 ms of the server's GIL a request at 8 turns.

Used only where that holds exactly: a fast tokenizer whose added tokens match
the raw text as written (no ``lstrip``/``rstrip``/``single_word``; not
``normalized`` unless there is no normalizer), that does not encode special
tokens as text (``split_special_tokens``), and whose pre-tokenizer does not
depend on where a piece starts in the whole input (``Metaspace`` with
``prepend_scheme="first"`` does). The first prompts are also encoded whole and
compared; a difference turns the cache off for good (logged).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

log = logging.getLogger("aoti_sessions.llm")

CHECKED_PROMPTS = 8           # prompts also encoded whole, to compare
MAX_CACHED_CHARS = 8_000_000  # characters of cached pieces at most (then the cache starts over)
MAX_PIECE_CHARS = 100_000     # longer pieces are encoded every time


class PieceEncoder:
    """Encodes text (``add_special_tokens=False``) piece by piece between
    added tokens, with the pieces' ids cached, where :func:`by_pieces` holds
    for ``tokenizer`` (``by_pieces`` forces it either way); whole otherwise."""

    def __init__(self, tokenizer: Any, by_pieces: bool | None = None) -> None:
        self._tokenizer = tokenizer
        self.enabled = pieces_match_whole(tokenizer) if by_pieces is None else by_pieces
        self._lock = threading.Lock()
        self._cache: dict[str, list[int]] = {}
        self._chars = 0
        self._to_check = CHECKED_PROMPTS
        if self.enabled:
            self._backend = tokenizer.backend_tokenizer
            self._added = {t.content: int(i) for i, t in self._backend.get_added_tokens_decoder().items()}
            # Longest first: at the leftmost match the longest token wins, as the tokenizer's own split does.
            alternatives = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
            self._split = re.compile(f"({alternatives})" if alternatives else "(?!)")

    def _encode_whole(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=False)]

    def encode(self, text: str, starts: dict[int, int] | None = None) -> list[int]:
        """The ids of ``text``; where encoded by pieces, ``starts`` gets the
        character offset of each added token in it and that token's index:
        the ids from there on are those of the text from there on, alone."""
        if not self.enabled:
            return self._encode_whole(text)
        out: list[int] = []
        at = 0
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token
                if starts is not None:
                    starts[at] = len(out)
                out.append(self._added[piece])
            elif piece:
                out += self._piece(piece)
            at += len(piece)
        if self._to_check > 0:
            self._to_check -= 1
            whole = self._encode_whole(text)
            if whole != out:
                self.enabled = False
                log.warning("the tokenizer encodes a prompt differently by pieces between its added tokens than "
                            "whole; prompts are encoded whole from now on (slower)")
                if starts is not None:
                    starts.clear()
                return whole
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            return ids
        ids = [int(t) for t in self._backend.encode(piece, add_special_tokens=False).ids]
        if len(piece) <= MAX_PIECE_CHARS:
            with self._lock:
                if self._chars + len(piece) > MAX_CACHED_CHARS:
                    self._cache.clear()
                    self._chars = 0
                self._cache[piece] = ids
                self._chars += len(piece)
        return ids


def pieces_match_whole(tokenizer: Any) -> bool:
    """Whether encoding by pieces between added tokens gives ``tokenizer``'s
    ids of the whole text (see the module's docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return False
    try:
        added = backend.get_added_tokens_decoder()
        config = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a backend without these: encode whole
        return False
    normalizer = backend.normalizer is not None
    if any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizer) for t in added.values()):
        return False
    return not (_starts_matter(config.get("pre_tokenizer")) or _starts_matter(config.get("normalizer")))


def _starts_matter(component: Any) -> bool:
    """Whether a normalizer or pre-tokenizer config (nested in Sequences)
    treats the start of the whole input differently from a piece's start."""
    if isinstance(component, list):
        return any(_starts_matter(c) for c in component)
    if not isinstance(component, dict):
        return False
    if component.get("type") == "Metaspace" and component.get("prepend_scheme", "always") == "first":
        return True
    return any(_starts_matter(v) for k, v in component.items() if k in ("pretokenizers", "normalizers"))
