"""The q/k norms, rotary and cache write of one decode row in one kernel
(``llm/exporting/_kv_write.py``) on a GPU, at the Qwen3-0.6B and -4B
attention shapes (bf16, one row): its result against the reference (the
largest difference, in units of bf16's last place at the largest value), and its time a launch
against the reference compiled by torch.compile (Inductor's kernels for the
same work) in the same process, each captured 200 times in a CUDA graph.

Loads the kernel's modules from the source tree by path (no build of
aoti_sessions needed): ``python bench/probe_kv_write.py``. Prints a
Markdown table.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"0.6b": (16, 8, 128), "4b": (32, 8, 128)}  # (query heads, kv heads, head_dim); both with q/k norms
LAUNCHES = 200


def _kernels() -> Any:
    package = types.ModuleType("_exporting")
    package.__path__ = [str(ROOT / "python" / "aoti_sessions" / "llm" / "exporting")]
    sys.modules["_exporting"] = package
    return importlib.import_module("_exporting._kv_write")


def _graph_us(fn: Any) -> float:
    """us a launch of ``fn`` captured LAUNCHES times in one CUDA graph (the best of 5 replays)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / LAUNCHES)
    return best


def main() -> None:
    kw = _kernels()
    assert kw.HAS_TRITON_OP, "needs triton"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | max diff (bf16 units at the largest value), queries | pool | kernel us | torch.compile'd reference us |")
    print("|---|---:|---:|---:|---:|")
    for name, (hq, hkv, d) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        dev, dt = "cuda", torch.bfloat16
        qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=gen).to(dev, dt)
        angles = torch.rand(1, d // 2, generator=gen) * 6.3
        cos, sin = (torch.cat([f(angles)] * 2, 1).to(dev, dt) for f in (torch.cos, torch.sin))
        kv = torch.zeros(512, 28, 2, 16, hkv, d, dtype=dt, device=dev)  # a pool of 512 pages of 16, 28 layers
        page, offset = torch.tensor([300], device=dev), torch.tensor([5], device=dev)
        q_norm, k_norm = (torch.rand(d, generator=gen).add(0.5).to(dev, dt) for _ in range(2))
        args = (qkv, cos, sin, kv, page, offset, 7, hq, hkv, q_norm, k_norm, 1e-6)
        ref_kv = kv.clone()
        ref = kw.rotary_kv_write_reference(qkv, cos, sin, ref_kv, *args[4:])
        got = kw.rotary_kv_write(*args)
        torch.cuda.synchronize()

        def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
            """The largest difference in units of bf16's last place at the largest magnitude (not each
            element's own: a rotation's sum can cancel to near zero, where a unit is meaningless)."""
            unit = torch.exp2(torch.floor(torch.log2(b.float().abs().max())) - 7)
            return float((a.float() - b.float()).abs().max() / unit)

        compiled = torch.compile(kw.rotary_kv_write_reference, dynamic=False)
        kernel_us = _graph_us(lambda: kw.rotary_kv_write(*args))
        compiled_us = _graph_us(lambda: compiled(*args))
        print(f"| {name} ({hq}/{hkv} heads, head_dim {d}) | {ulps(got, ref):.0f} | {ulps(kv, ref_kv):.0f} | "
              f"{kernel_us:.2f} | {compiled_us:.2f} |")


if __name__ == "__main__":
    main()
