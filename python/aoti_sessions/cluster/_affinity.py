"""Which replica holds which session, as the ingress process knows it:
pinned from the answers it forwards (each names the replica that gave it),
and the replicas alive now (from the router).

The ingress reads and writes it on its event loop, the router on Serve's,
so it takes a lock (held only for dict operations). It is a module of its
own because Serve ships the router's module to the process by value: the
router reaches this table through the module, by reference.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

GONE_FOR_S = 30.0  # a replica found dead is left out this long (until Serve's replica list drops it)
MAX_PINNED = 1_000_000  # sessions remembered (the oldest forgotten first: replicas report theirs anyway)


class Affinity:
    """Session id -> the replica (its unique id) that holds it, and the
    replicas alive now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._load: Counter[str] = Counter()  # sessions pinned to each replica
        self._replicas: tuple[str, ...] = ()
        self._gone: dict[str, float] = {}  # replica -> until when it is left out

    def pin(self, session_id: str, replica: str) -> None:
        with self._lock:
            before = self._owner.get(session_id)
            if before is not None:
                self._load[before] -= 1
            self._owner[session_id] = replica
            self._owner.move_to_end(session_id)
            self._load[replica] += 1
            while len(self._owner) > MAX_PINNED:
                self._load[self._owner.popitem(last=False)[1]] -= 1

    def owner(self, session_id: str) -> str | None:
        with self._lock:
            return self._owner.get(session_id)

    def forget(self, session_id: str) -> None:
        with self._lock:
            before = self._owner.pop(session_id, None)
            if before is not None:
                self._load[before] -= 1

    def load(self, replica: str) -> int:
        """Sessions pinned to ``replica``."""
        with self._lock:
            return self._load[replica]

    def gone(self, replica: str) -> None:
        """``replica`` died: it is left out of routing, its sessions unpinned."""
        with self._lock:
            self._gone[replica] = time.monotonic() + GONE_FOR_S
            for session_id in [s for s, r in self._owner.items() if r == replica]:
                del self._owner[session_id]
            self._load.pop(replica, None)

    def is_gone(self, replica: str) -> bool:
        with self._lock:
            until = self._gone.get(replica)
            if until is not None and until < time.monotonic():
                del self._gone[replica]
                return False
            return until is not None

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        with self._lock:
            self._replicas = replicas

    def replicas(self) -> tuple[str, ...]:
        with self._lock:
            return self._replicas


AFFINITY = Affinity()  # this process's (the ingress's)
