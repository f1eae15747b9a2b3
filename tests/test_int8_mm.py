"""int8 weight-only linears of the batched methods on our Triton matmul
(llm/exporting/_int8_mm.py): the reference equal to torchao's linear bit for
bit, the torch-function mode routing exactly the int8-rows linears of its
devices (and tracing through torch.export), the kernel against the reference
(triton's interpreter on the CPU, the op on a GPU), bad input refused by name."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from aoti_sessions.llm.exporting import _int8_mm as im
from conftest import requires_cuda, run_in_triton_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# (M, N, K, bias): one row and many, K and N not multiples of the blocks.
CASES = [(1, 96, 200, True), (3, 40, 130, False), (37, 64, 256, True), (70, 33, 72, False)]


def _quantized_linear(k: int, n: int, bias: bool) -> torch.nn.Linear:
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(k * 100 + n)
    linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
    return linear


def _inputs(m: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    # (rows of about a float weight's size: uniform int8 has a standard deviation of ~73)
    scale = (torch.rand(n, generator=gen) * 0.5 + 0.75) / (73 * k ** 0.5)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    # The scale in float32, as torchao keeps it, or already in the dtype (every other case).
    scale = scale.to(device, torch.float32 if m % 2 else dtype)
    return (x.to(device, dtype), q.to(device), scale, b.to(device, dtype) if bias else None)


def _check_cases(dtype: torch.dtype, device: str, config: tuple[int, int, int, int, int] | None) -> None:
    for m, n, k, bias in CASES:
        x, q, scale, b = _inputs(m, n, k, bias, dtype, device)
        ref = im.linear_int8_reference(x, q, scale, b)
        got = im._launch(x, q, scale, b, config=config)
        assert got.shape == ref.shape == (m, n) and got.dtype == ref.dtype
        # 16-bit: a unit in the last place or two of the rounded product (the sums' order differs from torch's).
        tol = 1e-5 if dtype == torch.float32 else 0.05 if dtype == torch.bfloat16 else 0.01
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= tol, (m, n, k, bias, dtype, err)


@pytest.mark.parametrize("bias", [True, False])
def test_reference_is_torchaos_linear(bias: bool) -> None:
    linear = _quantized_linear(48, 64, bias)
    weight = linear.weight
    assert im.int8_rows(weight)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for scale in (weight.scale.reshape(-1), weight.scale.reshape(-1).to(x.dtype)):  # (torchao's float32, ours)
        assert scale.dtype in (torch.float32, x.dtype)
        got = im.linear_int8_reference(x, weight.qdata, scale, linear.bias)
        assert torch.equal(got, linear(x))
    assert weight.scale.dtype == torch.float32  # (what the mode passes on: no conversion a call)


def test_the_mode_routes_the_int8_linears_of_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    quantized, plain = _quantized_linear(48, 64, True), torch.nn.Linear(48, 32).to(torch.bfloat16)
    calls: list[torch.dtype] = []
    reference = im.linear_int8

    def spy(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(qdata.dtype)
        return reference(x, qdata, scale, bias)

    monkeypatch.setattr(im, "linear_int8", spy)
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # (3-D: rows flattened)
    expected = quantized(x)
    with im.int8_linears_on_kernel(devices=("cpu",)):
        got, other = quantized(x), plain(x)
    assert calls == [torch.int8] and torch.equal(got, expected) and torch.equal(other, F.linear(x, plain.weight,
                                                                                              plain.bias))
    with im.int8_linears_on_kernel():  # (CUDA's alone by default: a CPU input keeps torchao's linear)
        assert torch.equal(quantized(x), expected)
    assert calls == [torch.int8]
    wide = torch.randn(3, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with im.int8_linears_on_kernel(devices=("cpu",)):  # an input strided in its last dimension: routed, copied
        assert torch.equal(quantized(wide[:, ::2]), quantized.weight.__class__.__torch_function__(
            F.linear, (), (wide[:, ::2].contiguous(), quantized.weight, quantized.bias)))
        # a bias of another dtype than the input's: torchao's linear, which promotes it
        assert torch.equal(F.linear(x, quantized.weight, quantized.bias.float()),
                           quantized.weight.__class__.__torch_function__(F.linear, (), (x, quantized.weight,
                                                                                        quantized.bias.float())))
    assert calls == [torch.int8] * 2


def test_the_tiles_follow_the_most_rows_a_call_can_have() -> None:
    """A decode step's rows (up to 64) on small tiles; more (prefill) on large ones."""
    assert im._config(1)[:2] == im._config(64)[:2] == (16, 16)
    assert im._config(65)[:2] == (128, 128)


def test_export_traces_through_the_mode() -> None:
    """Non-strict torch.export (the package's) of a model whose weights are parametrized torchao int8
    tensors, as _quantize.quantized_weights leaves them: the routed linear is traced, same results."""
    from aoti_sessions.llm.exporting._quantize import quantized_weights

    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.SiLU(), torch.nn.Linear(64, 16)).to(torch.bfloat16)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad(), quantized_weights(model, "int8wo") as count:
        expected = model(x)
        with im.int8_linears_on_kernel(devices=("cpu",)):
            program = torch.export.export(model, (x,), strict=False)
    assert count == 2
    assert torch.equal(program.module()(x), expected)


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4)), "int8 qdata"),
    ((torch.zeros(2, 8), torch.zeros(4, 6, dtype=torch.int8), torch.zeros(4)), "x \\[M, K\\]"),
    ((torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.zeros(3)), "scale must be \\[4\\]"),
    ((torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, dtype=torch.bfloat16)),
     "scale must be \\[4\\] in torch.float32"),
    ((torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, dtype=torch.float16)),
     "scale must be \\[4\\] in torch.bfloat16 or float32, got torch.float16"),
    ((torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4), torch.zeros(5)), "bias must be"),
])
def test_bad_input_is_refused_by_name(args: tuple[torch.Tensor, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        im.linear_int8(*args)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_kernel_in_triton_interpreter() -> None:
    assert "checked" in run_in_triton_interpreter(__file__)


@requires_cuda
@pytest.mark.skipif(not im.HAS_TRITON_OP, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_on_cuda(dtype: torch.dtype) -> None:
    """The registered op at its own configs and small ones, and a decode step's and a prefill's rows at a
    Qwen3-4B projection's size."""
    _check_cases(dtype, "cuda", None)
    _check_cases(dtype, "cuda", (16, 32, 32, 4, 2))
    for m in (1, 64, 300):
        x, q, scale, b = _inputs(m, 2560, 9728, False, dtype, "cuda")
        err = (im.linear_int8(x, q, scale, b).float() - im.linear_int8_reference(x, q, scale, b).float()).abs().max()
        assert err.item() <= (1e-3 if dtype == torch.float32 else 0.05), (m, err)


if __name__ == "__main__":  # the interpreter case, in a process of its own
    # (Not bfloat16: triton 3.9's interpreter gets a bfloat16 tl.dot and an int8-to-bfloat16 cast wrong, tens of
    # billions off on a 16 x 16 product; the CUDA case runs it.)
    for dt in (torch.float32, torch.float16):
        _check_cases(dt, "cpu", (16, 32, 32, 4, 1))
        _check_cases(dt, "cpu", None)
    print("checked")
