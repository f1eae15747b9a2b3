"""Which replica serves a request: Ray Serve's request router for the
engine replicas, and the affinity it keeps.

A session's requests go to the replica that holds it, known from the
ingress's own answers (each names the replica that gave it) and from what
every replica reports of itself (its ``record_routing_stats``: the sessions
it holds, how full it is). A session no replica holds (new, or its replica
gone) is placed on the replica with the most room, ties broken by a hash of
its id so that concurrent routers agree. A request may also name its replica
(the ingress's fan-out to every replica).

The table (:mod:`._affinity`) lives in the ingress process, beside the
deployment handle that owns the router.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from . import _affinity

TARGET = "replica"  # a request's keyword argument naming the replica it must reach


def fullness(stats: dict[str, Any]) -> float:
    """How full a replica says it is, 0 (empty) to 1 (no room for a session)."""
    if not stats:
        return 0.5  # not reported yet: between an empty replica and a busy one
    if not stats.get("room", True):
        return 1.0
    return min(0.99, float(stats.get("fullness", 0.0)))


def _tiebreak(session_id: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{session_id}\0{replica}".encode(), digest_size=8).digest()


def _placement(replica: RunningReplica, key: str) -> tuple[float, int, bytes]:
    """A replica's rank for a new session (lowest first): how full it says
    it is, how many sessions it holds, then a hash of the session's id."""
    stats = replica.routing_stats or {}
    rid = replica.replica_id.unique_id
    held = max(len(stats.get("sessions", ())), _affinity.AFFINITY.load(rid))
    full = fullness(stats)  # (as of its last report)
    capacity = stats.get("capacity")
    if capacity:  # the sessions placed since then count too
        full = max(full, min(1.0, held / capacity))
    return full, held, _tiebreak(key, rid)


class SessionRouter(ConsistentHashRouter):
    """Routes by session: its holder, else the replica with the most room.

    Built on Serve's consistent-hash router for its routing loop, which
    keeps each request with the choice made for it (the default loop may
    hand a replica chosen for one request to another), and retries with
    backoff while the chosen replica is busy or not yet up."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        _affinity.AFFINITY.set_replicas(tuple(sorted(r.replica_id.unique_id for r in replicas)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        alive = [r for r in candidate_replicas if not _affinity.AFFINITY.is_gone(r.replica_id.unique_id)]
        candidate_replicas = alive or candidate_replicas
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(TARGET)
        if target is not None:  # (a replica gone meanwhile: any other, which refuses it)
            return [[by_id.get(target, candidate_replicas[0])]]
        session_id = pending_request.metadata.session_id
        if session_id:
            owner = _affinity.AFFINITY.owner(session_id)
            if owner in by_id:
                return [[by_id[owner]]]
            for replica in candidate_replicas:
                if session_id in (replica.routing_stats or {}).get("sessions", ()):
                    _affinity.AFFINITY.pin(session_id, replica.replica_id.unique_id)
                    return [[replica]]
        key = session_id or pending_request.metadata.internal_request_id
        ranked = sorted(candidate_replicas, key=lambda r: _placement(r, key))
        if session_id:
            _affinity.AFFINITY.pin(session_id, ranked[0].replica_id.unique_id)
        return [[r] for r in ranked]
