"""The cache a PagedLM call hands its model (``_paged.py``): it writes each
new position's keys and values into the row's page of the pool, hands
attention what it reads, and keeps hybrid layers' conv and recurrent state
by slot. ``current`` is the call being traced, for the attention function
(``_paged.paged_attention``) to read its step from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._paged_layout import KVLayout, StateLayout
from ._ring import RingStep, rows

__all__ = ["Step", "current", "cache_class"]


@dataclass
class Step:
    """What one call's cache writes and attention reads, for every layer."""

    kv: torch.Tensor           # the pool
    page_table: torch.Tensor   # int32 [B, MP]
    page: torch.Tensor         # int64 [B*T]: each new position's page
    offset: torch.Tensor       # int64 [B*T]: and its place in the page
    lengths: torch.Tensor      # int64 [B]: positions each row holds after the call
    kernel: bool               # the paged kernel (one new position per row, CUDA), else gather
    positions: torch.Tensor    # int64 [B, T]: the new positions (the gather path's sliding windows)
    slots: dict[str, torch.Tensor] = field(default_factory=dict)  # slot tensors by name (hybrid models)
    slot_ids: torch.Tensor | None = None  # int64 [B]: each row's slot
    # Each layer's state as this call leaves it, by (slot tensor, layer):
    # read from the slots on first use, written back after the call.
    states: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    ring: RingStep | None = None  # the window layers' rings (_ring.py), where they keep one
    counters: torch.Tensor | None = None  # the paged kernel's, one zeroed tensor a call for every layer


current: list[Step] = []  # the call being traced (one at a time)


@functools.cache
def cache_class() -> type:
    """The cache class (built on first use: transformers is imported only then)."""
    from transformers.cache_utils import Cache

    class PagedCache(Cache):
        """The model's cache: writes into the pool, hands attention what it reads."""

        is_compileable = True

        def __init__(self, step: Step, layout: StateLayout, kv: KVLayout, written: set[int]) -> None:
            super().__init__(layers=[])
            self.step = step
            self.kv = kv
            self.written = written  # the layers whose cache the model wrote
            self.pool_layer = {g: i for i, g in enumerate(layout.attention)}  # a layer's index in the pool
            self.slot_layer = {g: i for i, g in enumerate(layout.recurrent)}  # and in the slot tensors
            self.ring_layer = {g: i for i, g in enumerate(layout.ring.layers if layout.ring else ())}  # in the ring
            self.layer_count = len(self.pool_layer) + len(self.slot_layer) + len(self.ring_layer)

        def __len__(self) -> int:
            return self.layer_count

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            step = self.step
            self.written.add(layer_idx)
            if layer_idx in self.ring_layer:
                assert step.ring is not None
                return step.ring.update(self.ring_layer[layer_idx], key_states, value_states)
            layer_idx = self.pool_layer[layer_idx]
            # index_put_ on the pool itself, with one index tensor per
            # dimension: AOTInductor writes that in place. (A write through a
            # view of the pool, or index_copy_, becomes a copy of the whole
            # pool written back after the step: slow, and it would undo the
            # writes of a concurrent step of other sessions.)
            layer = torch.full_like(step.page, layer_idx)
            if self.kv.is_latent:  # (latent, rotary key): one part, side by side
                both = torch.cat([rows(key_states), rows(value_states).to(key_states.dtype)], dim=-1)
                step.kv.index_put_((step.page, layer, torch.zeros_like(step.page), step.offset), both)
            else:
                step.kv.index_put_((step.page, layer, torch.zeros_like(step.page), step.offset), rows(key_states))
                step.kv.index_put_((step.page, layer, torch.ones_like(step.page), step.offset), rows(value_states))
            return self._read(layer_idx)

        def write_in_pool(self, layer_idx: int, write: Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], Any]
                          ) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
            """For a kernel that writes a layer's new keys and values into the pool
            itself (decode_one's: ``_one_row.py``): ``write(pool, layer in the pool,
            page, offset)``; returns what it returned and what attention reads,
            as :meth:`update` does. None, writing nothing, where the layer keeps
            them elsewhere (a ring) or in another form (a latent pool)."""
            if layer_idx not in self.pool_layer or self.kv.is_latent:
                return None
            self.written.add(layer_idx)
            layer = self.pool_layer[layer_idx]
            return (write(self.step.kv, layer, self.step.page, self.step.offset), *self._read(layer))

        def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            """A pool layer's keys and values as attention reads them: the pool's
            own (the paged kernel), else the rows' gathered in order."""
            step = self.step
            if step.kernel:
                return step.kv[:, layer, 0], step.kv[:, layer, 1]
            # [B, MP, page, Hkv, D] -> [B, Hkv, MP * page, D]: the row's positions in order.
            pages = step.kv[step.page_table.long(), layer]
            if self.kv.is_latent:
                both = pages[:, :, 0].flatten(1, 2).transpose(1, 2)
                return both[..., :self.kv.latent], both[..., self.kv.latent:]
            keys = pages[:, :, 0].flatten(1, 2).transpose(1, 2)
            values = pages[:, :, 1].flatten(1, 2).transpose(1, 2)
            return keys, values

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # positions come from the engine, never from here

        # Linear-attention layers' state (transformers' Cache API): a row's
        # state is its slot's until the layer updates it; a call's last
        # value of each is written back to the slots after the call (so an
        # update made in place, as a one-token conv or SSM step does, counts).
        def _key(self, name: str, layer_idx: int) -> tuple[str, int]:
            return name, self.slot_layer[layer_idx]

        def _state(self, name: str, layer_idx: int) -> torch.Tensor:
            step = self.step
            key = self._key(name, layer_idx)
            if key not in step.states:
                assert step.slot_ids is not None
                step.states[key] = step.slots[name][step.slot_ids, key[1]]
            return step.states[key]

        def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
            self.written.add(layer_idx)
            return self._state("conv", layer_idx)

        def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                              **kwargs: Any) -> torch.Tensor:
            # The layer convolves the kernel's width of earlier inputs, then the new ones.
            before = self._state("conv", layer_idx)
            full = torch.cat([before.to(conv_states.dtype), conv_states], dim=-1)
            self.step.states[self._key("conv", layer_idx)] = full[..., -before.shape[-1]:]
            return full

        def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
            self.written.add(layer_idx)
            return self._state("recurrent", layer_idx)

        def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                                   **kwargs: Any) -> torch.Tensor:
            self.step.states[self._key("recurrent", layer_idx)] = recurrent_states
            return recurrent_states

        def is_recording_past(self, layer_idx: int) -> bool:
            return False

    return PagedCache
