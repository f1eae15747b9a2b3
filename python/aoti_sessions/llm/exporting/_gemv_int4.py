"""decode_one's projections on int4 weights as torchao's int4 weight-only
packages hold them (``_quantize.py``'s int4wo: ``Int4TilePackedTo4dTensor``,
the tiles of torch's tinygemm kernel ``_weight_int4pack_mm``), read in those
tiles by a Triton kernel of our own: a step reads a quarter of bf16's bytes,
in one kernel with the norm before and SiLU-mul or the residual add after
(as ``_gemv.decode_linear``; issue 38).

``decode_linear_int4(x, qdata, scale_zero, bias, norm_weight, eps, silu_mul,
residual)``: ``x [M, K]``; ``qdata`` int32 ``[N / 8, K' / 128, 32, 4]`` (K'
is K padded to a multiple of 1024, as torchao pads it); ``scale_zero``
``[K' / 128, N, 2]`` in ``x``'s dtype, a scale and a zero a group of 128
inputs; the weight is ``(q - 8) * scale + zero``. Groups of 128 alone
(``_quantize.INT4_GROUP``).

The tile layout, from torch's ``_convert_weight_to_int4pack`` (CUDA,
``matrix_to_m16n8k16_Bint4_layout``, 8 inner k-tiles): int32 word
``qdata[t8, ko, t, j]`` holds eight 4-bit values of weight row
``n = 8 t8 + t // 4``; its nibble ``p`` (bits ``4p .. 4p + 3``) is input
``k = 128 ko + 32 j + 2 (t % 4) + 8 (p % 4) + p // 4``. So the 128 words of
one ``(t8, ko)`` are 8 rows x 16 words, and a row's 16 words over 8 nibbles
hold its 128 inputs of that group (:func:`unpack_int4_tiles`).

Rounding: torchao's int4 linear rounds tinygemm's product to the dtype, then
adds the bias; the kernel sums ``scale * sum((q - 8) x) + zero * sum(x)`` a
group in float32 (the reference dequantizes in float32), so it
agrees with tinygemm within the dtype's rounding of the sums, not bit for bit.
A program's rows need not be a tile's; the groups of K's padding are not read.

On CUDA tensors (triton installed): the custom op
``torch.ops.aoti_sessions.decode_linear_int4`` (``torch.library.triton_op``,
kept by ``torch.export``, compiled into the package by AOTInductor); elsewhere
:func:`decode_linear_int4_reference`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
# By this name: triton_op finds an op's kernels by reading its source for calls to ``wrap_triton(kernel)``.
from torch.library import wrap_triton

from ._gemv import check_around, epilogue_reference, rms_norm_reference
from ._triton import tl, triton

__all__ = ["decode_linear_int4", "decode_linear_int4_reference", "unpack_int4_tiles", "GROUP", "HAS_TRITON_OP"]

GROUP = 128  # inputs a scale and zero (and a tile's k: 8 inner k-tiles of 16)


def unpack_int4_tiles(qdata: torch.Tensor) -> torch.Tensor:
    """The 4-bit values (0..15, int32) ``[N, K']`` that ``qdata``'s tiles hold (see the module's doc)."""
    tiles, outer = int(qdata.shape[0]), int(qdata.shape[1])
    nibbles = (qdata.unsqueeze(-1) >> (4 * torch.arange(8, device=qdata.device, dtype=torch.int32))) & 0xF
    # [t8, ko, t // 4, t % 4, j, p // 4, p % 4] -> [t8, t // 4, ko, j, p % 4, t % 4, p // 4]: n and k in order.
    nibbles = nibbles.reshape(tiles, outer, 8, 4, 4, 2, 4).permute(0, 2, 1, 4, 6, 3, 5)
    return nibbles.reshape(tiles * 8, outer * GROUP)


def decode_linear_int4_reference(x: torch.Tensor, qdata: torch.Tensor, scale_zero: torch.Tensor,
                                 bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                                 eps: float = 1e-6, silu_mul: bool = False,
                                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """The op in plain PyTorch (the CPU path and the kernel's reference): the weight dequantized in float32."""
    _check(x, qdata, scale_zero, bias, norm_weight, silu_mul, residual)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    k = x.shape[1]
    scale = scale_zero[..., 0].t().float().repeat_interleave(GROUP, dim=1)[:, :k]
    zero = scale_zero[..., 1].t().float().repeat_interleave(GROUP, dim=1)[:, :k]
    weight = (unpack_int4_tiles(qdata)[:, :k].float() - 8) * scale + zero
    y = (x.float() @ weight.t()).to(x.dtype)  # (tinygemm's product, rounded)
    y = y if bias is None else y + bias
    return epilogue_reference(y, silu_mul, residual)


def decode_linear_int4(x: torch.Tensor, qdata: torch.Tensor, scale_zero: torch.Tensor,
                       bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op on CUDA tensors (where triton is installed), the
    reference otherwise. Traceable by ``torch.export`` either way."""
    if x.is_cuda and HAS_TRITON_OP:
        out: torch.Tensor = torch.ops.aoti_sessions.decode_linear_int4(x, qdata, scale_zero, bias, norm_weight,
                                                                       float(eps), silu_mul, residual)
        return out
    return decode_linear_int4_reference(x, qdata, scale_zero, bias, norm_weight, eps, silu_mul, residual)


def _check(x: torch.Tensor, qdata: torch.Tensor, scale_zero: torch.Tensor, bias: torch.Tensor | None,
           norm_weight: torch.Tensor | None, silu_mul: bool, residual: torch.Tensor | None) -> None:
    """Static checks only (the rows may be symbolic in an export)."""
    if x.dim() != 2 or qdata.dim() != 4 or qdata.dtype != torch.int32 or tuple(qdata.shape[2:]) != (32, 4):
        raise ValueError(f"decode_linear_int4 takes x [M, K] and int32 tiles [N / 8, K' / 128, 32, 4], got x "
                         f"{tuple(x.shape)}, tiles {qdata.dtype} {tuple(qdata.shape)}")
    n, k, outer = int(qdata.shape[0]) * 8, int(x.shape[1]), int(qdata.shape[1])
    padded = outer * GROUP
    if padded % 1024 or not padded - 1024 < k <= padded:
        raise ValueError(f"x's {k} inputs do not fit tiles of {padded} inputs (K padded to a multiple of 1024)")
    if tuple(scale_zero.shape) != (outer, n, 2) or scale_zero.dtype != x.dtype:
        raise ValueError(f"scale_zero must be [{outer}, {n}, 2] in {x.dtype} (a scale and zero a group of {GROUP}), "
                         f"got {scale_zero.dtype} {tuple(scale_zero.shape)}")
    if silu_mul and n % 16:
        raise ValueError(f"silu_mul needs a weight of two halves (gate; up) of whole tiles, got {n} rows")
    check_around(x, n, bias, norm_weight, silu_mul, residual)


def _config(silu_mul: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_G, num_warps): weight rows a program (any number: the addressing is a row's own) and
    groups of 128 inputs a step. ``bench/probe_gemv.py --int4 --quick`` at the Qwen3-4B projections on an
    H200 (bench/results/decode_cuda.md, stop 56; the kernel then reduced each nibble's products apart): 16
    rows for gate/up with SiLU-mul, 8 for the others, 4 groups a step on 4 warps, fastest of the 8-16 rows x
    2-4 groups it tried (4 rows, 8 groups, the first guess, averaged 37.5 us a launch in the model: 1.5-2x
    slower)."""
    return (16, 4, 4) if silu_mul else (8, 4, 4)


def _launch(x: torch.Tensor, qdata: torch.Tensor, scale_zero: torch.Tensor, bias: torch.Tensor | None,
            norm_weight: torch.Tensor | None, eps: float, silu_mul: bool, residual: torch.Tensor | None = None,
            *, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The kernel through ``wrap_triton``; ``config`` overrides :func:`_config` (the probe, tests)."""
    _check(x, qdata, scale_zero, bias, norm_weight, silu_mul, residual)
    if not qdata.is_contiguous() or not scale_zero.is_contiguous() or x.stride(1) != 1 \
            or (residual is not None and residual.stride(1) != 1):
        raise ValueError("decode_linear_int4 needs qdata and scale_zero contiguous, x and residual in their last "
                         "dimension")
    n, k, outer = int(qdata.shape[0]) * 8, int(x.shape[1]), int(qdata.shape[1])
    n_out = n // 2 if silu_mul else n
    rows = x.shape[0]
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    block_n, block_g, warps = config or _config(silu_mul)
    wrap_triton(_int4_kernel)[(triton.cdiv(n_out, block_n), rows)](
        x, qdata, scale_zero, x if bias is None else bias, x if norm_weight is None else norm_weight,
        out if residual is None else residual, out, float(eps), x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        K=k, GROUPS=triton.cdiv(k, GROUP), OUTER=outer, N=n, N_OUT=n_out, NORM=norm_weight is not None,
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, RESIDUAL=residual is not None, BLOCK_N=block_n,
        BLOCK_G=block_g, num_warps=warps)
    return out


if TYPE_CHECKING:
    _int4_kernel: Any

HAS_TRITON_OP = False
if not TYPE_CHECKING:
    if triton is not None:
        # _gemv's jit helpers (defined where triton is), by these names: the kernel finds them among its globals.
        from ._gemv import finish, load_normed, rms_rstd, round_sums

        @triton.jit
        def _int4_kernel(X, Q, SZ, B, NW, R, Y, eps, stride_xm, stride_rm, stride_ym, K: tl.constexpr,
                         GROUPS: tl.constexpr, OUTER: tl.constexpr, N: tl.constexpr, N_OUT: tl.constexpr,
                         NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
            pid = tl.program_id(0)
            row = tl.program_id(1)
            dtype = Y.dtype.element_ty
            eps = tl.cast(eps, tl.float32)  # (AOTInductor passes Python floats as fp64)
            x_row = X + row * stride_xm
            rstd = 1.0
            if NORM:
                rstd = rms_rstd(x_row, eps, K, 1024)
            offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N_OUT
            # A row's 16 words of a group: m = 4 (t % 4) + j; nibble p is input 32 j + 2 (t % 4) + 8 (p % 4) + p // 4.
            m = tl.arange(0, 16)
            g = tl.arange(0, BLOCK_G)
            # Word (row n, group ko, m): ((n // 8) * OUTER + ko) * 128 + (n % 8) * 16 + m.
            words_n = ((offs_n // 8) * OUTER * 128 + (offs_n % 8) * 16)[:, None, None]
            acc = tl.zeros([BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_N], tl.float32)
            for ko in range(0, GROUPS, BLOCK_G):  # (the groups of K's padding hold zeros' weights: skipped)
                groups = ko + g
                g_mask = groups < GROUPS
                at = words_n + (groups[None, :, None] * 128 + m[None, None, :])  # [BLOCK_N, BLOCK_G, 16]
                mask = n_mask[:, None, None] & g_mask[None, :, None]
                words = tl.load(Q + at, mask=mask, other=0)
                if SILU_MUL:  # the up projection's rows, N_OUT further (whole tiles: N_OUT % 8 == 0)
                    words_up = tl.load(Q + at + (N_OUT // 8) * OUTER * 128, mask=mask, other=0)
                # The step's inputs in one contiguous load, split in registers into the 8 nibbles' planes:
                # k = 32 j + 8 (p % 4) + 2 (t % 4) + p // 4 -> [group, m = 4 (t % 4) + j, p % 4, p // 4].
                kg = groups[:, None] * 128 + tl.arange(0, 128)[None, :]  # [BLOCK_G, 128]
                xg = load_normed(x_row, NW, kg, (kg < K) & g_mask[:, None], rstd, dtype, NORM)
                x_sum = tl.sum(xg, 1)
                xp = tl.reshape(tl.permute(tl.reshape(xg, [BLOCK_G, 4, 4, 4, 2]), (0, 3, 1, 2, 4)),
                                [BLOCK_G, 16, 2, 2, 2])  # (last: (p % 4) // 2, (p % 4) % 2, p // 4; split: the last)
                xh0, xh1 = tl.split(xp)  # p // 4
                xh0l0, xh0l1 = tl.split(xh0)  # (p % 4) % 2
                xh1l0, xh1l1 = tl.split(xh1)
                x0, x2 = tl.split(xh0l0)  # (p % 4) // 2: nibble p's inputs [BLOCK_G, 16]
                x1, x3 = tl.split(xh0l1)
                x4, x6 = tl.split(xh1l0)
                x5, x7 = tl.split(xh1l1)
                qx = _nibble_sums(words, x0, x1, x2, x3, x4, x5, x6, x7)
                if SILU_MUL:
                    qx_up = _nibble_sums(words_up, x0, x1, x2, x3, x4, x5, x6, x7)
                sz = (groups[None, :] * N + offs_n[:, None]) * 2  # [BLOCK_N, BLOCK_G]
                sz_mask = n_mask[:, None] & g_mask[None, :]
                acc += _group_sums(SZ + sz, sz_mask, qx, x_sum)
                if SILU_MUL:
                    acc_up += _group_sums(SZ + sz + N_OUT * 2, sz_mask, qx_up, x_sum)
            y = round_sums(acc, B, B, offs_n, n_mask, dtype, HAS_BIAS, False, True)
            up = y
            if SILU_MUL:
                up = round_sums(acc_up, B + N_OUT, B, offs_n, n_mask, dtype, HAS_BIAS, False, True)
            finish(y, up, R + row * stride_rm, Y + row * stride_ym, offs_n, n_mask, dtype, SILU_MUL, RESIDUAL)

        @triton.jit
        def _nibble(words, p: tl.constexpr):
            """Nibble ``p`` of each word as the float q - 8, exactly: its 4 bits under a float32's exponent
            of 2^23 (0x4B000000 | q is 2^23 + q), less 2^23 + 8; no int-to-float conversion."""
            bits = ((words >> (4 * p)) & 0xF) | 0x4B000000
            return bits.to(tl.float32, bitcast=True) - 8388616.0

        @triton.jit
        def _nibble_sums(words, x0, x1, x2, x3, x4, x5, x6, x7):
            """Each row's sums a group of sum((q - 8) x) over its 16 words' 8 nibbles ([BLOCK_N, BLOCK_G]):
            the products added elementwise (a fused multiply-add each), then reduced once over the words."""
            qx = _nibble(words, 0) * x0[None, :, :]
            qx += _nibble(words, 1) * x1[None, :, :]
            qx += _nibble(words, 2) * x2[None, :, :]
            qx += _nibble(words, 3) * x3[None, :, :]
            qx += _nibble(words, 4) * x4[None, :, :]
            qx += _nibble(words, 5) * x5[None, :, :]
            qx += _nibble(words, 6) * x6[None, :, :]
            qx += _nibble(words, 7) * x7[None, :, :]
            return tl.sum(qx, 2)

        @triton.jit
        def _group_sums(sz_at, sz_mask, qx, x_sum):
            """Rows' sums over a step's groups: scale * sum((q - 8) x) + zero * sum(x), a group."""
            scale = tl.load(sz_at, mask=sz_mask, other=0.0).to(tl.float32)
            zero = tl.load(sz_at + 1, mask=sz_mask, other=0.0).to(tl.float32)
            return tl.sum(scale * qx + zero * x_sum[None, :], 1)

        def _decode_linear_int4_op(x: torch.Tensor, qdata: torch.Tensor, scale_zero: torch.Tensor,
                                   bias: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                                   silu_mul: bool, residual: torch.Tensor | None) -> torch.Tensor:
            return _launch(x, qdata, scale_zero, bias, norm_weight, eps, silu_mul, residual)

        # A second import of this module (a reload) finds the op registered.
        if not hasattr(torch.ops.aoti_sessions, "decode_linear_int4"):
            torch.library.triton_op("aoti_sessions::decode_linear_int4", mutates_args=())(_decode_linear_int4_op)
        HAS_TRITON_OP = True
