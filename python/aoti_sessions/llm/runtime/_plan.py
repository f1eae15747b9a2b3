"""What one step of the step loop does: the scheduler's decision, made from
the generations' state alone (no engine, no device), then carried out by
the step loop (_scheduler.py).

A step decodes one token for every generation whose token the step before
sampled (fed from the device, unread) where it goes on, and feeds prompt
chunks first come, first served, up to a token budget; a chunk of one token
is a decode row. Prefill rows are grouped into calls (longest first, a row
joining while its padding is shorter than itself), each call padded to a
width: its longest chunk, or where prefill runs as CUDA graphs (captured per
shape) the next power of two from ``min_bucket``.

The generations are read through ``finished``, ``_pending`` (prompt tokens
still to feed), ``_feeds_next()`` (whether the token sampled last is fed
before it is read) and ``_session.token_count``: tests/test_plan.py plans
with stand-ins for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Planned", "Row", "Plan", "Limits", "plan_step", "prefill_groups", "prefill_width"]


class Planned(Protocol):
    """What a plan reads of a generation (_generation.Generation)."""

    @property
    def finished(self) -> bool: ...

    _pending: list[int]  # prompt tokens (or a read token) still to feed
    _session: Any  # its chat session: token_count, the context it uses

    def _feeds_next(self) -> bool: ...


@dataclass(slots=True)
class Row:
    """One generation's part of a step."""

    generation: Any  # a Generation (Planned, and more for the step loop)
    fed: list[int]              # the tokens fed (known on the host), or [] for the device token
    samples: bool               # the step's logits pick its next token
    from_device: int = -1       # its input: row of the previous step's sampled tokens (-1: `fed`)


@dataclass(frozen=True)
class Limits:
    """What bounds a step: prompt tokens a step (``budget``) and a call
    (``max_prefill``), sessions a prefill call (``prefill_rows``), the
    context, and the shortest padded prefill call (``min_bucket``)."""

    budget: int
    max_prefill: int
    prefill_rows: int
    max_context: int
    min_bucket: int = 16


@dataclass
class Plan:
    """A step: the decode rows (in order), then the prefill calls."""

    decode: list[Row] = field(default_factory=list)
    prefill: list[list[Row]] = field(default_factory=list)


def plan_step(active: Sequence[Planned], sampled: Sequence[Planned], limits: Limits) -> Plan:
    """The step for ``active`` generations, given those the step before
    sampled for (in its rows' order)."""
    index = {id(g): i for i, g in enumerate(sampled)}
    plan = Plan()
    prefill: list[Row] = []
    budget = limits.budget
    for g in active:
        if g.finished:
            continue
        at = index.get(id(g))
        if at is not None:
            if g._feeds_next():
                plan.decode.append(Row(g, [], True, at))
        elif g._pending and budget > 0:
            chunk = g._pending[: min(budget, limits.max_prefill)]
            budget -= len(chunk)
            row = Row(g, chunk, len(chunk) == len(g._pending))
            # A one-token chunk (say the prompt's last token after a cached
            # prefix) is a decode row: prefill takes two or more.
            (plan.decode if len(chunk) == 1 else prefill).append(row)
    plan.prefill = prefill_groups(prefill, limits)
    return plan


def prefill_groups(rows: Sequence[Row], limits: Limits) -> list[list[Row]]:
    """The prefill calls for ``rows``: longest chunk first, a row joining a
    call when its padding to the call's width is less than its own length
    and those positions fit its context, at most ``prefill_rows`` a call."""
    groups: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: -len(r.fed)):
        group = groups[-1] if groups else None
        if group is not None and len(group) < limits.prefill_rows and 2 * len(row.fed) > len(group[0].fed) \
                and _used(row) + len(group[0].fed) <= limits.max_context:
            group.append(row)
        else:
            groups.append([row])
    return groups


def prefill_width(rows: Sequence[Row], limits: Limits, buckets: bool) -> int:
    """The length ``rows``' chunks are padded to in one call: the longest,
    or with ``buckets`` (prefill runs as CUDA graphs) the next power of two
    from ``min_bucket``, within ``max_prefill`` and every row's context."""
    width = max(len(r.fed) for r in rows)
    if not buckets:
        return width
    bucket = max(limits.min_bucket, 1 << (width - 1).bit_length())
    room = limits.max_context - max(_used(r) for r in rows)
    return max(width, min(bucket, limits.max_prefill, room))


def _used(row: Row) -> int:
    """The context its session uses."""
    session: Any = row.generation._session
    return int(session.token_count)
