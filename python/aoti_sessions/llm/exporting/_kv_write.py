"""The work between a decode step's q/k/v projection and its attention, in
one kernel (issue 38: Inductor leaves it as two to four kernels a layer):
the per-head q/k RMSNorms (Qwen3's; none for Llama, Mistral, Qwen2), the
rotary embedding of queries and keys, and the write of the new keys and
values into the row's page of the pooled cache.

``rotary_kv_write(qkv, cos, sin, kv, page, offset, layer, q_heads,
kv_heads, q_norm, k_norm, eps)`` is the entry point: ``qkv [M, (Hq + 2 *
Hkv) * D]`` is the fused projection's output (queries, keys, values, head
by head, as ``_fused.py`` concatenates them); ``cos``, ``sin [M, D]`` the
rows' rotary tables (transformers' ``position_embeddings``); ``kv`` the pool
``[pages, layers, 2, page_size, Hkv, D]`` (``_paged_layout.py``), whose
``kv[page[m], layer, 0 | 1, offset[m]]`` receives row ``m``'s keys and
values; ``q_norm``, ``k_norm [D]`` or None. It returns the queries ``[M,
Hq, D]``, normalized and rotated. Rounded as transformers' code rounds
(``RMSNorm``: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``; rotary:
``(x * cos) + (rotate_half(x) * sin)``, each product and the sum in the
dtype).

On CUDA tensors (where triton is installed) it calls the custom op
``torch.ops.aoti_sessions.rotary_kv_write``, a Triton kernel registered with
``torch.library.triton_op`` as mutating ``kv`` (the pool itself, never a
view of it, so AOTInductor writes it in place); elsewhere
:func:`rotary_kv_write_reference`, plain PyTorch with the same rounding,
writing the pool with ``index_put_`` as the cache does. One program a
(row, head): a head of D values is normalized and rotated in registers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
# By this name: triton_op finds an op's kernels by reading its source for calls to ``wrap_triton(kernel)``.
from torch.library import wrap_triton

from ._gemv import rms_norm_reference
from ._triton import tl, triton

__all__ = ["rotary_kv_write", "rotary_kv_write_reference", "rotate_reference", "OP_NAME", "HAS_TRITON_OP"]

OP_NAME = "aoti_sessions::rotary_kv_write"


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: ``x [M, H, D]``, ``cos``, ``sin [M, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None]) + (rotated * sin[:, None])


def rotary_kv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                              page: torch.Tensor, offset: torch.Tensor, layer: int, q_heads: int, kv_heads: int,
                              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                              eps: float = 1e-6) -> torch.Tensor:
    """The op in plain PyTorch: the CPU path and the kernel's reference."""
    head_dim = _check(qkv, cos, sin, kv, page, offset, layer, q_heads, kv_heads, q_norm, k_norm)
    q, k, v = torch.split(qkv.reshape(qkv.shape[0], -1, head_dim), [q_heads, kv_heads, kv_heads], dim=1)
    if q_norm is not None:
        q = rms_norm_reference(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm_reference(k, k_norm, eps)
    q, k = rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)
    # index_put_ on the pool itself, one index tensor a dimension, as the cache writes (_paged.py).
    layers = torch.full_like(page, layer)
    kv.index_put_((page, layers, torch.zeros_like(page), offset), k)
    kv.index_put_((page, layers, torch.ones_like(page), offset), v)
    return q


def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, page: torch.Tensor,
                    offset: torch.Tensor, layer: int, q_heads: int, kv_heads: int, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The Triton op on CUDA tensors (where triton is installed), the
    reference otherwise. Traceable by ``torch.export`` either way."""
    if qkv.is_cuda and HAS_TRITON_OP:
        out: torch.Tensor = torch.ops.aoti_sessions.rotary_kv_write(qkv, cos, sin, kv, page, offset, int(layer),
                                                                    int(q_heads), int(kv_heads), q_norm, k_norm,
                                                                    float(eps))
        return out
    return rotary_kv_write_reference(qkv, cos, sin, kv, page, offset, layer, q_heads, kv_heads, q_norm, k_norm, eps)


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, page: torch.Tensor,
           offset: torch.Tensor, layer: int, q_heads: int, kv_heads: int, q_norm: torch.Tensor | None,
           k_norm: torch.Tensor | None) -> int:
    """Static checks only (the rows may be symbolic in an export); returns the head dim."""
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(f"rotary_kv_write takes the pool kv [pages, layers, 2, page_size, kv_heads, head_dim], "
                         f"got {tuple(kv.shape)}")
    head_dim = int(kv.shape[-1])
    if not 0 <= layer < kv.shape[1] or q_heads < 1 or kv_heads != kv.shape[4] or q_heads % kv_heads:
        raise ValueError(f"rotary_kv_write: layer {layer} of {kv.shape[1]}, {q_heads} query heads over {kv_heads} "
                         f"kv heads, for a pool of {kv.shape[4]} kv heads")
    if head_dim % 2 or qkv.dim() != 2 or qkv.shape[1] != (q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"rotary_kv_write takes qkv [M, {(q_heads + 2 * kv_heads) * head_dim}] (queries, keys, values "
                         f"of head_dim {head_dim}, even), got {tuple(qkv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or t.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [M, {head_dim}] in {qkv.dtype}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("page", page), ("offset", offset)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [M], got {t.dtype} {tuple(t.shape)}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (tuple(w.shape) != (head_dim,) or w.dtype != qkv.dtype):
            raise ValueError(f"{name} must be [{head_dim}] in {qkv.dtype}, got {w.dtype} {tuple(w.shape)}")
    if kv.dtype != qkv.dtype:
        raise ValueError(f"the pool's dtype {kv.dtype} is not qkv's {qkv.dtype}")
    return head_dim


def _launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, page: torch.Tensor,
            offset: torch.Tensor, layer: int, q_heads: int, kv_heads: int, q_norm: torch.Tensor | None,
            k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The kernel through ``wrap_triton`` (traced into the graph under export, a plain launch in eager mode)."""
    head_dim = _check(qkv, cos, sin, kv, page, offset, layer, q_heads, kv_heads, q_norm, k_norm)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or kv.stride(5) != 1:
        raise ValueError("rotary_kv_write needs qkv, cos, sin and the pool contiguous in their last dimension")
    rows = qkv.shape[0]
    q = torch.empty((rows, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    wrap_triton(_rotary_kv_kernel)[(rows, q_heads + 2 * kv_heads)](
        qkv, cos, sin, kv, page, offset, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, q,
        float(eps), qkv.stride(0), cos.stride(0), sin.stride(0), kv.stride(0), kv.stride(1), kv.stride(2),
        kv.stride(3), kv.stride(4), layer,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=half, BLOCK=1 << (half - 1).bit_length(),
        Q_NORM=q_norm is not None, K_NORM=k_norm is not None, num_warps=1)
    return q


if TYPE_CHECKING:
    _rotary_kv_kernel: Any

# triton is optional (CPU installs have none): without it rotary_kv_write always takes the reference path.
HAS_TRITON_OP = False
if not TYPE_CHECKING:
    if triton is not None:
        @triton.jit
        def _rms_norm(x1, x2, W, d, mask, eps, HALF: tl.constexpr):
            """A head's two halves normalized, rounded where transformers' RMSNorm rounds."""
            dtype = x1.dtype
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = tl.math.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / (2 * HALF) + eps)
            w1 = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(W + HALF + d, mask=mask, other=0.0).to(tl.float32)
            return (w1 * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype), \
                (w2 * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype)

        @triton.jit
        def _rotary_kv_kernel(QKV, COS, SIN, KV, PAGE, OFFSET, QW, KW, Q, eps, stride_qkv, stride_cos, stride_sin,
                              s_page, s_layer, s_part, s_pos, s_head, layer, Q_HEADS: tl.constexpr,
                              KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                              Q_NORM: tl.constexpr, K_NORM: tl.constexpr):
            row = tl.program_id(0)
            head = tl.program_id(1)  # queries, then keys, then values
            dtype = Q.dtype.element_ty
            eps = tl.cast(eps, tl.float32)  # (AOTInductor passes Python floats as fp64)
            d = tl.arange(0, BLOCK)
            mask = d < HALF
            src = QKV + row.to(tl.int64) * stride_qkv + head * (2 * HALF)
            x1 = tl.load(src + d, mask=mask, other=0.0)
            x2 = tl.load(src + HALF + d, mask=mask, other=0.0)
            is_q = head < Q_HEADS
            kv_head = head - Q_HEADS
            is_v = kv_head >= KV_HEADS
            kv_head = tl.where(is_v, kv_head - KV_HEADS, kv_head)
            slot = KV + tl.load(PAGE + row) * s_page + layer * s_layer + tl.load(OFFSET + row) * s_pos \
                + kv_head * s_head
            if is_v:
                tl.store(slot + s_part + d, x1, mask=mask)
                tl.store(slot + s_part + HALF + d, x2, mask=mask)
            else:
                if is_q:
                    if Q_NORM:
                        x1, x2 = _rms_norm(x1, x2, QW, d, mask, eps, HALF)
                else:
                    if K_NORM:
                        x1, x2 = _rms_norm(x1, x2, KW, d, mask, eps, HALF)
                c1 = tl.load(COS + row * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
                c2 = tl.load(COS + row * stride_cos + HALF + d, mask=mask, other=0.0).to(tl.float32)
                s1 = tl.load(SIN + row * stride_sin + d, mask=mask, other=0.0).to(tl.float32)
                s2 = tl.load(SIN + row * stride_sin + HALF + d, mask=mask, other=0.0).to(tl.float32)
                f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
                # (x * cos) + (rotate_half(x) * sin), rotate_half(x) = (-x2, x1); each product and the sum rounded.
                y1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
                y2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
                if is_q:
                    dst = Q + (row.to(tl.int64) * Q_HEADS + head) * (2 * HALF)
                    tl.store(dst + d, y1, mask=mask)
                    tl.store(dst + HALF + d, y2, mask=mask)
                else:
                    tl.store(slot + d, y1, mask=mask)
                    tl.store(slot + HALF + d, y2, mask=mask)

        def _rotary_kv_write_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                                page: torch.Tensor, offset: torch.Tensor, layer: int, q_heads: int, kv_heads: int,
                                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
            return _launch(qkv, cos, sin, kv, page, offset, layer, q_heads, kv_heads, q_norm, k_norm, eps)

        # A second import of this module (a reload) finds the op registered.
        if not hasattr(torch.ops.aoti_sessions, "rotary_kv_write"):
            torch.library.triton_op(OP_NAME, mutates_args=("kv",))(_rotary_kv_write_op)
        HAS_TRITON_OP = True
