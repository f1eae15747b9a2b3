"""Matrix-vector products for a decode step of one row, with the pointwise
work around them in the same kernel (issue 38: a chat's decode step is ~100
launches of a few microseconds each, every one reading a few MB).

``decode_linear(x, weight, bias, norm_weight, eps, silu_mul, residual)`` is
the entry point: ``x [M, K]`` (M a handful of rows; decode_one's is 1), ``weight
[N, K]``. It computes, in one kernel:

- ``norm_weight`` given: ``x`` RMS-normalized first, rounded as
  transformers' Llama-style ``RMSNorm`` rounds it (``weight *
  (x * rsqrt(mean(x^2) + eps)).to(dtype)``, in ``x``'s dtype);
- the product with ``weight`` (and ``bias``), accumulated in float32;
- ``silu_mul``: ``weight``'s two halves are a gate and an up projection
  (``[gate; up]``, as ``_fused.py`` concatenates them); the result is
  ``silu(gate) * up`` ``[M, N // 2]``, rounded as the MLP's own code
  rounds it;
- ``residual`` given (``[M, N]``): added to the result, rounded as the
  decoder layer's ``residual + hidden_states`` rounds it.

``weight_scale`` given (``[N]``, ``x``'s dtype or float32, as torchao keeps
it: rounded to ``x``'s dtype as the kernel loads it, as torchao's linear
rounds it, where a conversion of its own was a kernel a projection a step:
48 a step, ~60 us of the 4B slice's 0.88 ms, stop 57): ``weight`` is int8 with a
scale a row (torchao's int8 weight-only tensors, ``_quantize.py``), read as
int32 words of four bytes where the rows allow (K, the row stride and the
offset multiples of 4) and made float by integer operations (an int8 to float
conversion bound the kernel at 2 TB/s on an H200: bench/results/decode_cuda.md,
stop 56), so a step reads half of bf16's bytes; the
product is rounded, then scaled, then the bias added, each rounded, as
torchao's ``(x @ w.to(dtype)) * scale + bias`` rounds.

On CUDA tensors (where triton is installed) it calls the custom op
``torch.ops.aoti_sessions.decode_linear``, a Triton kernel registered with
``torch.library.triton_op`` (so ``torch.export`` keeps it and AOTInductor
compiles it into the package); elsewhere :func:`decode_linear_reference`,
plain PyTorch with the same rounding.

Each program computes ``BLOCK_N`` outputs of one row over the whole of K
(no split-K: a decode matrix has thousands of rows, enough programs to keep
every SM loading), reading a ``[BLOCK_N, BLOCK_K]`` tile of the weight a
step; the norm's sum of squares is computed by every program from ``x``
(a few KB, from L2). Block sizes per shape: :func:`_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
# By this name: triton_op finds an op's kernels by reading its source for calls to ``wrap_triton(kernel)``.
from torch.library import wrap_triton

from ._int8_mm import check_scale, linear_int8_reference
from ._triton import tl, triton

__all__ = ["decode_linear", "decode_linear_reference", "epilogue_reference", "check_around", "rms_norm_reference",
           "OP_NAME", "HAS_TRITON_OP"]

OP_NAME = "aoti_sessions::decode_linear"


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-style RMSNorm (Llama, Mistral, Qwen2, Qwen3),
    rounded as it rounds: float32 inside, the normalized value rounded to
    ``x``'s dtype before the weight multiplies it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def decode_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                            silu_mul: bool = False, residual: torch.Tensor | None = None,
                            weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The op in plain PyTorch: the CPU path and the kernel's reference."""
    _check(x, weight, bias, norm_weight, silu_mul, residual, weight_scale)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    # int8: as torchao's weight-only linear computes it
    y = F.linear(x, weight, bias) if weight_scale is None else linear_int8_reference(x, weight, weight_scale, bias)
    return epilogue_reference(y, silu_mul, residual)


def epilogue_reference(y: torch.Tensor, silu_mul: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """What follows a projection ``y`` in the op (and ``_gemv_int4``'s):
    SiLU-mul of its halves, then the residual add, as transformers rounds them."""
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                  residual: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op on CUDA tensors (where triton is installed), the
    reference otherwise. Traceable by ``torch.export`` either way."""
    if x.is_cuda and HAS_TRITON_OP:
        out: torch.Tensor = torch.ops.aoti_sessions.decode_linear(x, weight, bias, norm_weight, float(eps), silu_mul,
                                                                  residual, weight_scale)
        return out
    return decode_linear_reference(x, weight, bias, norm_weight, eps, silu_mul, residual, weight_scale)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
           silu_mul: bool, residual: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> None:
    """Static checks only (the rows may be symbolic in an export)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"decode_linear takes x [M, K] and weight [N, K], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    n = int(weight.shape[0])
    if silu_mul and n % 2:
        raise ValueError(f"silu_mul needs a weight of two halves (gate; up), got {n} rows")
    check_around(x, n, bias, norm_weight, silu_mul, residual)
    if weight_scale is not None:
        if weight.dtype != torch.int8:
            raise ValueError(f"weight_scale (an int8 weight's scale a row) goes beside an int8 weight, got a "
                             f"{weight.dtype} weight")
        check_scale(x, n, weight_scale, "weight_scale (an int8 weight's scale a row)", " beside an int8 weight")
    if weight.dtype != x.dtype and weight_scale is None:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype}, {weight.dtype}")


def check_around(x: torch.Tensor, n: int, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                 silu_mul: bool, residual: torch.Tensor | None) -> None:
    """The checks of what goes around a projection of ``x`` [M, K] to ``n``
    outputs (this op's and ``_gemv_int4``'s): the bias, the norm's weight and
    the residual, each of its shape and in ``x``'s dtype."""
    k = int(x.shape[1])
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    if norm_weight is not None and (tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight must be [{k}] in {x.dtype}, got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    n_out = n // 2 if silu_mul else n
    if residual is not None and (residual.dim() != 2 or residual.shape[1] != n_out or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [M, {n_out}] in {x.dtype}, got {residual.dtype} {tuple(residual.shape)}")


def _config(n_out: int, k: int, silu_mul: bool, int8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for ``n_out`` outputs over
    ``k``: the fastest of bench/probe_gemv.py's sweep at the Qwen3-0.6B and
    -4B projections on an H200 (bench/results/decode_cuda.md, stop 53),
    within 1% of it at every shape:

    - gate/up with SiLU-mul: 4 outputs (8 weight rows) a program, 256-512 wide tiles, 4 warps;
    - a long K (o_proj, down_proj: 2048 and more): 1024-wide tiles on 8 warps, 2-4 outputs a program
      (over 4096: 2048-wide, 2 outputs; below);
    - q/k/v and the output head: 512-wide tiles on 4 warps, 2 outputs a program (8 at K >= 2048).

    ``int8`` weights (``probe_gemv --int8 --quick`` at the 4B projections on an
    H200, stop 57, the rows read as words): gate/up 8 outputs a program on
    512-wide tiles, one stage (21.2 us, where the bf16 choice with tiles twice
    as wide took 26.6); q/k/v 512-wide tiles, 4 stages (8.3 us against 9.1);
    the long-K projections the bf16 choice with tiles twice as wide (2048: o
    5.4 us, down 14.3, faster than any tile the sweep tried).

    A K over 4096 in a float dtype (the down projections from Qwen3-1.7B's
    and Llama-3.2-1B's up: K 6,144 to 14,336, n_out 2,048 to 4,096): 2 outputs
    on 2048-wide tiles, 2 stages. Timed at the 4B down projection (K 9,728) in
    the chain a step runs (``bench/probe_chain.py --configs``, stop 58: twelve
    layers' down projections back to back): 191.8 us against 207-208 for the
    long-K choice; the other shapes it reaches are not timed. Every other
    projection's choice was within 3% of the best tile that probe tried.
    """
    if silu_mul:
        config = (8, 512, 4, 1) if int8 else (4, 256 if k <= 1024 else 512, 4, 4)
    elif k > 4096 and n_out <= 4096 and not int8:
        config = (2, 2048, 8, 2)
    elif k >= 2048 and n_out <= 4096:  # (int8's K over 4096 too: 4 stages there)
        config = (4 if n_out >= 2048 else 2, 2048 if int8 else 1024, 8, 4 if k > 4096 else 1)
    else:
        config = (8, 512, 4, 4) if int8 else (8 if k >= 2048 else 2, 512, 4, 2)
    return config[0], min(config[1], 1 << (k - 1).bit_length()), config[2], config[3]


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, silu_mul: bool, residual: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
            *, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The kernel through ``wrap_triton`` (traced into the graph under export,
    a plain launch in eager mode); ``config`` overrides :func:`_config`
    (the probe, tests)."""
    _check(x, weight, bias, norm_weight, silu_mul, residual, weight_scale)
    if weight.stride(1) != 1 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("decode_linear needs x, weight and residual contiguous in their last dimension")
    n, k = int(weight.shape[0]), int(weight.shape[1])
    n_out = n // 2 if silu_mul else n
    rows = x.shape[0]
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or _config(n_out, k, silu_mul, weight_scale is not None)
    # int8 rows read as int32 words of four where every row starts on a word (see _linear_kernel).
    words = weight_scale is not None and k % 4 == 0 and weight.stride(0) % 4 == 0 and weight.storage_offset() % 4 == 0
    wrap_triton(_linear_kernel)[(triton.cdiv(n_out, block_n), rows)](
        x, weight, x if bias is None else bias, x if norm_weight is None else norm_weight,
        out if residual is None else residual, x if weight_scale is None else weight_scale, out, float(eps),
        x.stride(0), weight.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        K=k, N_OUT=n_out, NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, QUANT=weight_scale is not None, WORDS=words,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


if TYPE_CHECKING:
    _linear_kernel: Any
    round_sums: Any
    rms_rstd: Any
    load_normed: Any
    finish: Any

# triton is optional (CPU installs have none): without it decode_linear always takes the reference path.
HAS_TRITON_OP = False
if not TYPE_CHECKING:
    if triton is not None:
        @triton.jit
        def round_sums(y, B, S, offs_n, n_mask, dtype, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr,
                    ROUNDED: tl.constexpr):
            """A row's sums with the scale (int8 weights) and the bias. ``ROUNDED`` (torchao's quantized
            linears, ``(x @ w) * scale + bias``): the product rounded to the dtype, then each step."""
            if ROUNDED:
                y = y.to(dtype).to(tl.float32)
                if SCALE:  # (the scale in the dtype: a float32 one rounded first)
                    y = y * tl.load(S + offs_n, mask=n_mask, other=0.0).to(dtype).to(tl.float32)
                if HAS_BIAS:
                    y = y.to(dtype).to(tl.float32) + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            elif HAS_BIAS:  # (F.linear: the bias inside the product's float32 sum)
                y += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            return y

        @triton.jit
        def rms_rstd(x_row, eps, K: tl.constexpr, BLOCK_K: tl.constexpr):
            """The RMSNorm's 1 / rms of the row at ``x_row`` (by every program: x is a few KB, read from L2)."""
            offs_k = tl.arange(0, BLOCK_K)
            squares = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
                squares += xs * xs
            return tl.math.rsqrt(tl.sum(squares, 0) / K + eps)

        @triton.jit
        def load_normed(x_row, NW, kk, k_mask, rstd, dtype, NORM: tl.constexpr):
            """The row's values at ``kk`` (any shape) in float32; ``NORM``: normalized by ``rstd`` and
            the norm's weight at ``NW``, rounded where transformers' RMSNorm rounds."""
            xk = tl.load(x_row + kk, mask=k_mask, other=0.0)
            if NORM:
                xk = (xk.to(tl.float32) * rstd).to(dtype)
                xk = (tl.load(NW + kk, mask=k_mask, other=0.0).to(tl.float32) * xk.to(tl.float32)).to(dtype)
            return xk.to(tl.float32)

        @triton.jit
        def finish(y, up, R, Y, offs_n, n_mask, dtype, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr):
            """A row's outputs stored at ``Y``: ``y`` (and ``up``, SILU_MUL) after :func:`round_sums`, SiLU-mul
            and the residual row at ``R`` added, as :func:`epilogue_reference` rounds them."""
            if SILU_MUL:  # as the MLP rounds: each projection to the dtype, silu in float32 rounded, the product
                gate = y.to(dtype).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
                y = act * up.to(dtype).to(tl.float32)
            if RESIDUAL:  # rounded as the layer's residual + hidden_states rounds
                y = tl.load(R + offs_n, mask=n_mask, other=0.0).to(tl.float32) + y.to(dtype).to(tl.float32)
            tl.store(Y + offs_n, y.to(dtype), mask=n_mask)

        @triton.jit
        def _linear_kernel(X, W, B, NW, R, S, Y, eps, stride_xm, stride_wn, stride_rm, stride_ym, K: tl.constexpr,
                           N_OUT: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr,
                           HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                           WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
            pid = tl.program_id(0)
            row = tl.program_id(1)
            dtype = Y.dtype.element_ty
            eps = tl.cast(eps, tl.float32)  # (AOTInductor passes Python floats as fp64)
            offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N_OUT
            offs_k = tl.arange(0, BLOCK_K)
            x_row = X + row * stride_xm
            rstd = 1.0
            if NORM:
                rstd = rms_rstd(x_row, eps, K, BLOCK_K)
            if WORDS:  # int8 rows as int32 words, each of 4 inputs (byte b: input 4 w + b)
                sums, sums_up = _int8_word_sums(x_row, W, NW, rstd, offs_n, n_mask, stride_wn, dtype, K, N_OUT,
                                                NORM, SILU_MUL, BLOCK_N, BLOCK_K)
            else:
                acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
                w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    k_mask = kk < K  # (K static: triton sees the mask constant over a vector)
                    xf = load_normed(x_row, NW, kk, k_mask, rstd, dtype, NORM)[None, :]
                    tile_mask = n_mask[:, None] & k_mask[None, :]
                    w = tl.load(w_rows + kk[None, :], mask=tile_mask, other=0.0)
                    acc += w.to(tl.float32) * xf
                    if SILU_MUL:  # the up projection's rows, N_OUT further
                        u = tl.load(w_rows + N_OUT * stride_wn + kk[None, :], mask=tile_mask, other=0.0)
                        acc_up += u.to(tl.float32) * xf
                sums, sums_up = tl.sum(acc, 1), tl.sum(acc_up, 1)
            y = round_sums(sums, B, S, offs_n, n_mask, dtype, HAS_BIAS, QUANT, QUANT)
            up = y
            if SILU_MUL:
                up = round_sums(sums_up, B + N_OUT, S + N_OUT, offs_n, n_mask, dtype, HAS_BIAS, QUANT, QUANT)
            finish(y, up, R + row * stride_rm, Y + row * stride_ym, offs_n, n_mask, dtype, SILU_MUL, RESIDUAL)

        @triton.jit
        def _int8_word_sums(x_row, W, NW, rstd, offs_n, n_mask, stride_wn, dtype, K: tl.constexpr,
                            N_OUT: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
            """The rows' sums of int8 weights times x, the rows read as int32 words (K, the row stride and the
            offset multiples of 4): each word's sign bits flipped at once, then a byte plane at a time made
            float by the exponent trick (_gemv_int4's ``_nibble``), against the inputs of that byte (x split
            into its 4 planes in registers: no layout change through shared memory); integer and float32
            additions where a conversion from int8 would take the slow conversion unit."""
            offs_w = tl.arange(0, BLOCK_K // 4)
            b = tl.arange(0, 4)
            w_rows = W.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_wn // 4)
            acc = tl.zeros([BLOCK_N, BLOCK_K // 4], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K // 4], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kw = k0 // 4 + offs_w
                kk = kw[:, None] * 4 + b[None, :]  # [BLOCK_K // 4, 4]: byte b of word kw is input 4 kw + b
                x4 = tl.reshape(load_normed(x_row, NW, kk, kk < K, rstd, dtype, NORM), [BLOCK_K // 4, 2, 2])
                xa, xb = tl.split(x4)  # bytes 0, 2 and 1, 3
                x0, x2 = tl.split(xa)
                x1, x3 = tl.split(xb)
                w_mask = n_mask[:, None] & (kw < K // 4)[None, :]
                w = tl.load(w_rows + kw[None, :], mask=w_mask, other=0) ^ -2139062144  # (0x80808080)
                acc += _int8_plane(w, 0) * x0[None, :]
                acc += _int8_plane(w, 1) * x1[None, :]
                acc += _int8_plane(w, 2) * x2[None, :]
                acc += _int8_plane(w, 3) * x3[None, :]
                if SILU_MUL:  # the up projection's rows, N_OUT further
                    u = tl.load(w_rows + N_OUT * (stride_wn // 4) + kw[None, :], mask=w_mask, other=0) ^ -2139062144
                    acc_up += _int8_plane(u, 0) * x0[None, :]
                    acc_up += _int8_plane(u, 1) * x1[None, :]
                    acc_up += _int8_plane(u, 2) * x2[None, :]
                    acc_up += _int8_plane(u, 3) * x3[None, :]
            return tl.sum(acc, 1), tl.sum(acc_up, 1)

        @triton.jit
        def _int8_plane(flipped, b: tl.constexpr):
            """Byte ``b`` (little-endian) of each word whose bytes' sign bits are flipped (q + 128, 0..255) as
            the float q, exactly: under a float32 exponent of 2^23, less 2^23 + 128."""
            return (((flipped >> (8 * b)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0

        def _decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              norm_weight: torch.Tensor | None, eps: float, silu_mul: bool,
                              residual: torch.Tensor | None, weight_scale: torch.Tensor | None) -> torch.Tensor:
            return _launch(x, weight, bias, norm_weight, eps, silu_mul, residual, weight_scale)

        # A second import of this module (a reload) finds the op registered.
        if not hasattr(torch.ops.aoti_sessions, "decode_linear"):
            torch.library.triton_op(OP_NAME, mutates_args=())(_decode_linear_op)
        HAS_TRITON_OP = True
