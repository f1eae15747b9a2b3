"""A transformers causal LM over a pooled, paged KV cache (docs/batching.md):
the module ``aoti_sessions.llm.export`` compiles.

Every layer's keys and values live in one pooled tensor the engine owns,
``kv[pages, layers, 2, page_size, kv_heads, head_dim]``: a session owns the
pages its positions fall in, listed in its row of ``page_table``. A model of
multi-head latent attention (DeepSeek-V2/V3, Kimi-K2: ``kv_lora_rank``) caches
one compressed latent and one rotary key per position, shared by every head,
side by side: ``kv[pages, layers, 1, page_size, 1, latent + rotary]``
(:class:`KVLayout`); its layer expands them into keys and values itself. The
model's own code runs unchanged; only its cache and its attention are ours:

- the cache writes each new position's keys and values into the row's page
  (``kv`` is an input the compiled model mutates in place);
- attention reads the rows' pages: on CUDA a decode step (one new position
  per row) calls the Triton paged-attention kernel, which reads only the
  positions each row holds; otherwise (prefill, and every step on the CPU)
  the row's pages are gathered and attended with a causal mask.

Prefill takes several sessions' chunks at once, right-padded with token id
-1 to the longest: a row's logits are those of its last real token. Padding
positions are written like real ones (the engine gave the row pages for all
``T``) and come after every real position of the row, so no real query
attends to them; the caller truncates the row to its real length afterwards.

Hybrid models (Qwen3-Next, Qwen3.5-MoE, LFM2: layers of linear attention
or short convolutions beside full attention) and pure state-space models
(Mamba2: no attention layer, so pages of nothing) keep those layers' fixed-size
state (conv and recurrent) in slot tensors, one slot a session
(``conv[slots, layers, ...]``, ``recurrent[slots, layers, ...]``, rows
addressed by ``slot_ids``); only the attention layers have pages. A call
reads each row's state from its slot and writes the state after its last
position back (the model's own update, in place or returned). That state
cannot rewind: a prefill call of such a model takes whole rows, never
padding (the spec says so, and the scheduler feeds it that way).

Rows of one call are independent sessions. Nothing here reads or writes a
position outside the rows' own pages: padding rows of a batch write the
engine's scratch page, and page-table entries past a row's pages point at the
engine's zero page.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from ._latent import absorbed_attention, latent_unexpanded, takes_latents
from ._one_row import OneRowPlan, one_row_kernels
from ._paged_attention import counters_for, paged_decode_attention
from ._paged_cache import Step, cache_class, current
from ._paged_layout import KVLayout, attention_as, chunk_of, chunked_layers, kv_layout, layer_kinds, \
    state_layout
from ._ring import RingStep
from .._spec import PAD_ID

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PagedLM", "ATTENTION", "PAD_ID", "paged_attention", "paged_attention_on"]

ATTENTION = "aoti_sessions_paged"  # the name our attention is registered under


# An attention module's query temperature by position, (floor, scale): the query is scaled by 1 + scale *
# log1p(floor((position + 1) / floor)) (Llama 4's layers without rotary positions). The layer computes it from
# its cache's length, one for every row; ours are the rows' own positions.
TEMPERATURE = "_aoti_sessions_temperature"


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention every layer runs while a PagedLM call is traced; returns [B, T, Hq, D] as
    transformers' attention functions do. ``s_aux``: a logit per head that joins every row's softmax and
    is then dropped (GPT-OSS's attention sinks)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step = current[-1]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    temperature = getattr(module, TEMPERATURE, None)
    if temperature is not None:
        floor, factor = temperature
        scales = torch.log1p(torch.floor((step.positions.float() + 1.0) / floor)) * factor + 1.0  # [B, T]
        query = (query * scales[:, None, :, None]).to(query.dtype)
    # Keys and values from the layer's ring (a window or chunked layer; Llama 4 names no window).
    ring = step.ring is not None and (bool(sliding_window)
                                      or getattr(module, "layer_idx", None) in step.ring.ring.layers)
    chunk = 0 if ring else chunk_of(module)
    if ring:
        assert step.ring is not None
        attention_mask = step.ring.mask
    elif (sliding_window or chunk) and not step.kernel and attention_mask is not None:
        # A window layer attends to the last `sliding_window` positions only (key > query - window, as
        # transformers' sliding masks), a chunked one to its query's chunk; the cache holds every
        # position, so the context is not cut to the window.
        keys = torch.arange(attention_mask.shape[-1], device=attention_mask.device)[None, None, :]
        queries = step.positions[:, :, None]
        seen = keys > queries - int(sliding_window) if sliding_window else \
            torch.div(keys, chunk, rounding_mode="floor") == torch.div(queries, chunk, rounding_mode="floor")
        attention_mask = attention_mask & seen[:, None]  # [B, 1, T, K]
    if takes_latents(module):  # a latent attention layer's decode (_latent.py)
        return absorbed_attention(module, query, key, value, attention_mask, scale), None
    if step.kernel and not ring:
        if step.counters is None or step.counters.shape[1] < key.shape[2]:
            step.counters = counters_for(query.shape[0], key.shape[2], query.device)
        out = paged_decode_attention(query[:, :, 0], key, value, step.page_table, step.lengths, scale,
                                     int(sliding_window or 0), float(softcap or 0.0), step.counters)
        return out[:, None], None
    if softcap or s_aux is not None:  # sdpa has neither (Gemma2, GPT-OSS): the plain computation
        groups = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = (query @ keys.transpose(-1, -2)).float() * scale
        if softcap:
            scores = float(softcap) * torch.tanh(scores / float(softcap))
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        if s_aux is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            sinks = s_aux.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out = weights.to(values.dtype) @ values
        return out.transpose(1, 2).contiguous(), None
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=False, **kwargs)
    return out, None


class PagedLM(torch.nn.Module):
    """``prefill`` and ``decode`` over the pooled cache (see the module's doc)."""

    def __init__(self, model: PreTrainedModel, page_size: int, max_pages: int, kernel: bool,
                 grouped_mm: bool = True, ring_len: int | None = None) -> None:
        super().__init__()
        # Whether AOTInductor compiles torch's grouped mm here (bfloat16 MoE
        # experts decode through it; else through batched matmuls).
        self.grouped_mm = grouped_mm
        self.model = model
        config = model.config.get_text_config()
        parameters = inspect.signature(model.forward).parameters
        # transformers 5.2x calls the argument ``cache``, earlier releases ``past_key_values``.
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        # ``ring_len``: the context, where window layers keep a ring of their window if it is shorter.
        self.state = state_layout(model, self.cache_argument, ring_len)
        # (A model with no layer in pages has no KV heads there: its pages are empty, [pages, 0, ...].)
        self.kv = kv_layout(config, page_size) if self.state.attention else KVLayout(parts=2, heads=1, width=1)
        self.page_size = page_size
        self.max_pages = max_pages
        # The paged kernel reads per-head keys and values within a sliding window at most: a latent layer
        # expands its positions into them itself, and a chunked layer kept in pages attends within its
        # chunk, so such models decode by gathering.
        chunked = chunked_layers(config) & set(self.state.attention)
        self.kernel = kernel and not self.kv.is_latent and not (
            chunked and int(config.attention_chunk_size) < max_pages * page_size)
        self.logits_to_keep = "logits_to_keep" in parameters
        self.layers = len(self.state.attention)  # the pool's layers: the attention layers'
        # Layers whose cache a traced call wrote: export checks the model used
        # the cache it was given (else sessions would keep no context).
        self.layers_written: set[int] = set()
        self.one_row: OneRowPlan | None = None  # decode_one's plan (_one_row.py)

    def pool_example(self, pages: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(pages, self.layers, self.kv.parts, self.page_size, self.kv.heads, self.kv.width,
                           dtype=dtype, device=device)

    def slot_examples(self, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The slot tensors (hybrid models; none otherwise), by input name."""
        return {name: torch.zeros(slots, self.state.slot_layers(name), *shape, dtype=dtype, device=device)
                for name, shape, dtype in self.state.slots}

    def _run(self, input_ids: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
             kernel: bool, slot_ids: torch.Tensor | None, slots: dict[str, torch.Tensor],
             real: torch.Tensor | None = None) -> torch.Tensor:
        """``real``: each row's real positions (prefill: the rest is padding, and each row's logits are
        its last real position's); None: all are (decode)."""
        rows, count = input_ids.shape
        pos = positions[:, None] + torch.arange(count, device=input_ids.device)  # [B, T]
        page = torch.gather(page_table, 1, torch.div(pos, self.page_size, rounding_mode="floor")).long()
        offset = pos % self.page_size
        ids = None if slot_ids is None else slot_ids.long()
        step = Step(kv, page_table, page.reshape(-1), offset.reshape(-1), positions + count, kernel, pos, slots, ids)
        if self.state.ring is not None:
            assert ids is not None
            step.ring = RingStep(self.state.ring, slots["ring"], ids, pos, real, in_place=real is None)
        if kernel:
            mask = None
        else:
            # The positions the page table holds (its width may be only the pages the rows hold).
            keys = torch.arange(page_table.shape[1] * self.page_size, device=input_ids.device)
            mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, K]: causal, own positions only
        extra: dict[str, Any] = {self.cache_argument: cache_class()(step, self.state, self.kv, self.layers_written)}
        if self.logits_to_keep:
            extra["logits_to_keep"] = 1 if real is None else 0  # (prefill: _pick_rows takes each row's last real one)
        current.append(step)
        try:
            out = self.model(input_ids=input_ids, position_ids=pos, attention_mask=mask, use_cache=True, **extra)
        finally:
            current.pop()
        for (name, layer), value in step.states.items():  # the rows' state after the call, into their slots
            # (The rings write theirs as they go: _ring.py.)
            assert step.slot_ids is not None
            target = slots[name]
            target.index_put_((step.slot_ids, torch.full_like(step.slot_ids, layer)), value.to(target.dtype))
        logits: torch.Tensor = out.logits
        return logits[:, -1, :]

    def _slots(self, slot_ids: torch.Tensor | None, conv: torch.Tensor | None, recurrent: torch.Tensor | None,
               ring: torch.Tensor | None) -> dict[str, torch.Tensor]:
        given = {name: t for name, t in (("conv", conv), ("recurrent", recurrent), ("ring", ring)) if t is not None}
        names = [name for name, _, _ in self.state.slots]
        if sorted(given) != sorted(names) or (names and slot_ids is None):
            raise TypeError(f"this model's calls take slot_ids and the slot tensors {names}, got {sorted(given)}")
        return given

    # The slot tensors (and slot_ids) are passed by name: a model has any of them.
    def prefill(self, input_ids: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
                slot_ids: torch.Tensor | None = None, conv: torch.Tensor | None = None,
                recurrent: torch.Tensor | None = None, ring: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T]: up to T new positions of each of B sessions,
        right-padded with PAD_ID (never for a hybrid model: its state would
        read the padding); logits [B, V] of each row's last real token."""
        real = input_ids != PAD_ID
        count = real.sum(1)
        with _pick_rows(self.model, count - 1):  # a row's last real token (every row has one)
            return self._run(torch.where(real, input_ids, 0), kv, page_table, positions, False, slot_ids,
                             self._slots(slot_ids, conv, recurrent, ring), real=count)

    def decode(self, input_ids: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
               slot_ids: torch.Tensor | None = None, conv: torch.Tensor | None = None,
               recurrent: torch.Tensor | None = None, ring: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, 1]: one new position for each of B sessions; logits [B, V]."""
        latent = latent_unexpanded(self.model) if self.kv.is_latent else nullcontext()
        with _batched_experts(self.model, self.grouped_mm), latent:
            return self._run(input_ids, kv, page_table, positions, self.kernel, slot_ids,
                             self._slots(slot_ids, conv, recurrent, ring))

    def decode_one(self, input_ids: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
        """decode for one row alone, its layers on the one-row kernels where ``one_row`` (``_one_row.py``'s
        plan, made before the trace: its checks run the model) puts them."""
        if self.one_row is None:
            raise RuntimeError("PagedLM.decode_one: set one_row = plan_one_row(model) first")
        with one_row_kernels(self.one_row):
            return self.decode(input_ids, kv, page_table, positions)


@contextmanager
def _batched_experts(model: PreTrainedModel, grouped_mm: bool) -> Iterator[None]:
    """A decode step's MoE experts as transformers' ``batched_mm`` (each token's experts' weights gathered,
    one batched matmul), where the model's own choice would be its grouped-mm fallback: a custom op that
    reads the token counts per expert on the host, which a CUDA graph cannot capture. A step decodes a few
    tokens, so gathering their experts costs about what reading them does. (bfloat16 weights keep torch's
    grouped mm, which needs no host, where ``grouped_mm`` says AOTInductor compiles it.)"""
    configs: dict[int, Any] = {id(m.config): m.config for m in model.modules()
                               if hasattr(m, "has_gate")
                               and hasattr(getattr(m, "config", None), "_experts_implementation_internal")
                               and (_expert_weights(m).dtype != torch.bfloat16 or not grouped_mm)}
    saved = {key: c._experts_implementation_internal for key, c in configs.items()}
    for c in configs.values():
        c._experts_implementation_internal = "batched_mm"
    try:
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation_internal = saved[key]


def _expert_weights(experts: torch.nn.Module) -> torch.Tensor:
    """An experts module's first projection (gate and up, or up alone)."""
    weights = experts.gate_up_proj if experts.has_gate else experts.up_proj
    assert isinstance(weights, torch.Tensor)
    return weights


@contextmanager
def _pick_rows(model: PreTrainedModel, last: torch.Tensor) -> Iterator[None]:
    """The model's output head applied to row ``r``'s position ``last[r]`` alone (the model's own code
    before and after it runs unchanged: a final soft-cap, a logit scale). The head's forward is swapped
    for the block, not the module: its weights keep their names, shared with decode."""
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output head to pick rows' logits from")
    original = head.forward
    own = head.__dict__.get("forward")  # a forward set on the module itself (a hook's), kept

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return original(hidden[rows, last][:, None])  # type: ignore[no-any-return]

    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own


@contextmanager
def paged_attention_on(model: PreTrainedModel) -> Iterator[None]:
    """``model`` running our attention (registered once) for the block (a
    model with no attention layer, such as Mamba2, as it is)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)
    attention, _ = layer_kinds(model.config.get_text_config())  # (window layers' rings included)
    with attention_as(model, ATTENTION if attention else None), _temperature_inattention_as(model):
        yield


@contextmanager
def _temperature_inattention_as(model: PreTrainedModel) -> Iterator[None]:
    """Llama 4's query temperature of its layers without rotary positions,
    which the layer takes from its cache's length (one for all rows, none in
    ours), applied by our attention from each row's positions instead."""
    tuned: list[Any] = [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)
             and not getattr(m, "use_rope", True) and hasattr(m, "floor_scale")]
    for m in tuned:
        m.attn_temperature_tuning = False
        setattr(m, TEMPERATURE, (float(m.floor_scale), float(m.attn_scale)))
    try:
        yield
    finally:
        for m in tuned:
            m.attn_temperature_tuning = True
            delattr(m, TEMPERATURE)
