"""Rotary positions in real arithmetic for the families whose transformers
code rotates with complex numbers (DeepSeek-V2 and Llama 4: angles made by
``torch.polar``, each head's adjacent channel pairs viewed as complex and
multiplied). AOTInductor on CUDA (torch 2.11) fails to compile
DeepSeek-V2's (``Tensor dtype mismatch! Expected: torch.float32, Got:
torch.int64``: Inductor handles a complex tensor as int64), and calls ATen
for complex products everywhere. The same rotation of a pair ``(a, b)`` by
``(cos, sin)``: ``(a cos - b sin, a sin + b cos)``, on float32 as the
model computes it, with its angles and attention scaling.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["real_rotary"]


def _rotated(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] (pairs of adjacent channels) rotated by ``cos_sin``
    [..., D/2, 2], broadcast against ``x``'s pairs; in ``x``'s dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_sin[..., 0], cos_sin[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)


def _heads_first(xq: torch.Tensor, xk: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's ``apply_rotary_emb``: ``xq``, ``xk`` [B, H, T, D]."""
    cos_sin = cos_sin.unsqueeze(1)
    return _rotated(xq, cos_sin), _rotated(xk, cos_sin)


def _heads_second(xq: torch.Tensor, xk: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's ``apply_rotary_emb``: ``xq``, ``xk`` [B, T, H, D]."""
    cos_sin = cos_sin[:, :, None]
    return _rotated(xq, cos_sin), _rotated(xk, cos_sin)


# The modules whose rotary embedding returns complex angles, and how their attention broadcasts them.
_COMPLEX: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "transformers.models.deepseek_v2.modeling_deepseek_v2": _heads_first,
    "transformers.models.llama4.modeling_llama4": _heads_second,
}


def _real_angles(rotary: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``rotary``'s forward, its angles as (cos, sin) pairs [B, T, D/2, 2]
    instead of complex numbers (its inverse frequencies kept up to date as
    transformers' own forward keeps them)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    @dynamic_rope_update  # type: ignore[untyped-decorator]
    def forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        cos_sin: torch.Tensor = torch.stack((angles.cos(), angles.sin()), dim=-1) * self.attention_scaling
        return cos_sin

    return types.MethodType(forward, rotary)


@contextmanager
def real_rotary(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s complex rotary positions (see the module's doc) computed
    in real arithmetic for the block; nothing changes for other families."""
    rotaries = [m for m in model.modules()
                if type(m).__module__ in _COMPLEX and type(m).__name__.endswith("RotaryEmbedding")
                and hasattr(m, "inv_freq")]
    modules = {type(m).__module__ for m in rotaries}
    saved = [(sys.modules[name], sys.modules[name].apply_rotary_emb) for name in modules]
    own = [(m, m.__dict__.get("forward")) for m in rotaries]  # a forward set on the module (a hook's) is put back
    for name in modules:
        setattr(sys.modules[name], "apply_rotary_emb", _COMPLEX[name])
    for m in rotaries:
        m.forward = _real_angles(m)
    try:
        yield
    finally:
        for module, original in saved:
            setattr(module, "apply_rotary_emb", original)
        for m, forward in own:
            if forward is None:
                del m.forward
            else:
                m.forward = forward
