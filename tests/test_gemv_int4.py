"""decode_one's int4 projection (llm/exporting/_gemv_int4.py): the tiles of
torch's tinygemm read as torch's own packer lays them out (a literal
transcription of its CUDA kernel on the CPU; torch's packer itself and
torchao's int4 linear on a GPU), the reference's dequantization equal to
torchao's formula, the Triton kernel against the reference (triton's
interpreter on the CPU, the real op on a GPU), bad input refused by name."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from aoti_sessions.llm.exporting import _gemv_int4 as g4
from conftest import requires_cuda, run_in_triton_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# (N, K, norm, silu_mul, bias, residual): every prologue and epilogue; K a multiple of 1024 or padded to one.
CASES = [(32, 1024, False, False, False, False), (48, 200, True, False, True, True),
         (64, 1100, True, True, False, True), (16, 2048, False, True, True, False),
         (40, 3000, True, False, False, False)]


def pack_like_torch(q: torch.Tensor) -> torch.Tensor:
    """``q`` [N, K'] (values 0..15) packed as torch's ``_convert_weight_to_int4pack`` (CUDA, 8 inner
    k-tiles) packs it: its kernel ``matrix_to_m16n8k16_Bint4_layout`` transcribed loop for loop (one
    warp's lane t a block), from the bytes torchao hands it (``q[:, ::2] << 4 | q[:, 1::2]``)."""
    n, kp = q.shape
    data = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.int64)  # [N][K' / 2] bytes
    out = torch.zeros(n // 8, kp // 128, 32, 4, dtype=torch.int64)
    for n_tile in range(n // 8):
        for k_outer in range(kp // 128):
            for t in range(32):
                n0 = n_tile * 8 + t // 4
                for inner in range(0, 8, 2):
                    k_base0 = (k_outer * 8 + inner) * 16 // 2
                    ks = [k_base0 + t % 4, k_base0 + t % 4 + 4]
                    k_base1 = k_base0 + 16 // 2
                    ks += [k_base1 + t % 4, k_base1 + t % 4 + 4]
                    v = [int(data[n0, k]) for k in ks]
                    pack = ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16) \
                        | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    out[n_tile, k_outer, t, inner // 2] = pack
    return (out - (out >= 1 << 31).long() * (1 << 32)).to(torch.int32)  # (as the int32 it is)


def _inputs(n: int, k: int, norm: bool, silu: bool, bias: bool, residual: bool, dtype: torch.dtype,
            device: str, rows: int = 2) -> dict[str, Any]:
    """Random inputs of a case: weights of 4-bit values with a scale and a zero a group, near a
    float weight's size (q - 8 has a standard deviation of ~4.6)."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    kp = -(-k // 1024) * 1024
    q = torch.randint(0, 16, (n, kp), generator=gen, dtype=torch.int32)
    scale = (torch.rand(kp // 128, n, generator=gen) * 0.5 + 0.75) / (4.6 * k ** 0.5)
    zero = torch.randn(kp // 128, n, generator=gen) * scale

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return {"x": rand(rows, k), "qdata": pack_like_torch(q).to(device), "q": q,
            "scale_zero": torch.stack([scale, zero], -1).to(device=device, dtype=dtype),
            "bias": rand(n) if bias else None, "norm_weight": rand(k).abs() + 0.5 if norm else None,
            "residual": rand(rows, n // 2 if silu else n) if residual else None}


def _check_cases(dtype: torch.dtype, device: str, config: tuple[int, int, int] | None, tol: float) -> None:
    for n, k, norm, silu, bias, residual in CASES:
        a = _inputs(n, k, norm, silu, bias, residual, dtype, device)
        args = (a["x"], a["qdata"], a["scale_zero"], a["bias"], a["norm_weight"], 1e-6, silu, a["residual"])
        ref = g4.decode_linear_int4_reference(*args)
        got = g4._launch(*args, config=config)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= (1e-4 if dtype == torch.float32 else tol), (n, k, norm, silu, bias, residual, dtype, err)


def test_tiles_unpack_to_the_values_torchs_packer_packed() -> None:
    q = torch.randint(0, 16, (24, 2048), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    assert torch.equal(g4.unpack_int4_tiles(pack_like_torch(q)), q)


def test_reference_dequantizes_as_torchao() -> None:
    """The reference's product is x times torchao's tinygemm dequantization ((q - 8) * scale + zero,
    _dequantize_affine_tinygemm) of the unpacked values, its scales and zeros in torchao's packing
    (pack_tinygemm_scales_and_zeros), rounded, then the bias added."""
    from torchao.quantization.quant_primitives import _dequantize_affine_tinygemm
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    a = _inputs(32, 1100, False, False, True, False, torch.float32, "cpu")
    n, kp = a["q"].shape
    scale, zero = a["scale_zero"][..., 0].t().contiguous(), a["scale_zero"][..., 1].t().contiguous()
    assert torch.equal(pack_tinygemm_scales_and_zeros(scale, zero, torch.float32), a["scale_zero"])
    weight = _dequantize_affine_tinygemm(a["q"], [1, 128], scale, zero, torch.int32, 0, 15,
                                         output_dtype=torch.float32)[:, :1100]
    expected = a["x"] @ weight.t() + a["bias"]
    got = g4.decode_linear_int4_reference(a["x"], a["qdata"], a["scale_zero"], a["bias"])
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bad", "message"), [
    ({"qdata": torch.zeros(4, 8, 32, 4, dtype=torch.int64)}, "int32 tiles"),
    ({"qdata": torch.zeros(4, 8, 32, 2, dtype=torch.int32)}, "int32 tiles"),
    ({"x": torch.zeros(2, 2048)}, "do not fit tiles of 1024"),
    ({"scale_zero": torch.zeros(8, 32, 2, dtype=torch.bfloat16)}, "scale_zero must be"),
    ({"scale_zero": torch.zeros(4, 32, 2)}, "scale_zero must be"),
    ({"bias": torch.zeros(31)}, "bias must be"),
    ({"norm_weight": torch.zeros(999)}, "norm_weight must be"),
    ({"residual": torch.zeros(2, 16), "silu_mul": False}, "residual must be"),
    ({"qdata": torch.zeros(1, 8, 32, 4, dtype=torch.int32), "scale_zero": torch.zeros(8, 8, 2),
      "silu_mul": True}, "two halves"),
])
def test_bad_input_is_refused_by_name(bad: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"x": torch.zeros(2, 1000), "qdata": torch.zeros(4, 8, 32, 4, dtype=torch.int32),
                            "scale_zero": torch.zeros(8, 32, 2), "bias": None, "norm_weight": None,
                            "silu_mul": False, "residual": None, **bad}
    with pytest.raises(ValueError, match=message):
        g4.decode_linear_int4(**args)


def test_decode_one_reads_torchaos_int4_tensors_on_this_op() -> None:
    """_one_row takes a linear whose weight is torchao's int4 tensor in tinygemm's tiles (groups of
    128, rows unpadded) onto this op, its tiles and scales as they are; other int4 tensors stay off."""
    from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import Int4TilePackedTo4dTensor

    from aoti_sessions.llm.exporting import _one_row

    a = _inputs(32, 1024, False, False, True, False, torch.bfloat16, "cpu")
    linear = torch.nn.Linear(1024, 32, dtype=torch.bfloat16)
    linear.weight = torch.nn.Parameter(Int4TilePackedTo4dTensor(a["qdata"], a["scale_zero"], [1, 128],
                                                                torch.Size([32, 1024])), requires_grad=False)
    linear.bias = torch.nn.Parameter(a["bias"], requires_grad=False)
    assert _one_row._usable(linear)
    assert torch.equal(_one_row._project(linear, a["x"]),
                       g4.decode_linear_int4_reference(a["x"], a["qdata"], a["scale_zero"], a["bias"]))
    for other in (Int4TilePackedTo4dTensor(a["qdata"], a["scale_zero"], [1, 64], torch.Size([32, 1024])),
                  Int4TilePackedTo4dTensor(a["qdata"], a["scale_zero"], [1, 128], torch.Size([30, 1024]))):
        assert not _one_row._int4_tiles(other)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_kernel_in_triton_interpreter() -> None:
    """The kernel on CPU tensors under TRITON_INTERPRET=1, one and several groups a step."""
    assert "checked" in run_in_triton_interpreter(__file__)


@requires_cuda
def test_torchs_packer_and_tinygemm_on_cuda_agree_with_the_reading() -> None:
    """On a GPU: torch's own packer lays the values out as the transcription does, and tinygemm's
    product (torchao's int4 linear, x the identity: the dequantized weight) is the reference's weight
    within bf16's rounding."""
    q = torch.randint(0, 16, (64, 2048), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).cuda(), 8)
    assert torch.equal(packed.cpu(), pack_like_torch(q))
    a = _inputs(64, 2048, False, False, False, False, torch.bfloat16, "cuda")
    eye = torch.eye(2048, dtype=torch.bfloat16, device="cuda")
    tinygemm = torch.ops.aten._weight_int4pack_mm(eye, a["qdata"], 128, a["scale_zero"])
    ours = g4.decode_linear_int4_reference(eye, a["qdata"], a["scale_zero"])
    assert (tinygemm.float() - ours.float()).abs().max().item() <= 2 ** -8 * ours.float().abs().max().item()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_op_on_cuda(dtype: torch.dtype) -> None:
    """The registered op (the kernel at its own configs, and one and several groups a step) against
    the reference; and at a 4B projection's shape against torchao's int4 linear (tinygemm)."""
    _check_cases(dtype, "cuda", None, 0.08)
    _check_cases(dtype, "cuda", (8, 1, 4), 0.08)
    from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import Int4TilePackedTo4dTensor
    weight = torch.randn(2560, 9728, dtype=dtype, device="cuda") / 9728 ** 0.5
    t = Int4TilePackedTo4dTensor.from_hp(weight, [1, 128])
    x = torch.randn(1, 9728, dtype=dtype, device="cuda")
    expected = torch.nn.functional.linear(x, t)
    got = g4.decode_linear_int4(x, t.qdata, t.scale_and_zero)
    assert (got.float() - expected.float()).abs().max().item() <= 0.02 * expected.float().abs().max().item()


if __name__ == "__main__":  # the interpreter case, in a process of its own
    _check_cases(torch.float32, "cpu", (8, 1, 4), 0.0)
    _check_cases(torch.float32, "cpu", (16, 4, 4), 0.0)
    _check_cases(torch.float32, "cpu", (4, 8, 4), 0.0)
    _check_cases(torch.bfloat16, "cpu", (8, 2, 4), 0.25)
    print("checked")
