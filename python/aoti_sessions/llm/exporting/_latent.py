"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) decoding with its
up-projection absorbed. The cache holds one latent ``c`` (``kv_lora_rank``
wide) and one rotary key ``r`` a position, shared by every head; the layer's
own code expands every position it attends to into each head's key ``[W_UK
c, r]`` and value ``W_UV c`` (``kv_b_proj``): at a context of K positions,
``K x kv_lora_rank x heads x (nope + value dims)`` multiply-adds a layer and
a step, the whole context projected again for one new query. Absorbed, the
query goes to the latent instead: ``score = (W_UK^T q_nope) . c + q_rope .
r``, ``out = W_UV (softmax . c)``, the same function in another order
(rounding apart), its cost a layer ``heads x K x (latent + rotary)``.

A decode call (one query a row) runs it: the layer's expansion is left out
(:func:`latent_unexpanded`), so attention receives the latents and rotary
keys themselves (:func:`absorbed_attention`). Prefill, many queries a row,
keeps the layer's own expansion.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["latent_unexpanded", "takes_latents", "absorbed_attention"]


def _latent_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_b_proj") and callable(getattr(m, "expand_kv", None))]


_UNEXPANDED = "_aoti_sessions_unexpanded"  # set on a latent layer while it hands attention its latents


@contextmanager
def latent_unexpanded(model: torch.nn.Module) -> Iterator[None]:
    """The model's latent attention layers hand attention their cached
    latents and rotary keys unexpanded, for the block."""
    layers = _latent_layers(model)
    own = [(m, m.__dict__.get("expand_kv")) for m in layers]
    for m in layers:
        m.expand_kv = lambda latent, rotary: (latent, rotary)  # type: ignore[assignment]
        setattr(m, _UNEXPANDED, True)
    try:
        yield
    finally:
        for m, expand in own:
            delattr(m, _UNEXPANDED)
            if expand is None:
                del m.expand_kv
            else:
                m.expand_kv = expand


def takes_latents(module: Any) -> bool:
    """Whether attention receives ``module``'s latents and rotary keys, not keys and values."""
    return bool(getattr(module, _UNEXPANDED, False))


def absorbed_attention(module: Any, query: torch.Tensor, latent: torch.Tensor, rotary: torch.Tensor,
                       mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """query [B, H, T, nope + rope], latent [B, 1, K, R], rotary [B, 1, K,
    rope], mask [B, 1, T, K] (True: attended): [B, T, H, value dim], as the
    layer's expanded attention computes it."""
    heads, nope, value_dim = query.shape[1], module.qk_nope_head_dim, module.v_head_dim
    up = module.kv_b_proj.weight.view(heads, nope + value_dim, latent.shape[-1])  # [H, nope + value, R]
    q_nope, q_rope = torch.split(query, [nope, query.shape[-1] - nope], dim=-1)
    q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, up[:, :nope])
    scores = (q_latent @ latent.transpose(-1, -2) + q_rope @ rotary.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(latent.dtype)
    out = torch.einsum("bhtr,hvr->bhtv", weights @ latent, up[:, nope:])  # [B, H, T, value dim]
    return out.transpose(1, 2).contiguous()
