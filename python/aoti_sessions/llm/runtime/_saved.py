"""A saved chat's tokens: the JSON document a chat session's file carries
as its attachment (Session.save): the tokens its cache holds and, under
"chat", the text its last chat turn fed and its ids (Spelling); and the file
beside it where chats saved before attachments kept their tokens."""

from __future__ import annotations

import json
import os
import stat
from typing import Any, TypeGuard

from ...errors import SessionFileError
from ._prompts import Spelling

# (Sessions saved before attachments kept the tokens in a file beside it,
# PATH + LEGACY_HISTORY_SUFFIX: still read.)
TOKENS_FORMAT = "aoti_sessions.llm.tokens"
LEGACY_HISTORY_SUFFIX = ".tokens.json"
MAX_LEGACY_HISTORY = 16 << 20  # bytes of such a file read at most
MAX_ATTACHMENT = 16 << 20  # bytes a session file's attachment holds (the core's kMaxAttachment)


def _read_legacy_history(where: str) -> object:
    """The token list of a chat saved before tokens went inside the session
    file (PATH + LEGACY_HISTORY_SUFFIX), read only from a regular file."""
    history = where + LEGACY_HISTORY_SUFFIX
    try:
        fd = os.open(history, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SessionFileError(f"{where}: a session file without a chat's tokens (saved by Session.save, not "
                               "ChatSession.save)") from None
    except OSError as e:
        raise SessionFileError(f"{history}: unreadable token history ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SessionFileError(f"{history}: not a regular file, so not a token history")
        data = f.read(MAX_LEGACY_HISTORY + 1)
    try:
        return json.loads(data) if len(data) <= MAX_LEGACY_HISTORY else None
    except ValueError:
        return None


def saved_tokens(where: str, attachment: bytes, vocab_size: int, max_context: int
                 ) -> tuple[list[int], Spelling | None]:
    """The token list a saved chat's attachment holds (or, saved before
    there were attachments, the file beside it), and its spelling."""
    chat = None
    if attachment:
        try:
            doc = json.loads(attachment)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("format") != TOKENS_FORMAT or doc.get("version") != 1:
            raise SessionFileError(f"{where}: its attachment is not a chat's tokens (not saved by "
                                   "ChatSession.save)")
        tokens, chat = doc.get("tokens"), doc.get("chat")
    else:
        tokens = _read_legacy_history(where)
    if not _token_list(tokens, max_context, vocab_size):
        raise SessionFileError(f"{where}: not a token history of this model")
    spelling = None
    if chat is not None:  # (its ids: the first `shared` of the tokens', then its own)
        text, shared, ids, marks = (chat.get(k) for k in ("text", "shared", "ids", "marks")) \
            if isinstance(chat, dict) else [None] * 4
        # (A reply's last id may be one the cache never took: at the context's end.)
        if not isinstance(text, str) or type(shared) is not int or not 0 <= shared <= len(tokens) \
                or not _token_list(ids, max_context + 1 - shared, vocab_size) or not isinstance(marks, list) \
                or not all(isinstance(m, list) and len(m) == 2 and all(type(v) is int for v in m)
                           and 0 <= m[0] <= len(text) and 0 <= m[1] <= shared + len(ids) for m in marks):
            raise SessionFileError(f"{where}: not a chat's text and tokens of this model")
        spelling = Spelling(text, (*tokens[:shared], *ids), tuple((m[0], m[1]) for m in marks))
    return tokens, spelling


def _token_list(tokens: object, most: int, vocab_size: int) -> TypeGuard[list[int]]:
    return isinstance(tokens, list) and len(tokens) <= most and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens)


def chat_attachment(tokens: list[int], spelling: Spelling | None) -> bytes:
    """The attachment of a chat holding ``tokens`` whose last turn fed ``spelling``."""
    doc: dict[str, Any] = {"format": TOKENS_FORMAT, "version": 1, "tokens": tokens}
    if spelling is not None:
        ids = list(spelling.ids)
        shared = min(len(ids), len(tokens))  # (most often all of one or the other)
        shared = shared if ids[:shared] == tokens[:shared] else 0
        doc["chat"] = {"text": spelling.text, "shared": shared, "ids": ids[shared:], "marks": spelling.marks}
    data = json.dumps(doc, separators=(",", ":")).encode()
    if len(data) > MAX_ATTACHMENT and doc.pop("chat", None) is not None:
        data = json.dumps(doc, separators=(",", ":")).encode()  # (a next turn encodes its text again)
    return data
