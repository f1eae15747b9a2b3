"""What a transformers model's cache becomes in the pool (docs/batching.md):
which layers keep KV pages and how a position lies in a page
(:class:`KVLayout`; multi-head latent attention's one latent and rotary
key), which keep fixed-size state in slots (conv, SSM, delta-net, lightning
attention) and its shapes, which keep a ring of their window or chunk
(``_ring.py``); learnt from transformers' own cache for the model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._ring import Ring, ring_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["KVLayout", "kv_layout", "StateLayout", "state_layout", "layer_kinds", "chunked_layers", "chunk_of",
           "attention_as"]


@dataclass(frozen=True)
class KVLayout:
    """What an attention layer caches per position: ``parts`` tensors of
    [heads, width] (keys and values: 2), or, for multi-head latent attention,
    one part holding the latent and the rotary key side by side (``latent``:
    the latent's width; the rest of ``width`` is the rotary key's)."""

    parts: int
    heads: int
    width: int
    latent: int = 0

    @property
    def is_latent(self) -> bool:
        return self.latent > 0


def kv_layout(config: Any, page_size: int) -> KVLayout:
    """How a model's attention layers lie in the pool's pages (which layers
    have pages: ``state_layout``)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    latent = getattr(config, "kv_lora_rank", None)
    if latent:  # multi-head latent attention: transformers caches (latent, rotary key) as one head's (key, value)
        return KVLayout(parts=1, heads=1, width=int(latent) + int(config.qk_rope_head_dim), latent=int(latent))
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout(parts=2, heads=heads, width=int(head_dim))


@dataclass(frozen=True)
class StateLayout:
    """Which layers keep KV pages and which fixed-size state, and that
    state's shape per session and layer (without the batch) and dtype."""

    attention: tuple[int, ...]  # layers with KV pages, in order (the pool's layer index)
    recurrent: tuple[int, ...] = ()  # layers with conv / recurrent state, in order (the slots' layer index)
    slots: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()  # (name, shape, dtype) per slot tensor
    ring: Ring | None = None  # window layers keeping a ring of their window (slot "ring"), not pages

    def slot_layers(self, name: str) -> int:
        """The layers a slot tensor holds."""
        return len(self.ring.layers) if name == "ring" and self.ring is not None else len(self.recurrent)


def layer_kinds(config: Any, layers: list[Any] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the layers with a KV cache, the layers with linear-attention state),
    as transformers' own cache lays out a model of ``config`` (``layers``:
    that cache's layers, where the caller has them)."""
    from transformers.cache_utils import CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin

    layers = DynamicCache(config=config).layers if layers is None else layers
    return (tuple(i for i, layer in enumerate(layers) if isinstance(layer, CacheLayerMixin)),
            tuple(i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)))


def state_layout(model: PreTrainedModel, cache_argument: str, ring_len: int | None = None) -> StateLayout:
    """The model's layers as transformers' own cache lays them out: layers
    with linear-attention state (conv, SSM, delta-net) learn their state's
    shapes from one small forward with that cache (on the model's own
    attention). ``ring_len``: the context, where window layers keep a ring
    of their window (if it is shorter) instead of pages."""
    from transformers.cache_utils import DynamicCache

    config = model.config.get_text_config()
    layers = DynamicCache(config=config).layers
    attention, linear = layer_kinds(config, layers)
    ring = None if ring_len is None else ring_layers(layers, ring_len, chunked_layers(config))
    if ring is not None:
        if linear:
            raise ValueError(f"{type(model).__name__} has window layers beside linear-attention ones, which "
                             "aoti_sessions does not keep in rings together; export it with window_cache='full'")
        kv = kv_layout(config, 1)
        if kv.is_latent:
            raise ValueError(f"{type(model).__name__} has window layers of latent attention, which aoti_sessions "
                             "does not keep in rings; export it with window_cache='full'")
        return StateLayout(attention=tuple(i for i in attention if i not in ring.layers), ring=ring,
                           slots=(("ring", (2, ring.window, kv.heads, kv.width), model.dtype),))
    if not linear:
        return StateLayout(attention=tuple(range(int(config.num_hidden_layers))))
    # (attention is empty for a pure state-space model such as Mamba2: its pool's pages then hold nothing.)
    cache = DynamicCache(config=config)
    name = type(model).__name__
    with attention_as(model, "sdpa" if attention else None), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long, device=model.device), **{cache_argument: cache},
              use_cache=True)
    slots = []
    for kind in ("conv_states", "recurrent_states"):
        found = [getattr(cache.layers[i], kind).get(0) for i in linear]
        if all(t is None for t in found):
            continue
        shapes = {(tuple(t.shape[1:]), t.dtype) for t in found if t is not None}
        if len(shapes) != 1 or any(t is None for t in found):
            raise ValueError(f"{name}'s layers keep {kind.replace('_', ' ')} of different shapes "
                             f"({sorted(str(s) for s in shapes)}); the pool has one layout per state")
        (shape, dtype), = shapes
        slots.append(("conv" if kind == "conv_states" else "recurrent", shape, dtype))
    return StateLayout(attention=attention, recurrent=linear, slots=tuple(slots))


def chunked_layers(config: Any) -> frozenset[int]:
    """The layers that attend within chunks of ``attention_chunk_size``
    positions (Llama 4's, by its ``layer_types``)."""
    types = getattr(config, "layer_types", None) or ()
    return frozenset(i for i, kind in enumerate(types) if kind == "chunked_attention")


def chunk_of(module: torch.nn.Module) -> int:
    """The chunk an attention module's layer attends within (0: none)."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or not isinstance(layer, int) or layer not in chunked_layers(config):
        return 0
    return int(config.attention_chunk_size)


@contextmanager
def attention_as(model: PreTrainedModel, implementation: str | None) -> Iterator[None]:
    """``model`` on attention ``implementation`` for the block (None: as it is)."""
    if implementation is None:
        yield
        return
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
