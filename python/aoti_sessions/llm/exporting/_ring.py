"""Ring caches for sliding-window layers (Gemma 2/3, Mistral, GPT-OSS) and
chunked-attention layers (Llama 4).

A window layer's query at position q attends to the keys at positions
q - window + 1 .. q only, so its cache needs the last ``window`` positions,
never the whole context: as transformers' own sliding-window cache layers
do, each window layer keeps a ring of ``window`` entries a session, position
p at entry p mod window, while the model's global layers keep every position
in the pool's pages. The rings of all window layers are one slot tensor of
the pool (``ring[slots, window layers, 2 (keys, values), window, kv heads,
head dim]``, one slot a session, rows addressed by ``slot_ids``), so a
session's window layers cost the same at any context.

- Decode (one new position a row): the position's keys and values are
  written into its entry in place, then the row's ring is read and attended
  with a mask of the entries that hold a position yet (a young session's
  ring is not full).
- Prefill (a chunk of T positions a row, rows right-padded): the ring as
  the call found it (positions before the chunk) and the chunk's own keys
  and values are attended together, each query within its window; then each
  entry takes the chunk's last real position that falls on it, if any (a
  chunk longer than the window overwrites the entries its later positions
  take; padding never lands).

A chunked layer (Llama 4's) attends within its query's chunk of positions
(``q // chunk == k // chunk``, earlier positions only): a ring of ``chunk``
entries holds every earlier position of the query's chunk, and the same
reads and writes serve it with that mask.

An entry's position follows from the row's length alone (the latest
position before that length that falls on the entry), so the ring stores
nothing but keys and values. A ring cannot be rewound by position (a
position once overwritten is gone): like recurrent state, it is a slot the
engine checkpoints at a turn's start and rewinds only there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Ring", "ring_layers", "RingStep", "rows"]


@dataclass(frozen=True)
class Ring:
    """The window layers (model layer indices, in the ring tensor's order)
    and the window: a query attends to itself and the ``window - 1``
    positions before it."""

    layers: tuple[int, ...]
    window: int
    chunked: bool = False  # the layers attend within chunks of `window` positions, not a sliding window

    def visible(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Whether each query sees each key (positions, broadcast; a key is
        never after its query), by the window or the chunk."""
        if self.chunked:
            return torch.div(keys, self.window, rounding_mode="floor") == \
                torch.div(queries, self.window, rounding_mode="floor")
        return keys > queries - self.window


def ring_layers(layers: list[Any], cache_len: int, chunked: frozenset[int] = frozenset()) -> Ring | None:
    """The model's window layers, from ``layers`` (transformers' own cache's
    for the model), where a ring saves memory: None for a model without
    window layers, or whose window covers the whole context anyway.
    ``chunked``: the layers that attend within chunks (transformers keeps
    them as window layers of the chunk's size). Raises ValueError for window
    layers of different windows (one ring tensor has one length), or of
    both kinds."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    windowed = {i: int(layer.sliding_window) for i, layer in enumerate(layers)
                if isinstance(layer, DynamicSlidingWindowLayer)}
    if not windowed:
        return None
    windows = set(windowed.values())
    if len(windows) != 1:
        raise ValueError(f"the model's window layers have different windows ({sorted(windows)}); export it with "
                         "window_cache='full'")
    kinds = {i in chunked for i in windowed}
    if len(kinds) != 1:
        raise ValueError("the model has sliding-window layers beside chunked ones; export it with window_cache='full'")
    window, = windows
    if window >= cache_len:
        return None
    return Ring(tuple(sorted(windowed)), window, chunked=kinds.pop())


def rows(states: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B * T, H, D], always as a copy: reshaping a strided
    view (a model that slices keys and values out of one projection, as Phi-3
    does) makes the trace guard the row count against 1, which would refuse a
    batch of one session."""
    batch, heads, count, dim = states.shape
    moved = torch.clone(states.transpose(1, 2), memory_format=torch.contiguous_format)
    return moved.view(batch * count, heads, dim)


def _entry_positions(length: torch.Tensor, window: int) -> torch.Tensor:
    """[B, window]: the position each ring entry holds for a row of
    ``length`` [B] positions (the latest before the length that falls on the
    entry); negative where no position has yet."""
    last = (length - 1)[:, None]
    entries = torch.arange(window, device=length.device)[None, :]
    return last - torch.remainder(last - entries, window)


class RingStep:
    """One traced call's ring reads and writes, for every window layer.

    ``positions`` [B, T]: the call's new positions; ``real`` [B]: each row's
    real positions among them (prefill: the rest is padding); ``in_place``:
    one position a row, written into the ring before it is read (decode)."""

    def __init__(self, ring: Ring, tensor: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                 real: torch.Tensor | None, in_place: bool) -> None:
        self.ring = ring
        self.tensor = tensor
        self.slot_ids = slot_ids
        self.positions = positions
        self.in_place = in_place
        window = ring.window
        start, count = positions[:, 0], positions.shape[1]
        queries = positions[:, :, None]  # [B, T, 1]
        if in_place:
            held = _entry_positions(start + count, window)[:, None, :]  # after the write
            mask = (held >= 0) & (held <= queries) & ring.visible(held, queries)
            self.write_entry = torch.remainder(positions, window).reshape(-1)  # [B*T]
        else:
            held = _entry_positions(start, window)[:, None, :]  # before the chunk: all earlier than its queries
            own = positions[:, None, :]  # [B, 1, T]: the chunk's keys
            mask = torch.cat([(held >= 0) & ring.visible(held, queries), (own <= queries) & ring.visible(own, queries)],
                             dim=-1)
            assert real is not None
            # Each entry's new position: the chunk's last real one on it, if any.
            latest = _entry_positions(start + real, window)  # [B, window]
            self.fresh = (latest >= start[:, None])[:, None, :, None, None]  # [B, 1, window, 1, 1]
            self.chunk_index = torch.clamp(latest - start[:, None], 0, count - 1)  # [B, window]
        self.mask = mask[:, None]  # [B, 1, T, K]: K the ring's entries (then the chunk's keys, in prefill)

    def update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """Layer ``layer`` (its index in the ring tensor) takes the call's
        keys and values [B, H, T, D]; returns the keys and values [B, H, K, D]
        its queries attend to under ``self.mask``."""
        tensor, slots = self.tensor, self.slot_ids
        if self.in_place:
            written = torch.repeat_interleave(slots, key_states.shape[2])  # [B*T]: each position's slot
            layers = torch.full_like(written, layer)
            for kind, states in ((0, key_states), (1, value_states)):
                # (One index tensor per dimension: AOTInductor writes in place, as for pages.)
                tensor.index_put_((written, layers, torch.full_like(written, kind), self.write_entry),
                                  rows(states).to(tensor.dtype))
            held = tensor[slots, layer]  # [B, 2, window, H, D]
            return held[:, 0].transpose(1, 2), held[:, 1].transpose(1, 2)
        new = torch.stack([key_states, value_states], dim=1).transpose(2, 3)  # [B, 2, T, H, D]
        before = tensor[slots, layer].to(new.dtype)  # [B, 2, window, H, D]
        index = self.chunk_index[:, None, :, None, None].expand(-1, 2, -1, *new.shape[3:])
        after = torch.where(self.fresh, torch.gather(new, 2, index), before)
        tensor.index_put_((slots, torch.full_like(slots, layer)), after.to(tensor.dtype))
        keys = torch.cat([before[:, 0], new[:, 0]], dim=1).transpose(1, 2)  # [B, H, window + T, D]
        values = torch.cat([before[:, 1], new[:, 1]], dim=1).transpose(1, 2)
        return keys, values
