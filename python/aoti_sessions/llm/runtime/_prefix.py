"""The prefix cache: chat sessions kept once closed, so that a new session
whose prompt starts the same way starts as a fork of one (its pages shared
copy-on-write, nothing copied) and prefills only the rest.

A session made with a namespace (``LLM.new_session(prompt, cache=NAME)``; the
server's: a tenant's, with the request's ``prompt_cache_key``) is kept here
when it is closed: its engine session, marked discardable (the engine closes
the least recently used idle one whenever it needs room, before offloading
any session or refusing a new one: Session.discardable), and the tokens its
cache holds (its last prompt and reply). An entry is found by chained hashes
of its tokens' page-sized blocks within its namespace (a block's hash covers
it and every block before it, as vLLM's block hashes do; sharing never
crosses namespaces, so a hit tells nothing of another namespace's prompts):
a lookup walks the new prompt's blocks to the longest chain some entry holds,
then extends the match token by token against that entry's tokens (which
also rules out a hash collision). The new session is a fork of the entry
truncated to the common prefix, keeping the prompt's last token to feed (its
logits pick the first new token). Entries are bounded in count and bytes
(least recently used out first); one whose tokens another holds too (a
prefix of it) is not kept twice.

State that cannot be truncated to an arbitrary position (recurrent slots, a
window's ring: ``spec.recurrent``) is shared only where that is exact: an
entry whose whole token list starts the prompt (a conversation's next turn
sent without a session id). Its checkpoints do not travel with a fork, so a
match anywhere else starts empty.

At ``max_sessions`` a fork may find no room (the entry itself held, nothing
else to close): the entry is then handed over whole (taken out of the cache)
when no other lookup is forking it, else the session starts empty, which the
engine makes room for by closing entries.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._session import Session
from ...errors import CapacityError, SessionClosedError

__all__ = ["PrefixCache", "DEFAULT_ENTRIES"]

DEFAULT_ENTRIES = 64  # sessions a prefix cache keeps at most (LLM(prefix_cache=...))
# Bytes of entries at most, where the engine has no memory_budget (with one,
# a quarter of it): without a budget the engine never needs to close them.
DEFAULT_BYTES_WITHOUT_BUDGET = 1 << 30


@dataclass(eq=False)
class _Entry:
    namespace: str
    session: Session
    tokens: tuple[int, ...]
    blocks: list[int]  # the chained hash of each full block of tokens
    bytes: int
    forking: int = 0  # lookups forking it now (it is not handed over meanwhile)
    index_keys: list[tuple[str, int]] = field(default_factory=list)


class PrefixCache:
    """An LLM's kept sessions (module docstring). Thread-safe; its calls
    never wait for a step (a fork waits only for the entry's own lock, which
    no generation holds)."""

    def __init__(self, engine: Any, recurrent: bool, max_entries: int, max_bytes: int | None) -> None:
        pool = engine.pool
        self._page = int(pool["page_size"])
        self._page_bytes = int(pool["page_bytes"])
        self._slot_bytes = int(pool["slot_bytes"])
        self._exact_only = recurrent
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[tuple[str, int], dict[int, _Entry]] = {}  # (namespace, chain hash) -> entries
        self._bytes = 0
        self.lookups = self.hits = self.tokens_reused = self.kept = self.evicted = 0

    # -- finding -----------------------------------------------------------------
    def take(self, prompt: Sequence[int], namespace: str) -> tuple[Session, list[int]] | None:
        """A new session holding the longest prefix of ``prompt`` (but its
        last token) that an entry of ``namespace`` holds, and its tokens;
        None where none holds a block of it (or no room for a fork)."""
        with self._lock:
            self.lookups += 1
            entry, length = self._match(prompt, namespace)
            if entry is None:
                return None
            entry.forking += 1
            self._entries.move_to_end(id(entry))
        try:
            session = self._fork(entry)
        finally:
            with self._lock:
                entry.forking -= 1
        if session is None:
            with self._lock:
                self._prune()
            return None
        if length < len(entry.tokens):
            try:
                session.truncate(length)
            except BaseException:
                session.close()
                raise
        with self._lock:
            self.hits += 1
            self.tokens_reused += length
        return session, list(entry.tokens[:length])

    def _fork(self, entry: _Entry) -> Session | None:
        """A fork of ``entry`` (its lookup counted in ``forking``); where there
        is no room for one (the entry itself held, nothing else the engine
        may close or offload), the entry itself, taken out of the cache, if
        no other lookup forks it; None where it is gone."""
        try:
            return entry.session.fork()
        except SessionClosedError:  # the engine closed it meanwhile to make room
            return None
        except CapacityError:
            with self._lock:
                mine = entry.forking == 1 and self._entries.get(id(entry)) is entry
                if mine:
                    self._remove(entry)
        if not mine:
            return None
        try:
            entry.session.discardable = False
        except SessionClosedError:
            return None
        return entry.session

    def _match(self, prompt: Sequence[int], namespace: str) -> tuple[_Entry | None, int]:
        """(Locked) The entry sharing the longest usable prefix with
        ``prompt`` and that prefix's length."""
        usable = len(prompt) - 1  # (the prompt's last token is always fed)
        page = self._page
        buckets: list[dict[int, _Entry]] = []
        chain = 0
        for start in range(0, usable - page + 1, page):
            chain = hash((chain, *prompt[start:start + page]))
            bucket = self._index.get((namespace, chain))
            if not bucket:
                break
            buckets.append(bucket)
        best: _Entry | None = None
        best_length = 0
        if self._exact_only:  # an entry wholly a prefix of the prompt's (deepest first)
            for depth in range(len(buckets), 0, -1):
                for entry in buckets[depth - 1].values():
                    n = len(entry.tokens)
                    if n > best_length and n <= usable and not entry.session.closed \
                            and tuple(prompt[:n]) == entry.tokens:
                        best, best_length = entry, n
                if best is not None:
                    break
            return best, best_length
        if not buckets:
            return None, 0
        verified = len(buckets) * page
        head = tuple(prompt[:verified])
        for entry in reversed(list(buckets[-1].values())):  # (most recently kept first)
            if entry.session.closed or entry.tokens[:verified] != head:
                continue  # (closed by the engine; or a hash collision)
            n, most = verified, min(usable, len(entry.tokens))
            while n < most and entry.tokens[n] == prompt[n]:
                n += 1
            if n > best_length:  # (ties: the one kept last)
                best, best_length = entry, n
        return best, best_length

    # -- keeping -----------------------------------------------------------------
    def keep(self, session: Session, tokens: Sequence[int], namespace: str) -> bool:
        """Keeps ``session`` (holding ``tokens``, idle: its chat session's
        lock held) for later lookups of ``namespace``; False where it is not
        worth keeping (no full block, off the device, already held by an
        entry, the cache off): the caller closes it then."""
        if self.max_entries <= 0 or len(tokens) < self._page or session.closed or not session.resident:
            return False
        kept = tuple(tokens)
        blocks: list[int] = []
        chain = 0
        for start in range(0, len(kept) - self._page + 1, self._page):
            chain = hash((chain, *kept[start:start + self._page]))
            blocks.append(chain)
        size = -(-len(kept) // self._page) * self._page_bytes + self._slot_bytes
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        with self._lock:
            self._prune()
            for entry in self._index.get((namespace, blocks[-1]), {}).values():
                # Held already (or, where a match may be cut short, more of it).
                if entry.tokens == kept or (not self._exact_only and entry.tokens[:len(kept)] == kept):
                    self._entries.move_to_end(id(entry))
                    return False
        try:
            session.discardable = True
        except SessionClosedError:
            return False
        entry = _Entry(namespace, session, kept, blocks, size)
        closing: list[Session] = []
        with self._lock:
            # Entries this one extends hold nothing it does not (but where only whole entries match).
            for depth in range(len(blocks) if not self._exact_only else 0, 0, -1):
                for other in list(self._index.get((namespace, blocks[depth - 1]), {}).values()):
                    if len(other.tokens) <= len(kept) and kept[:len(other.tokens)] == other.tokens \
                            and other.forking == 0:
                        self._remove(other)
                        closing.append(other.session)
            self._add(entry)
            while self._entries and (len(self._entries) > self.max_entries or
                                     (self.max_bytes is not None and self._bytes > self.max_bytes)):
                victim = next((e for e in self._entries.values() if e.forking == 0 and e is not entry), None)
                if victim is None:
                    break
                self._remove(victim)
                self.evicted += 1
                closing.append(victim.session)
            self.kept += 1
        for old in closing:
            old.close()
        return True

    def _add(self, entry: _Entry) -> None:
        self._entries[id(entry)] = entry
        for chain in entry.blocks:
            key = (entry.namespace, chain)
            self._index.setdefault(key, {})[id(entry)] = entry
            entry.index_keys.append(key)
        self._bytes += entry.bytes

    def _remove(self, entry: _Entry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        for key in entry.index_keys:
            bucket = self._index.get(key)
            if bucket is not None:
                bucket.pop(id(entry), None)
                if not bucket:
                    del self._index[key]
        self._bytes -= entry.bytes

    def _prune(self) -> None:
        """(Locked) Forgets the entries the engine closed to make room."""
        for entry in [e for e in self._entries.values() if e.session.closed]:
            self._remove(entry)

    # -- the rest ----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``prefix_cache_entries`` and ``prefix_cache_bytes`` now; since the
        start, ``prefix_cache_lookups``, ``prefix_cache_hits`` (sessions that
        started from an entry), ``prefix_cache_tokens`` (the tokens they did
        not prefill), ``prefix_cache_kept`` and ``prefix_cache_evictions``
        (entries dropped for the cache's bounds; the engine's own closes are
        its ``discards``)."""
        with self._lock:
            self._prune()
            return {"prefix_cache_entries": len(self._entries), "prefix_cache_bytes": self._bytes,
                    "prefix_cache_lookups": self.lookups, "prefix_cache_hits": self.hits,
                    "prefix_cache_tokens": self.tokens_reused, "prefix_cache_kept": self.kept,
                    "prefix_cache_evictions": self.evicted}

    def clear(self) -> None:
        """Closes every entry."""
        with self._lock:
            entries = list(self._entries.values())
            for entry in entries:
                self._remove(entry)
        for entry in entries:
            entry.session.close()
