"""The server's stats in one log line every ``stats_interval`` seconds
(``aoti-sessions serve --stats-interval``, 10 s by default), e.g.::

    stats: 24 requests (2.4/s), 3 generating (1 reading its prompt), prompt 412.0 tokens/s (61% from cache),
    generated 96.3 tokens/s; sessions: 5 named, 1 throwaway, 4 on the device, 2 offloaded;
    KV pages 140/2048 (7%); state 14.0 MiB on the device, 3.5 MiB offloaded

(one line in the log). The counts are the server's metrics (serve/_metrics.py,
summed over front ends where there are several: the hub, serve/_fleet.py,
writes the line for all of them), the rest ``LLM.stats()``. A line is
written while the server is busy and once after, none while it idles.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._metrics import Snapshot, total

log = logging.getLogger("aoti_sessions.serve")
PREFIX = "aoti_sessions_"


@dataclass
class Figures:
    """What a stats line shows, as counted so far (the rates are of two of these)."""

    requests: float = 0.0  # answered
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    generated_tokens: float = 0.0
    generating: float = 0.0  # generations running now
    named: int = 0
    throwaway: int = 0
    engine: dict[str, Any] = field(default_factory=dict)  # LLM.stats()

    def state(self) -> tuple[Any, ...]:
        """What says whether anything happened between two of them."""
        e = self.engine
        return (self.requests, self.prompt_tokens, self.generated_tokens, self.generating, self.named,
                self.throwaway, e.get("resident_sessions"), e.get("offloaded_sessions"), e.get("pool_pages_used"))


def figures(snapshots: Sequence[Snapshot], engine: dict[str, Any], named: int, throwaway: int) -> Figures:
    """The figures of the front ends' metric ``snapshots`` (summed) and the engine's stats."""
    def counted(name: str) -> float:
        return total(snapshots, PREFIX + name, PREFIX + name + "_total")

    return Figures(counted("requests"), counted("prompt_tokens"), counted("cached_prompt_tokens"),
                   counted("generated_tokens"), total(snapshots, PREFIX + "active_generations"), named, throwaway,
                   engine)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def line(before: Figures, now: Figures, seconds: float) -> str:
    """The stats line of the ``seconds`` from ``before`` to ``now``."""
    e = now.engine
    requests = now.requests - before.requests
    prompt = now.prompt_tokens - before.prompt_tokens
    cached = now.cached_tokens - before.cached_tokens
    generated = now.generated_tokens - before.generated_tokens
    per = max(seconds, 1e-9)
    parts = [f"{requests:.0f} requests ({requests / per:.1f}/s), {now.generating:.0f} generating "
             f"({e.get('prefilling', 0)} reading its prompt), prompt {prompt / per:.1f} tokens/s"
             + (f" ({100 * cached / prompt:.0f}% from cache)" if prompt else "")
             + f", generated {generated / per:.1f} tokens/s",
             f"sessions: {now.named} named, {now.throwaway} throwaway, {e.get('resident_sessions', 0)} on the "
             f"device, {e.get('offloaded_sessions', 0)} offloaded"]
    if e.get("pool_pages"):
        used, pages = e.get("pool_pages_used", 0), e["pool_pages"]
        parts.append(f"KV pages {used}/{pages} ({100 * used / pages:.0f}%)")
    parts.append(f"state {_mib(e.get('device_bytes', 0))} on the device, {_mib(e.get('host_bytes', 0))} offloaded")
    return "stats: " + "; ".join(parts)


async def run(interval: float, read: Callable[[], Awaitable[Figures]]) -> None:
    """Writes a stats line every ``interval`` seconds (of the figures
    ``read`` gives) while anything changes, and one after; until cancelled."""
    before: Figures | None = None
    then = anyio.current_time()
    quiet = False  # (the line before showed no change)
    while True:
        await anyio.sleep(interval)
        try:
            now = await read()
        except Exception as e:  # noqa: BLE001 - an engine that does not answer: no line this time
            log.debug("no stats line: %s", e)
            continue
        at = anyio.current_time()
        still = before is not None and now.state() == before.state()
        if not (still and quiet):
            log.info("%s", line(before or Figures(), now, at - then))
        before, then, quiet = now, at, still
