"""One replica of the cluster: an engine on one device (a GPU, or the CPU)
serving the single-machine server's application, with its sessions
checkpointed to the shared session directory after every change.

Ray Serve makes it a deployment (:func:`aoti_sessions.cluster.app`); the
ingress calls :meth:`Replica.call` through the session router, and Serve asks
it for :meth:`record_routing_stats` (what the router places sessions by) and
:meth:`check_health`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from . import _asgi, _local

log = logging.getLogger("aoti_sessions.cluster")
REPLICA_HEADER = b"x-aoti-replica"  # names the replica that answered
ENGINE_GONE = "engine_gone"  # in an answer's head: this replica's engine had ended, it ran none of the request


class Replica:
    def __init__(self, package: str, *, session_dir: str, device: str = "cpu", threads: int | None = None,
                 engine: dict[str, Any] | None = None, server: dict[str, Any] | None = None,
                 engine_process: bool = True, loopback: bool = False) -> None:
        if loopback:
            _local.keep_replica_on_loopback()
        from ray import serve

        from ..serve import create_app
        from ..serve.interface import open_llm

        device = _visible_device(device)
        self.engine_options = dict(engine or {})
        # As `aoti-sessions serve` runs it: by default in an engine process,
        # the step loop away from this process's GIL (the server's
        # application, Ray's gRPC server and its threads).
        self.llm = open_llm(package, device=device, threads=threads, engine_process=engine_process,
                            engine_options=self.engine_options)
        self.app = create_app(self.llm, session_dir=session_dir, persist_sessions=True, checkpoint_sessions=True,
                              **(server or {}))
        self.id: str = serve.get_replica_context().replica_id.unique_id
        self._lifespan = _asgi.Lifespan(self.app)
        self._started: asyncio.Task[None] | None = None
        log.info("replica %s: %s on %s", self.id, self.llm.name, self.llm.device)

    async def _ready(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._lifespan.start())
        await asyncio.shield(self._started)

    # ``replica``: the replica the router was told to reach (this one).
    async def call(self, request: _asgi.Request, replica: str | None = None) -> AsyncIterator[Any]:
        """The answer to one HTTP request: its head (naming this replica),
        then its body's chunks."""
        await self._ready()
        # An engine that ended before the request came: none of it runs
        # here, and the ingress may send it to another replica (one that
        # ends while the request runs fails it as the server does, not sent
        # again: it may have run in part).
        answer = _asgi.call(self.app, request, self._lifespan.state) if self.llm.alive else _engine_gone()
        async for item in answer:
            if isinstance(item, dict):
                item["headers"].append((REPLICA_HEADER, self.id.encode()))
            yield item

    async def answer(self, request: _asgi.Request) -> dict[str, Any]:
        """The answer to one HTTP request whole: its head (naming this
        replica) and ``body`` (one round trip, for answers not streamed)."""
        head: dict[str, Any] = {}
        chunks = []
        async for item in self.call(request):
            if isinstance(item, dict):
                head = item
            else:
                chunks.append(item)
        return {**head, "body": b"".join(chunks)}

    def _addressed(self, replica: str | None) -> None:
        if replica is not None and replica != self.id:
            raise LookupError(f"replica {replica} is gone (this is {self.id})")

    async def metrics(self, replica: str | None = None) -> str:
        self._addressed(replica)
        await self._ready()
        # (The engine's figures are a call into its process: in a thread, not a wait of the event loop.)
        return str(await asyncio.to_thread(self.app.state.metrics.render))

    async def listing(self, tenant: str, replica: str | None = None) -> list[dict[str, Any]]:
        """``tenant``'s sessions held here, as ``GET /v1/sessions`` lists them."""
        self._addressed(replica)
        await self._ready()
        return [e.describe() for e in self.app.state.registry.entries(tenant) if e.id is not None]

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router places by: the named sessions held here, and how
        full the engine is (0 empty, 1 no room for another session)."""
        registry = self.app.state.registry
        stats = await asyncio.to_thread(self.llm.stats)  # (an engine process's answer: not on the loop)
        fractions = [0.0]
        if (cap := self.engine_options.get("max_sessions")) is not None:
            fractions.append(stats["live_sessions"] / cap)
        budget = sum(self.engine_options.get(k) or 0 for k in ("memory_budget", "host_budget"))
        if budget:
            fractions.append(stats["live_bytes"] / budget)
        return {"sessions": [e.key for e in registry.entries() if e.id is not None],  # (as the router keys them)
                "fullness": max(fractions), "room": max(fractions) < 1.0,
                "capacity": self.engine_options.get("max_sessions")}

    def check_health(self) -> None:
        """Serve replaces a replica this raises for: its engine closed or
        dead, or (an engine process) unresponsive: no heartbeat, or its step
        loop stuck in one step (RemoteLLM's deadlines)."""
        if not self.llm.alive:
            why = getattr(self.llm, "unavailable", None) or "it is closed"
            raise RuntimeError(f"replica {self.id}: its engine is unavailable: {why}")

    async def __del__(self) -> None:
        """Serve is stopping this replica (scaling down, redeploying): its
        named sessions are parked in the shared session dir, where the other
        replicas find them."""
        try:
            if self._started is not None:
                await self._lifespan.stop()
        finally:
            self.llm.close()


async def _engine_gone() -> AsyncIterator[Any]:
    """The server's answer once its engine process has ended (503
    ``engine_unavailable``), its head marked :data:`ENGINE_GONE`."""
    from ..serve.interface import error_body

    body = json.dumps(error_body(503, "the model is unavailable: this replica's engine process ended",
                                 "engine_unavailable")).encode()
    yield {"status": 503, "headers": [(b"content-type", b"application/json"),
                                      (b"content-length", str(len(body)).encode())], ENGINE_GONE: True}
    yield body


def _visible_device(device: str) -> str:
    """On CUDA, the replica's own GPU: Ray makes the one it placed the
    replica on visible as ``cuda:0``."""
    if device.startswith("cuda") and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return "cuda:0"
    return device
