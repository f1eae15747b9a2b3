"""Paged decode attention: one new query token per row against the KV pages the
row owns in a pooled cache (docs/batching.md).

``paged_decode_attention`` is the entry point. On CUDA tensors it calls the
custom op ``torch.ops.aoti_sessions.paged_decode_attention``, a pair of Triton
kernels registered with ``torch.library.triton_op``, so ``torch.export`` keeps
the op and AOTInductor compiles its kernels into the package; elsewhere (and
without triton) it runs ``paged_decode_reference``, plain PyTorch.

Shapes: ``q [B, Hq, D]``; ``k_pages``, ``v_pages [P, page_size, Hkv, D]``
(strided views of one pool, e.g. ``kv[:, layer, 0]``; only the last dimension
need be contiguous); ``page_table`` int32 ``[B, MP]``; ``seq_lens`` int64
``[B]``, the positions row ``b`` attends to, ``[0, seq_lens[b])`` (the new
token's K/V already written); the result is ``[B, Hq, D]`` in ``q``'s dtype.
Query head ``h`` reads kv head ``h // (Hq // Hkv)``.

The kernel splits each row's positions into chunks (flash-decoding): grid
``(B, Hkv, NUM_SPLITS)``, ``NUM_SPLITS`` fixed by the page table's width (a
static dimension in an export; B and P may be dynamic), so one captured CUDA
graph serves any ``seq_lens``; each program handles all
query heads of one kv head over one chunk and writes a partial softmax
(max, sum, weighted values) to scratch, then counts itself done on
``counters[b, kv head]`` (an atomic add, acquire-release); the program that
counts last merges the row's partials for its query heads and sets the
counter back to zero. One kernel a layer, where a second kernel launched
after the first merged them before (issue 38: fewer launches a decode
step). ``counters`` is int32 ``[B, >= Hkv]`` of zeros, and zeros again
after every call, so one tensor serves every layer of a step (export makes
one a step: ``_paged.py``). Only positions below ``seq_lens[b]`` (and
inside the sliding window) are loaded, so pages the row does not own are
never read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
# By this name: triton_op finds an op's kernels (for its compile cache keys)
# by reading its source for calls to ``wrap_triton(kernel)``.
from torch.library import wrap_triton

from ._triton import tl, triton

__all__ = ["paged_decode_attention", "paged_decode_reference", "OP_NAME", "HAS_TRITON_OP",
           "POSITIONS_PER_SPLIT", "MAX_SPLITS", "BLOCK_N", "NUM_WARPS_SMALL_D", "NUM_WARPS_LARGE_D", "NUM_STAGES"]

OP_NAME = "aoti_sessions::paged_decode_attention"
# Positions per program: ~64 gives a B=1 step enough programs to fill a GPU
# (a 1024-position row is 16 chunks per kv head) while the merge reads few
# partials. Past MAX_SPLITS chunks the chunks grow instead, bounding the
# merge's work and the number of programs that exit at once for short rows.
POSITIONS_PER_SPLIT = 64
MAX_SPLITS = 128
# Positions per loop iteration of a program (a power of two, at least 16 for
# tl.dot; with pages of 16 or fewer positions it covers whole pages).
BLOCK_N = 64
# Warps of the split kernel: 4 up to head_dim 64; 8 above, where 4 warps
# need ~250 registers a thread (ptxas, sm_90, BLOCK_N 64) and 8 need 128.
# One stage: a program's loop mostly runs once or twice, nothing to pipeline.
NUM_WARPS_SMALL_D, NUM_WARPS_LARGE_D, NUM_STAGES = 4, 8, 1
# tl.dot's smallest M: the query heads sharing a kv head are padded to it.
_MIN_DOT = 16


def paged_decode_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """The op in plain PyTorch (float32 inside): gathers every row's whole
    page table, then masks what the row may not see. The CPU path, the
    export fallback, and the kernels' correctness reference."""
    _check_shapes(q, k_pages, v_pages, page_table, seq_lens)
    hq, d = q.shape[1], q.shape[2]
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    pos = torch.arange(page_table.shape[1] * page_size, device=q.device)  # [N], every position the table can hold
    pages = page_table.long()[:, pos // page_size]  # [B, N]
    valid = pos[None, :] < seq_lens[:, None]  # [B, N]
    if sliding_window > 0:
        valid = valid & (pos[None, :] >= seq_lens[:, None] - sliding_window)
    # Gathered positions past a row's length come from pages it may not own:
    # zero them (not just their weights), since 0 * NaN would leak garbage.
    keep = valid[:, :, None, None]
    k = torch.where(keep, k_pages[pages, pos % page_size].float(), 0.0)  # [B, N, Hkv, D]
    v = torch.where(keep, v_pages[pages, pos % page_size].float(), 0.0)
    qg = q.float().reshape(q.shape[0], hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bnhd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(q.shape[0], hq, d).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                           softcap: float = 0.0, counters: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op on CUDA tensors (where triton is installed), the
    reference otherwise. Traceable by ``torch.export`` either way.
    ``counters``: the kernel's (see the module's doc; :func:`counters_for`),
    made for this call where not given."""
    if q.is_cuda and HAS_TRITON_OP:
        if counters is None:
            counters = counters_for(q.shape[0], k_pages.shape[2], q.device)
        out: torch.Tensor = torch.ops.aoti_sessions.paged_decode_attention(
            q, k_pages, v_pages, page_table, seq_lens, scale, sliding_window, softcap, counters)
        return out
    return paged_decode_reference(q, k_pages, v_pages, page_table, seq_lens, scale, sliding_window, softcap)


def counters_for(rows: int | torch.SymInt, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for calls of ``rows`` rows of up to ``kv_heads`` kv heads."""
    return torch.zeros((rows, kv_heads), dtype=torch.int32, device=device)


def _check_shapes(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """Checks on the static dimensions and dtypes only: comparing the batch
    dimensions would guard on symbolic sizes during export."""
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"paged attention takes q [B, Hq, D] and k/v pages [P, page_size, Hkv, D] of one shape, "
                         f"got q {tuple(q.shape)}, k {tuple(k_pages.shape)}, v {tuple(v_pages.shape)}")
    hq, d, hkv = q.shape[1], q.shape[2], k_pages.shape[2]
    if k_pages.shape[3] != d or hq % hkv != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of the kv heads ({hkv}) and head dims must match "
                         f"(q {d}, kv {k_pages.shape[3]})")
    if page_table.dtype != torch.int32 or page_table.dim() != 2:
        raise ValueError(f"page_table must be int32 [B, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    if seq_lens.dtype != torch.int64 or seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be int64 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")


def _plan(max_positions: int, block_n: int, split: int | None) -> tuple[int, int]:
    """(positions per split, number of splits) for a page table of
    ``max_positions``: fixed at trace time, whatever the rows' lengths."""
    if split is None:
        split = max(POSITIONS_PER_SPLIT, -(-max_positions // MAX_SPLITS))
    split = -(-split // block_n) * block_n  # whole loop iterations per chunk
    return split, max(1, -(-max_positions // split))


def _launch(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, sliding_window: int = 0, softcap: float = 0.0,
            counters: torch.Tensor | None = None, *, split: int | None = None, block_n: int | None = None,
            num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The kernel, launched through ``wrap_triton`` (traced into the graph
    under export, a plain launch in eager mode). ``split``, ``block_n``,
    ``num_warps`` and ``num_stages`` override the defaults (tests, tuning)."""
    _check_shapes(q, k_pages, v_pages, page_table, seq_lens)
    if counters is None:
        counters = counters_for(q.shape[0], k_pages.shape[2], q.device)
    # (Static checks only: is_contiguous() would guard the symbolic rows against 1 in an export.)
    if counters.dtype != torch.int32 or counters.dim() != 2 or counters.shape[1] < k_pages.shape[2] \
            or counters.stride(1) != 1:
        raise ValueError(f"counters must be int32 [B, >= {k_pages.shape[2]}] (the kv heads), contiguous in "
                         f"the kv heads, got {counters.dtype} {tuple(counters.shape)}")
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("k_pages and v_pages must be contiguous in their last dimension (head_dim)")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"q, k_pages and v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if q.stride(2) != 1:
        q = q.contiguous()
    page_table = page_table.contiguous()
    seq_lens = seq_lens.contiguous()
    batch, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    g = hq // hkv
    block_n = block_n or BLOCK_N
    if block_n < _MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least {_MIN_DOT}, got {block_n}")
    split, num_splits = _plan(int(page_table.shape[1]) * int(page_size), block_n, split)
    d_pad = max(_MIN_DOT, 1 << (int(d) - 1).bit_length())  # head dims like 80 or 96 load masked
    # Each (row, query head, chunk)'s partial: running max (log2 units), sum of weights, weighted values.
    m = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    sums = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    acc = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, hq, d), dtype=q.dtype, device=q.device)
    num_warps = num_warps or (NUM_WARPS_SMALL_D if d_pad <= 64 else NUM_WARPS_LARGE_D)
    wrap_triton(_split_kernel)[(batch, hkv, num_splits)](
        q, k_pages, v_pages, page_table, seq_lens, m, sums, acc, counters, out,
        float(scale), float(softcap), int(sliding_window),
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), page_table.stride(0), counters.stride(0),
        out.stride(0), out.stride(1),
        G=g, G_PAD=max(_MIN_DOT, 1 << (g - 1).bit_length()), HQ=hq, HEAD_DIM=d, D_PAD=d_pad, PAGE=page_size,
        BLOCK_N=block_n, SPLIT=split, NUM_SPLITS=num_splits, S_PAD=1 << (num_splits - 1).bit_length(),
        WINDOW=sliding_window > 0, SOFTCAP=softcap > 0,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages or NUM_STAGES)
    return out


if TYPE_CHECKING:
    _split_kernel: Any

# triton is optional (CPU installs have none): without it the kernels and the
# op do not exist and paged_decode_attention always takes the reference path.
# Kept from mypy, which can type neither triton (no stubs) nor kernel bodies.
HAS_TRITON_OP = False
if not TYPE_CHECKING:
    if triton is not None:
        @triton.jit
        def _split_kernel(Q, K, V, PT, SL, M_OUT, L_OUT, ACC_OUT, CNT, OUT, scale, softcap, window,
                          stride_qb, stride_qh, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
                          stride_pt, stride_cnt, stride_ob, stride_oh, G: tl.constexpr, G_PAD: tl.constexpr,
                          HQ: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          S_PAD: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
            b = tl.program_id(0)
            kvh = tl.program_id(1)
            s = tl.program_id(2)
            # AOTInductor passes Python floats as fp64: keep the math in fp32.
            scale = tl.cast(scale, tl.float32)
            softcap = tl.cast(softcap, tl.float32)
            seq_len = tl.load(SL + b).to(tl.int32)
            lo = 0
            if WINDOW:
                lo = tl.maximum(seq_len - window, 0)
            start = tl.maximum(s * SPLIT, lo)
            end = tl.minimum(s * SPLIT + SPLIT, seq_len)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            offs_n = tl.arange(0, BLOCK_N)
            g_mask = offs_g < G
            d_mask = offs_d < HEAD_DIM
            heads = kvh * G + offs_g
            base = (b * HQ + heads) * NUM_SPLITS  # [G_PAD], each query head's partials
            part = base + s  # this chunk's
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D_PAD], tl.float32)
            # A chunk past the row's end (or before its window) loops none: an empty partial.
            q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
            for n0 in range(start, end, BLOCK_N):
                pos = n0 + offs_n
                valid = pos < end
                # Each position's own page: a block may span pages, and pages
                # past the row's end are never dereferenced (masked).
                page = tl.load(PT + b * stride_pt + pos // PAGE, mask=valid, other=0).to(tl.int64)
                slot = pos % PAGE
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(K + (page * stride_kp + slot * stride_ko + kvh * stride_kh)[:, None] + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                # V's load issued with K's: both in flight while the scores are computed.
                v = tl.load(V + (page * stride_vp + slot * stride_vo + kvh * stride_vh)[:, None] + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                if IEEE:  # float32 inputs: no TF32 rounding of the scores
                    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(k))
                qk = qk * scale
                if SOFTCAP:  # softcap * tanh(qk / softcap), tanh from exp (saturates to +-1, no NaN)
                    qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
                qk = tl.where(valid[None, :], qk * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
                m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every block has a valid position
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            # An empty chunk writes nothing (the merge reads the chunks that saw positions alone): a
            # wide page table's many empty chunks would write a partial each, every layer, every row.
            live = g_mask & (offs_g * 0 + start < end)
            tl.store(M_OUT + part, m_i, mask=live)
            tl.store(L_OUT + part, l_i, mask=live)
            tl.store(ACC_OUT + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=live[:, None] & d_mask[None, :])
            # Every thread's stores issued before the count (a barrier), the count released with them; the
            # program that counts last acquires every chunk's, merges and sets the counter back to zero.
            tl.debug_barrier()
            counter = CNT + b * stride_cnt + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                # Only the chunks that saw positions (the others hold empty partials):
                # a short row in a wide page table merges a few.
                s_lo = lo // SPLIT
                s_hi = (seq_len + SPLIT - 1) // SPLIT
                offs_s = tl.arange(0, S_PAD)
                s_mask = (offs_s >= s_lo) & (offs_s < s_hi)
                gs_mask = g_mask[:, None] & s_mask[None, :]
                # (.cg: read from L2, where the other programs' partials are, not a stale L1 line.)
                ms = tl.load(M_OUT + base[:, None] + offs_s[None, :], mask=gs_mask, other=float("-inf"),
                             cache_modifier=".cg")
                m_max = tl.where(g_mask, tl.max(ms, 1), 0.0)
                ls = tl.load(L_OUT + base[:, None] + offs_s[None, :], mask=gs_mask, other=0.0, cache_modifier=".cg")
                total = tl.sum(ls * tl.exp2(ms - m_max[:, None]), 1)
                merged = tl.zeros([G_PAD, D_PAD], tl.float32)
                for c in range(s_lo, s_hi):
                    w = tl.exp2(tl.load(M_OUT + base + c, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
                                - m_max)
                    merged += w[:, None] * tl.load(ACC_OUT + (base + c)[:, None] * HEAD_DIM + offs_d[None, :],
                                                   mask=g_mask[:, None] & d_mask[None, :], other=0.0,
                                                   cache_modifier=".cg")
                total = tl.where(g_mask, total, 1.0)
                tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         (merged / total[:, None]).to(OUT.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
                tl.atomic_xchg(counter, 0)  # for the next call (the next layer)

        def _paged_decode_op(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float, sliding_window: int, softcap: float,
                             counters: torch.Tensor) -> torch.Tensor:
            return _launch(q, k_pages, v_pages, page_table, seq_lens, scale, sliding_window, softcap, counters)

        # A second import of this module (a reload) finds the op registered:
        # registering a name twice raises, and the first registration is the same op.
        if not hasattr(torch.ops.aoti_sessions, "paged_decode_attention"):
            torch.library.triton_op(OP_NAME, mutates_args=("counters",))(_paged_decode_op)
        HAS_TRITON_OP = True
