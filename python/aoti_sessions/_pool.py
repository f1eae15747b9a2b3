"""Pooled state (docs/batching.md): what a method declares with
``ais.Method(..., pool=ais.Pool(...))``, and the document ``ais.compile``
records for it in the package, by input position.

A pooled method takes, besides its own inputs, tensors the engine allocates
once and shares between sessions (each session owning pages of them, or one
slot), and integer inputs saying which rows own what. Its mutations of those
tensors are the sessions' state, so it mutates no buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from ._words import first_names
from .errors import CompileError

__all__ = ["Pool", "pool_document"]


@dataclass(frozen=True)
class Pool:
    """How a method addresses the engine's pooled state, by input name.

    ``pages``: inputs ``[pages, ...]`` holding ``page_size`` positions per
    page (KV caches); ``slots``: inputs ``[slots, ...]`` with one slot per
    session (recurrent state). The engine fills them and ``page_table`` (int32
    ``[rows, max_pages]``), ``positions`` (int64 ``[rows]``: each row's
    positions before the call) and ``slot_ids`` (int32 ``[rows]``); the caller
    gives ``tokens`` (``[rows, T, ...]``: ``T`` new positions per row) and any
    other input, rows first. The method writes positions ``positions[r]`` to
    ``positions[r] + T - 1`` of row ``r`` and touches no other session's units.
    """

    tokens: str
    pages: Sequence[str] = ()
    page_size: int = 0
    page_table: str | None = None
    positions: str | None = None
    slots: Sequence[str] = ()
    slot_ids: str | None = None

    def __post_init__(self) -> None:
        for name in ("pages", "slots"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"Pool.{name} must be a sequence of input names, not one string")
            object.__setattr__(self, name, tuple(value))
        if not self.pages and not self.slots:
            raise ValueError("a Pool needs page tensors (pages=) or slot tensors (slots=)")
        if self.pages and (self.page_table is None or self.positions is None or self.page_size < 1):
            raise ValueError("page tensors need page_size >= 1, page_table= and positions=")
        if self.slots and self.slot_ids is None:
            raise ValueError("slot tensors need slot_ids=")


def _dynamic(size: Any) -> bool:
    return not isinstance(size, int)


def bounds_of(ranges: list[dict[str, Any]]) -> Mapping[str, int | None]:
    """Each dimension symbol's upper bound (None: unbounded)."""
    return {r["symbol"]: r["max"] for r in ranges}


def pool_document(method: str, pool: Pool, ep: ExportedProgram, decomposed: ExportedProgram,
                  inputs: list[dict[str, Any]], ranges: list[dict[str, Any]],
                  mutated_buffers: list[str]) -> dict[str, Any]:
    """The ``pool`` entry of a method's metadata (input positions), after
    checking the declaration against the exported program; a CompileError
    naming the method and the input otherwise."""
    names = [str(doc["name"]) for doc in inputs]
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}

    def index(role: str, name: str) -> int:
        if name not in names:
            raise CompileError(f"method '{method}': pool {role} '{name}' is not one of its tensor inputs "
                               f"({', '.join(names)})")
        return names.index(name)

    def check(role: str, name: str, dtype: torch.dtype, rank: int) -> int:
        i = index(role, name)
        val = vals.get(name)
        if not isinstance(val, torch.Tensor) or val.dtype != dtype or val.dim() != rank:
            raise CompileError(f"method '{method}': pool {role} '{name}' must be a {dtype} tensor of rank {rank}")
        return i

    if mutated_buffers:
        raise CompileError(f"method '{method}' keeps pooled state, so all its mutable state must be pooled, but "
                           f"it mutates the buffers {first_names(mutated_buffers, 4)}")
    tensors = []
    for kind, group in (("pages", pool.pages), ("slots", pool.slots)):
        for name in group:
            i = index("tensor", name)
            val = vals.get(name)
            if not isinstance(val, torch.Tensor) or val.dim() < 1 or not _dynamic(val.shape[0]) \
                    or any(_dynamic(s) for s in val.shape[1:]) or not val.is_contiguous():
                raise CompileError(f"method '{method}': pooled tensor '{name}' must be contiguous with a dynamic "
                                   "first dimension (its units) and static others; export it with "
                                   "dynamic_shapes={0: Dim.DYNAMIC}")
            tensors.append({"input": i, "name": name, "kind": kind})
    declared = {t["name"] for t in tensors}
    stray = sorted(set(decomposed.graph_signature.user_inputs_to_mutate.values()) - declared)
    if stray:
        raise CompileError(f"method '{method}' mutates the inputs {', '.join(stray)}, which are not pooled tensors")
    tokens = index("tokens", pool.tokens)
    token_val = vals.get(pool.tokens)
    if not isinstance(token_val, torch.Tensor) or token_val.dim() < 2:
        raise CompileError(f"method '{method}': pool tokens '{pool.tokens}' must be [rows, positions, ...]")
    rows = token_val.shape[0]
    max_rows = rows if isinstance(rows, int) else bounds_of(ranges).get(str(rows))
    if max_rows is None or max_rows < 1:
        raise CompileError(f"method '{method}': the rows of pool tokens '{pool.tokens}' need an upper bound "
                           "(export them with Dim(..., max=N)): the engine captures a graph per batch size up to it")
    # A method exported for two rows or more (Dim(..., min=2)) gets padding
    # rows for a call of one session.
    min_rows = rows if isinstance(rows, int) else next((r["min"] for r in ranges if r["symbol"] == str(rows)), 1)
    doc: dict[str, Any] = {"page_size": pool.page_size, "tensors": tensors, "tokens": tokens,
                           "max_rows": int(max_rows), "min_rows": max(1, int(min_rows or 1)), "page_table": None,
                           "positions": None, "slot_ids": None, "max_pages": 0}
    if pool.pages:
        assert pool.page_table is not None and pool.positions is not None
        doc["page_table"] = check("page_table", pool.page_table, torch.int32, 2)
        width = vals[pool.page_table].shape[1]
        # A dynamic width (the pages the call's rows hold) needs a bound: the
        # pages a session holds at most.
        doc["max_pages"] = width if isinstance(width, int) else bounds_of(ranges).get(str(width))
        if doc["max_pages"] is None:
            raise CompileError(f"method '{method}': pool page_table '{pool.page_table}' needs a static width or "
                               "one with an upper bound (Dim(..., max=N)): the pages a session holds at most")
        doc["positions"] = check("positions", pool.positions, torch.int64, 1)
    if pool.slots:
        assert pool.slot_ids is not None
        doc["slot_ids"] = check("slot_ids", pool.slot_ids, torch.int32, 1)
    return doc
