"""aoti_sessions.llm.exporting._paged_attention: the reference against a naive per-row
loop, the Triton kernels against the reference (triton's interpreter on the
CPU, the real op on a GPU), the kernels compiled for sm_90 and traced the way
AOTInductor traces them, and torch.export of a module that calls the op.

Every pool is NaN except the positions a row owns, so a read of another row's
page, of page 0, of a position past a row's length or of another layer turns
the result into NaN. The triton cases run in subprocesses (this file run as a
script), so TRITON_INTERPRET and the stand-in driver stay out of this process.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from aoti_sessions.llm.exporting import _paged_attention as pa

HAVE_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
SKIPPED = 3  # a script's exit status for "this triton or torch cannot run the check"


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]  # seq_lens, one per row
    hq: int
    hkv: int
    d: int
    page_size: int
    window: int = 0
    softcap: float = 0.0
    scale: float = 0.0  # 0: 1 / sqrt(d)


CASES = {
    "mha-one-row": Case((1,), hq=2, hkv=2, d=16, page_size=4),
    "gqa2-page-edges": Case((4, 9, 16), hq=4, hkv=2, d=32, page_size=4),
    "gqa4-pages16": Case((16, 17, 50), hq=8, hkv=2, d=64, page_size=16),
    "window": Case((3, 20, 37), hq=4, hkv=2, d=32, page_size=4, window=7),
    "softcap": Case((33,), hq=4, hkv=1, d=32, page_size=16, softcap=5.0, scale=1.0),
    "window-softcap-d24": Case((1, 48, 100), hq=2, hkv=2, d=24, page_size=16, window=40, softcap=3.0, scale=0.5),
}


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k_pages, v_pages (layer 1 of a 2-layer pool), page_table, seq_lens,
    with random distinct pages per row and NaN everywhere a row must not read."""
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    owned = [math.ceil(n / ps) for n in case.lens]
    width = max(owned) + 2  # table entries past a row's pages point at page 0
    pages = 1 + sum(owned) + 3  # page 0 and a few pages nobody owns
    kv = torch.full((pages, 2, 2, ps, case.hkv, case.d), float("nan"), dtype=dtype)
    table = torch.zeros(len(case.lens), width, dtype=torch.int32)
    free = (torch.randperm(pages - 1, generator=gen) + 1).tolist()
    for row, n in enumerate(case.lens):
        for i in range(owned[row]):
            page = free.pop()
            table[row, i] = page
            held = min(ps, n - i * ps)
            kv[page, 1, :, :held] = torch.randn(2, held, case.hkv, case.d, generator=gen).to(dtype)
    q = torch.randn(len(case.lens), case.hq, case.d, generator=gen).to(dtype)
    return q, kv[:, 1, 0], kv[:, 1, 1], table, torch.tensor(case.lens, dtype=torch.int64)


def scale_of(case: Case) -> float:
    return case.scale or 1 / math.sqrt(case.d)


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
          scale: float, window: int, softcap: float) -> torch.Tensor:
    """One row, one head, one position at a time, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    ps = k.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        first = max(0, n - window) if window > 0 else 0
        for h in range(q.shape[1]):
            keys, values = [], []
            for p in range(first, n):
                page = int(table[b, p // ps])
                keys.append(k[page, p % ps, h // group].double())
                values.append(v[page, p % ps, h // group].double())
            scores = torch.stack(keys) @ q[b, h].double() * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            out[b, h] = torch.softmax(scores, 0) @ torch.stack(values)
    return out


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_naive_loop(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    args = make_inputs(case, dtype)
    out = pa.paged_decode_reference(*args, scale_of(case), case.window, case.softcap)
    assert out.dtype == dtype and out.shape == args[0].shape
    expected = naive(*args, scale_of(case), case.window, case.softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # The public entry point takes the reference on the CPU.
    torch.testing.assert_close(pa.paged_decode_attention(*args, scale_of(case), case.window, case.softcap), out)


def test_bad_inputs_are_refused() -> None:
    q, k, v, table, lens = make_inputs(CASES["gqa2-page-edges"], torch.float32)
    with pytest.raises(ValueError, match="page_table must be int32"):
        pa.paged_decode_reference(q, k, v, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be int64"):
        pa.paged_decode_reference(q, k, v, table, lens.int(), 0.1)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        pa.paged_decode_reference(q[:, :3], k, v, table, lens, 0.1)


def test_reimport_keeps_one_op() -> None:
    """A reload finds the op registered and does not register it again."""
    before = pa.HAS_TRITON_OP
    module = importlib.reload(pa)
    assert module.HAS_TRITON_OP == before == HAVE_TRITON
    if HAVE_TRITON:
        assert hasattr(torch.ops.aoti_sessions, "paged_decode_attention")


def test_imports_without_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
            "import torch\n"
            "from aoti_sessions.llm.exporting import _paged_attention as pa\n"
            "assert not pa.HAS_TRITON_OP\n"
            "q = torch.randn(1, 2, 16); kv = torch.randn(3, 4, 2, 16)\n"
            "out = pa.paged_decode_attention(q, kv, kv, torch.tensor([[1]], dtype=torch.int32), torch.tensor([3]), 0.25)\n"
            "assert out.shape == (1, 2, 16)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


class TwoLayers(torch.nn.Module):
    """A decode step's attention for two layers of one pool ``kv [P, L, 2,
    page_size, Hkv, D]``, each layer's output feeding the next's query."""

    def forward(self, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        for layer in range(2):
            q = pa.paged_decode_attention(q, kv[:, layer, 0], kv[:, layer, 1], table, lens, 0.125, sliding_window=48)
        return q


def two_layer_inputs(batch: int, pages: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(pages, 2, 2, 16, 2, 32, generator=gen)
    table = torch.randint(1, pages, (batch, 8), generator=gen, dtype=torch.int32)
    return torch.randn(batch, 4, 32, generator=gen), kv, table, torch.randint(1, 129, (batch,), generator=gen)


def test_export_with_dynamic_batch_and_pool() -> None:
    batch, pages = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("pages", min=2, max=1 << 20)
    program = torch.export.export(TwoLayers(), two_layer_inputs(3, 20, 0),
                                  dynamic_shapes=({0: batch}, {0: pages}, {0: batch}, {0: batch}))
    for b, p in [(1, 9), (5, 40)]:
        args = two_layer_inputs(b, p, b)
        torch.testing.assert_close(program.module()(*args), TwoLayers()(*args))


def run_script(mode: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", **env})
    if result.returncode == SKIPPED:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result.stdout


@requires_triton
def test_kernels_in_triton_interpreter() -> None:
    """The kernels on CPU tensors under TRITON_INTERPRET=1: through the
    registered op, and with small chunks and blocks so rows span several
    programs and loop iterations."""
    out = run_script("interpret", {"TRITON_INTERPRET": "1"})
    assert "checked" in out


@requires_triton
def test_kernels_compile_and_trace_for_a_gpu() -> None:
    """With no GPU: the kernels compile for sm_90 (triton's bundled ptxas),
    and the op traces, with a symbolic batch, into one kernel call a layer
    (two layers here) that AOTInductor compiles, each mutating the scratch,
    the output and the counters, the second taking the first's counters."""
    out = run_script("trace", {})
    assert "checked" in out


@pytest.mark.skipif(not (torch.cuda.is_available() and pa.HAS_TRITON_OP), reason="needs a CUDA GPU and triton")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")  # triton 3.9's notice on compiling
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_op_on_cuda_matches_reference(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    args = [a.cuda() for a in make_inputs(case, dtype, seed=2)]
    params = (scale_of(case), case.window, case.softcap)
    expected = pa.paged_decode_reference(*args, *params)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(pa.paged_decode_attention(*args, *params), expected, atol=tol, rtol=tol)
    for split, block_n in [(16, 16), (32, 16)] if dtype == torch.bfloat16 else []:  # each a compile: one dtype
        torch.testing.assert_close(pa._launch(*args, *params, split=split, block_n=block_n), expected,
                                   atol=tol, rtol=tol)


def check_interpreter() -> None:
    """Runs in a subprocess with TRITON_INTERPRET=1."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    try:
        torch.library.wrap_triton(pa._split_kernel)
    except RuntimeError:
        print("this torch's wrap_triton does not take interpreted kernels")
        sys.exit(SKIPPED)
    # The interpreter keeps bfloat16 as its bit patterns and multiplies those
    # in tl.dot (triton-lang/triton#11584, "not supported yet"): convert
    # bfloat16 operands to float32, which is what a GPU's bf16 MMA computes.
    create_dot = interpreter.InterpreterBuilder.create_dot

    def dot(self: Any, a: Any, b: Any, *rest: Any) -> Any:
        def f32(x: Any) -> Any:
            if x.dtype != tl.bfloat16:
                return x
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return create_dot(self, f32(a), f32(b), *rest)

    interpreter.InterpreterBuilder.create_dot = dot
    checked = 0
    for name, case in CASES.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            args = make_inputs(case, dtype, seed=1)
            params = (scale_of(case), case.window, case.softcap)
            expected = pa.paged_decode_reference(*args, *params)
            tol = TOLERANCE[dtype]
            # One counters tensor for two calls: the kernel leaves it zeroed.
            counters = pa.counters_for(args[0].shape[0], args[1].shape[2] + 1, args[0].device)
            for _ in range(2):
                torch.testing.assert_close(torch.ops.aoti_sessions.paged_decode_attention(*args, *params, counters),
                                           expected, atol=tol, rtol=tol, msg=lambda m: f"{name} {dtype} op: {m}")
                assert not counters.any(), counters
            for split, block_n in [(16, 16), (32, 16)]:
                out = pa._launch(*args, *params, split=split, block_n=block_n)
                torch.testing.assert_close(out, expected, atol=tol, rtol=tol,
                                           msg=lambda m: f"{name} {dtype} split {split} block {block_n}: {m}")
            checked += 1
    print(f"checked {checked} cases")


class _TargetOnly:
    """A stand-in for triton's GPU driver: the kernel analysis that tracing
    runs needs a target, nothing else."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def check_compile_and_trace() -> None:
    """Runs in a subprocess (it replaces triton's driver)."""
    import triton
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.compiler import ASTSource

    triton.runtime.driver.set_active(_TargetOnly())
    target = _TargetOnly().get_current_target()
    pointers = ["Q", "K", "V", "PT", "SL", "M_OUT", "L_OUT", "ACC_OUT", "CNT", "OUT"]
    # Float arguments come as fp32 from a Python launch and as fp64 from
    # AOTInductor's generated launcher (seen on an H100, torch 2.11).
    for dtype, d, g, window, softcap, floats in [("bf16", 64, 2, False, False, "fp64"),
                                                 ("fp16", 128, 8, True, True, "fp64"),
                                                 ("fp32", 96, 1, True, False, "fp32")]:
        scalars = {"scale": floats, "softcap": floats, "window": "i32",
                   **{f"stride_{s}": "i32" for s in ["qb", "qh", "kp", "ko", "kh", "vp", "vo", "vh", "pt", "cnt",
                                                     "ob", "oh"]}}
        d_pad = 1 << (d - 1).bit_length()
        kinds = [f"*{dtype}"] * 3 + ["*i32", "*i64"] + ["*fp32"] * 3 + ["*i32", f"*{dtype}"]
        constants = {"G": g, "G_PAD": 16, "HQ": 8 * g, "HEAD_DIM": d, "D_PAD": d_pad, "PAGE": 16, "BLOCK_N": 64,
                     "SPLIT": 64, "NUM_SPLITS": 16, "S_PAD": 16, "WINDOW": window, "SOFTCAP": softcap,
                     "IEEE": dtype == "fp32"}
        signature = {**dict(zip(pointers, kinds)), **scalars, **{k: "constexpr" for k in constants}}
        triton.compile(ASTSource(pa._split_kernel, signature, constants), target=target, options={"num_warps": 8})

    def step(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        counters = pa.counters_for(q.shape[0], 2, q.device)  # (one for both layers, as export makes it)
        out: torch.Tensor = torch.ops.aoti_sessions.paged_decode_attention(q, kv[:, 1, 0], kv[:, 1, 1], table, lens,
                                                                            0.125, 0, 0.0, counters)
        again: torch.Tensor = torch.ops.aoti_sessions.paged_decode_attention(out, kv[:, 0, 0], kv[:, 0, 1], table,
                                                                              lens, 0.125, 0, 0.0, counters)
        return again

    graph = make_fx(dispatch_functionalize(step), tracing_mode="symbolic")(*two_layer_inputs(3, 20, 0))
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert len(calls) == 2, graph.code  # one kernel a layer
    assert [sorted(c.kwargs["tensors_to_clone"]) for c in calls] == [["ACC_OUT", "CNT", "L_OUT", "M_OUT", "OUT"]] * 2, \
        graph.code
    assert calls[1].kwargs["kwargs"]["CNT"] is not calls[0].kwargs["kwargs"]["CNT"], graph.code  # the first's, mutated
    assert all(isinstance(c.kwargs["grid"][0][0], torch.fx.Node) for c in calls), graph.code  # the batch, symbolic
    print("checked compile for sm_90 and the functional trace")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    {"interpret": check_interpreter, "trace": check_compile_and_trace}[sys.argv[1]]()
