"""int8 weight-only linears of the batched methods (prefill, decode) on a
Triton matmul of our own, on CUDA (issue 38).

torchao's int8 weight-only linear computes ``mm(x, qdata.t().to(dtype)) *
scale (+ bias)``. Inductor's post-grad pattern for weight-only int8
(``torch/_inductor/fx_passes/quantization.py``, ``_register_woq_mm_int8_pattern4``)
rewrites that, for CUDA tensors too, into ``aten._weight_int8pack_mm``, whose
CUDA kernel in torch 2.11 converts the activations to float32 and loops:
12.7 of 13.2 device ms a decode step of a 12-layer Qwen3-4B slice, 174 ms a
step of 64 rows (bench/results/decode_cuda.md, stop 56). The op here is not
that pattern: int8 tiles made ``x``'s dtype in registers and multiplied on
the tensor cores (``tl.dot``, float32 sums), the product rounded to the
dtype, then scaled, then the bias added, each rounded, as torchao rounds.

``linear_int8(x, qdata, scale, bias)``: ``x [M, K]``, ``qdata`` int8 ``[N,
K]``, ``scale [N]`` in ``x``'s dtype or float32 (torchao keeps it so: the
kernel rounds it to ``x``'s dtype as it loads it, as torchao's linear does
before it multiplies, where a conversion of its own would be a kernel a
linear a step), ``bias [N]`` in ``x``'s dtype. On CUDA tensors
(triton installed) the custom op ``torch.ops.aoti_sessions.linear_int8``
(``torch.library.triton_op``, compiled into the package by AOTInductor);
elsewhere :func:`linear_int8_reference`, torchao's formula.

:func:`int8_linears_on_kernel`: for a block, every ``F.linear`` of a CUDA
input and one of torchao's int8 weight-only weights (a scale a row) runs on
the op (``_quantize.quantized_weights`` sets it around an int8wo export for
CUDA). decode_one's one-row layers read the int8 rows on ``_gemv`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
# By this name: triton_op finds an op's kernels by reading its source for calls to ``wrap_triton(kernel)``.
from torch.library import wrap_triton
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode

from ._triton import tl, triton

__all__ = ["check_scale", "linear_int8", "linear_int8_reference", "int8_rows", "int8_linears_on_kernel",
           "HAS_TRITON_OP"]


def int8_rows(weight: Any) -> bool:
    """torchao's int8 weight-only tensor with a scale a row (``_quantize.py``'s int8wo), no activation
    scaling on it (its linear then computes ``(x @ qdata.t().to(dtype)) * scale``, its zero point unread)."""
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    return type(weight).__name__ == "Int8Tensor" and isinstance(qdata, torch.Tensor) \
        and isinstance(scale, torch.Tensor) and qdata.dtype == torch.int8 and qdata.dim() == 2 \
        and scale.numel() == qdata.shape[0] and list(getattr(weight, "block_size", ())) == [1, qdata.shape[1]] \
        and all(getattr(weight, name, None) is None for name in ("act_quant_kwargs", "act_pre_scale"))


def linear_int8_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The op in plain PyTorch: torchao's int8 weight-only linear, as it rounds."""
    _check(x, qdata, scale, bias)
    y = torch.mm(x, qdata.t().to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


def linear_int8(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton op on CUDA tensors (where triton is installed), the
    reference otherwise. Traceable by ``torch.export`` either way."""
    if x.is_cuda and HAS_TRITON_OP:
        out: torch.Tensor = torch.ops.aoti_sessions.linear_int8(x, qdata, scale, bias)
        return out
    return linear_int8_reference(x, qdata, scale, bias)


def _check(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Static checks only (the rows may be symbolic in an export)."""
    if x.dim() != 2 or qdata.dim() != 2 or qdata.dtype != torch.int8 or x.shape[1] != qdata.shape[1]:
        raise ValueError(f"linear_int8 takes x [M, K] and int8 qdata [N, K], got x {tuple(x.shape)}, qdata "
                         f"{qdata.dtype} {tuple(qdata.shape)}")
    n = int(qdata.shape[0])
    check_scale(x, n, scale, "scale")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")


def check_scale(x: torch.Tensor, n: int, scale: torch.Tensor, name: str, where: str = "") -> None:
    """An int8 weight's scale a row for ``n`` rows: ``[n]``, in ``x``'s dtype or float32 (as torchao keeps it;
    the kernels round it to ``x``'s dtype as they load it). This op's check and ``_gemv``'s (``name`` and
    ``where`` say which argument, and of what, in the message)."""
    if tuple(scale.shape) != (n,) or scale.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"{name} must be [{n}] in {x.dtype} or float32{where}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


class _Int8Linears(TorchFunctionMode):
    """Routes ``F.linear`` of an input on ``devices`` and an int8-rows weight to :func:`linear_int8`."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        super().__init__()
        self.devices = devices

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(x, torch.Tensor) and x.device.type in self.devices and int8_rows(weight) \
                    and (bias is None or bias.dtype == x.dtype):
                # (A copy in the contiguous layout where x is not: not .contiguous(), whose check guards the rows.)
                rows = (x if x.stride(-1) == 1 else x.clone(memory_format=torch.contiguous_format)).reshape(
                    -1, x.shape[-1])
                out = linear_int8(rows, weight.qdata, weight.scale.reshape(-1), bias)
                return out.reshape(*x.shape[:-1], out.shape[-1])
        return func(*args, **kwargs)


@contextmanager
def int8_linears_on_kernel(devices: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """For the block: ``F.linear`` of an input on ``devices`` and one of torchao's int8 weight-only weights
    (a scale a row) on :func:`linear_int8` (see the module's doc)."""
    with _Int8Linears(devices):
        yield


def _config(rows: int | torch.SymInt) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), by the most rows a call can have (under export,
    the bound of the method's rows: a decode step's ``max_batch``, a prefill's rows times tokens). Up to 64
    rows, a decode step, memory-bound: 16 rows a tile (one to four tiles) and 16 outputs, so even a
    2,560-wide projection makes 160 programs, each streaming 512 int8 inputs a step. More (prefill):
    128 x 128 tiles, 64 inputs a step, on 8 warps (Hopper's warp-group MMA). Compiled for sm_90 by a
    helper's review (78 and 116 registers, no spills); not yet timed on a GPU."""
    if statically_known_true(rows <= 64):
        return 16, 16, 512, 4, 4
    return 128, 128, 64, 8, 4


def _launch(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            *, config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The kernel through ``wrap_triton``; ``config`` overrides :func:`_config` (tests)."""
    _check(x, qdata, scale, bias)
    if x.stride(1) != 1 or qdata.stride(1) != 1:
        raise ValueError("linear_int8 needs x and qdata contiguous in their last dimension")
    n, k = int(qdata.shape[0]), int(qdata.shape[1])
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = config or _config(rows)
    wrap_triton(_int8_mm_kernel)[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n))](
        x, qdata, scale, x if bias is None else bias, out, rows, x.stride(0), qdata.stride(0), out.stride(0),
        N=n, K=k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out


if TYPE_CHECKING:
    _int8_mm_kernel: Any

HAS_TRITON_OP = False
if not TYPE_CHECKING:
    if triton is not None:
        @triton.jit
        def _int8_mm_kernel(X, Q, S, B, Y, M, stride_xm, stride_qn, stride_ym, N: tl.constexpr, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
            dtype = Y.dtype.element_ty
            offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            m_mask, n_mask = offs_m < M, offs_n < N
            x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
            q_cols = Q + offs_n[None, :].to(tl.int64) * stride_qn
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < K
                x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                q = tl.load(q_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # [K, N]
                if dtype == tl.float32:  # (exact float32 products; the 16-bit dtypes' are exact on the MMA)
                    acc = tl.dot(x, q.to(dtype), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, q.to(dtype), acc)
            # As torchao rounds: the product to the dtype, times the scale (in the dtype), plus the bias, each rounded.
            scale = tl.load(S + offs_n, mask=n_mask, other=0.0).to(dtype).to(tl.float32)
            y = acc.to(dtype).to(tl.float32) * scale[None, :]
            if HAS_BIAS:
                y = y.to(dtype).to(tl.float32) + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y.to(dtype),
                     mask=m_mask[:, None] & n_mask[None, :])

        def _linear_int8_op(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
            return _launch(x, qdata, scale, bias)

        # A second import of this module (a reload) finds the op registered.
        if not hasattr(torch.ops.aoti_sessions, "linear_int8"):
            torch.library.triton_op("aoti_sessions::linear_int8", mutates_args=())(_linear_int8_op)
        HAS_TRITON_OP = True
