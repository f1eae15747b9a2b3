"""GPU probe for the one-row decode kernel (aoti_sessions.llm.exporting._gemv):
its error against the reference, and its time and bandwidth at the
projections of the Qwen3-0.6B and Qwen3-4B shapes, over a sweep of launch
parameters, against cuBLAS's ``F.linear`` (plus torch's separate norm and
SiLU-mul kernels where the op fuses them) in the same call.

Each case is timed as a CUDA graph of one launch per copy of the weight
(copies enough that the weights outrun L2), replayed; one line a
measurement on stdout (and in --out).

    python bench/probe_gemv.py [--out FILE] [--quick] [--int8 | --int4] [--shapes 0.6b.qkv,...]

``--int8``: the weights int8 with a scale a row (torchao's int8wo, which the
kernel reads as int8), against torchao's formula in eager PyTorch
(``(x @ w.t().to(bf16)) * scale``: a conversion kernel, then cuBLAS).
``--int4``: int4 tiles on ``_gemv_int4``'s kernel against tinygemm (the
head aside: export leaves it unquantized).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from aoti_sessions.llm.exporting import _gemv as gv
from aoti_sessions.llm.exporting import _gemv_int4 as g4

DTYPE = torch.bfloat16
# (N, K, norm, silu_mul) per projection: qkv and gate/up fused as _fused.py fuses them.
SHAPES = {
    "0.6b.qkv": (4096, 1024, True, False), "0.6b.o": (1024, 2048, False, False),
    "0.6b.gate_up": (6144, 1024, True, True), "0.6b.down": (1024, 3072, False, False),
    "0.6b.head": (151936, 1024, False, False),
    "4b.qkv": (6144, 2560, True, False), "4b.o": (2560, 4096, False, False),
    "4b.gate_up": (19456, 2560, True, True), "4b.down": (2560, 9728, False, False),
}
LINES: list[str] = []


def emit(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def graph_time(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds a call, the calls captured in one CUDA graph (min over 3 timings)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return best


def torch_ops(x: torch.Tensor, nw: torch.Tensor | None, silu: bool,
              project: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
    """The op's work in torch's separate ops (the baseline): the norm, ``project``, SiLU-mul."""
    def call() -> object:
        h = gv.rms_norm_reference(x, nw, 1e-6) if nw is not None else x
        return gv.epilogue_reference(project(h), silu, None)
    return call


def probe(name: str, quick: bool, int8: bool = False) -> None:
    n, k, norm, silu = SHAPES[name]
    nbytes = n * k * (1 if int8 else 2)
    copies = max(2, min(64, -(-(400 << 20) // nbytes)))
    if int8:
        ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda") for _ in range(copies)]
        scale: torch.Tensor | None = torch.rand(n, dtype=DTYPE, device="cuda") / (73 * k ** 0.5) + 1e-4
    else:
        ws, scale = [torch.randn(n, k, dtype=DTYPE, device="cuda") / k ** 0.5 for _ in range(copies)], None
    x = torch.randn(1, k, dtype=DTYPE, device="cuda")
    nw = (torch.rand(k, dtype=DTYPE, device="cuda") + 0.5) if norm else None
    ref = gv.decode_linear_reference(x, ws[0], None, nw, 1e-6, silu, weight_scale=scale)
    out = gv.decode_linear(x, ws[0], None, nw, 1e-6, silu, weight_scale=scale)
    err = (out.float() - ref.float()).abs().max().item()
    emit(f"{name} N={n} K={k} norm={norm} silu={silu} MB={nbytes / 1e6:.1f} copies={copies} "
         f"op_err={err:.4f} ref_max={ref.abs().max().item():.3f}")

    def torch_calls(w: torch.Tensor) -> Callable[[], object]:
        return torch_ops(x, nw, silu, lambda h: F.linear(h, w) if scale is None
                         else torch.mm(h, w.t().to(DTYPE)) * scale)

    t_lin = graph_time([(lambda w=w: F.linear(x, w) if scale is None else torch.mm(x, w.t().to(DTYPE)) * scale)
                        for w in ws])
    t_torch = graph_time([torch_calls(w) for w in ws])
    emit(f"{name} cublas_linear_us={t_lin:.2f} GBps={nbytes / t_lin / 1e3:.0f} torch_ops_us={t_torch:.2f}")
    t_def = graph_time([(lambda w=w: gv.decode_linear(x, w, None, nw, 1e-6, silu, weight_scale=scale)) for w in ws])
    emit(f"{name} op_default cfg={gv._config(n // 2 if silu else n, k, silu, int8)} us={t_def:.2f} GBps={nbytes / t_def / 1e3:.0f}")
    block_ns = (2, 4, 8, 16) if not quick else (4, 8)
    kw = ((256, 4), (512, 4), (512, 8), (1024, 8), (2048, 8)) if not quick else ((512, 4),)
    results = []
    for bn, (bk, warps) in itertools.product(block_ns, kw):
        if bk > 1 << (k - 1).bit_length():
            continue
        cfg = (bn, bk, warps, 3)
        try:
            t = graph_time([(lambda w=w, cfg=cfg: gv._launch(x, w, None, nw, 1e-6, silu, None, scale, config=cfg))
                            for w in ws])
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            emit(f"{name} cfg={cfg} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        results.append((t, cfg))
    results.sort()
    for t, cfg in results[:3]:
        for stages in (1, 2, 4):
            c2 = (*cfg[:3], stages)
            t2 = graph_time([(lambda w=w, c2=c2: gv._launch(x, w, None, nw, 1e-6, silu, None, scale, config=c2))
                             for w in ws])
            results.append((t2, c2))
    results.sort()
    for t, cfg in results[:5]:
        emit(f"{name} cfg={cfg} us={t:.2f} GBps={nbytes / t / 1e3:.0f}")
    emit(f"{name} BEST cfg={results[0][1]} us={results[0][0]:.2f} GBps={nbytes / results[0][0] / 1e3:.0f} "
         f"vs_cublas={t_lin / results[0][0]:.2f}x vs_torch_ops={t_torch / results[0][0]:.2f}x "
         f"median_all={statistics.median(t for t, _ in results):.2f}")
    del ws


def probe_int4(name: str, quick: bool) -> None:
    """--int4: random int4 tiles (tinygemm's layout, groups of 128, K padded to 1024 as torchao pads it)
    on _gemv_int4's kernel, against tinygemm (torchao's int4 linear: ``_weight_int4pack_mm``) and the
    reference, over a sweep of (BLOCK_N, BLOCK_G, num_warps)."""
    n, k, norm, silu = SHAPES[name]
    kp = -(-k // 1024) * 1024
    nbytes = n * kp // 2 + kp // 128 * n * 4
    copies = max(2, min(64, -(-(400 << 20) // nbytes)))
    qs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (n // 8, kp // 128, 32, 4), dtype=torch.int32, device="cuda")
          for _ in range(copies)]
    scale = torch.rand(kp // 128, n, device="cuda") / (4.6 * k ** 0.5) + 1e-4
    sz = torch.stack([scale, -8 * scale], -1).to(DTYPE).contiguous()
    x = torch.randn(1, k, dtype=DTYPE, device="cuda")
    nw = (torch.rand(k, dtype=DTYPE, device="cuda") + 0.5) if norm else None
    ref = g4.decode_linear_int4_reference(x, qs[0], sz, None, nw, 1e-6, silu)
    out = g4.decode_linear_int4(x, qs[0], sz, None, nw, 1e-6, silu)
    err = (out.float() - ref.float()).abs().max().item()
    emit(f"{name} int4 N={n} K={k} K'={kp} norm={norm} silu={silu} MB={nbytes / 1e6:.1f} copies={copies} "
         f"op_err={err:.4f} ref_max={ref.abs().max().item():.3f}")

    def tinygemm(q: torch.Tensor) -> Callable[[], object]:
        return torch_ops(x, nw, silu, lambda h: torch.ops.aten._weight_int4pack_mm(F.pad(h, (0, kp - k)), q, 128, sz))

    t_tiny = graph_time([tinygemm(q) for q in qs])
    emit(f"{name} int4 tinygemm_with_torch_ops_us={t_tiny:.2f} GBps={nbytes / t_tiny / 1e3:.0f}")
    results = []
    for cfg in itertools.product((2, 4, 8, 16, 32) if not quick else (2, 4, 8, 16), (1, 2, 4, 8) if not quick else (2, 4),
                                 (2, 4, 8) if not quick else (4,)):
        try:
            t = graph_time([(lambda q=q, cfg=cfg: g4._launch(x, q, sz, None, nw, 1e-6, silu, None, config=cfg))
                            for q in qs])
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            emit(f"{name} int4 cfg={cfg} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        results.append((t, cfg))
    results.sort()
    for t, cfg in results[:5]:
        emit(f"{name} int4 cfg={cfg} us={t:.2f} GBps={nbytes / t / 1e3:.0f}")
    default = g4._config(silu)
    t_def = next((t for t, cfg in results if cfg == default), float("nan"))
    emit(f"{name} int4 BEST cfg={results[0][1]} us={results[0][0]:.2f} GBps={nbytes / results[0][0] / 1e3:.0f} "
         f"vs_tinygemm={t_tiny / results[0][0]:.2f}x default cfg={default} us={t_def:.2f}")
    del qs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--int8", action="store_true", help="int8 weights with a scale a row")
    parser.add_argument("--int4", action="store_true", help="int4 weights in tinygemm's tiles (_gemv_int4)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    emit(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    failed = 0
    for name in args.shapes.split(","):
        try:
            if args.int4:
                if not name.endswith(".head"):
                    probe_int4(name, args.quick)
            else:
                probe(name, args.quick, args.int8)
        except Exception as e:  # noqa: BLE001 - each shape reports; the rest run
            failed += 1
            emit(f"{name} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc(file=sys.stdout)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
