"""GPU probe for the paged decode-attention op (aoti_sessions.llm.exporting._paged_attention):
its error against the reference, its time against the masked SDPA over a
static cache that the decode step uses now, a small sweep of its launch
parameters, and the op inside an AOTInductor package (dynamic batch and pool),
also replayed from a CUDA graph with new lengths. One line per measurement on
stdout (and in --out); a section that fails prints its error and the rest runs.
About two minutes on an H100.

    CXX=/usr/bin/g++ CC=/usr/bin/gcc python bench/probe_paged_attention.py [--out FILE]

(AOTInductor compiles its C++ wrapper with $CXX; on the GPU machines the
default compiler on PATH is not one it can use, hence the variables.)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from aoti_sessions.llm.exporting import _paged_attention as pa

LAYERS, PAGE, HKV, HQ, D, CTX = 16, 16, 8, 16, 64, 1024
WIDTH = CTX // PAGE  # page-table entries per row
BATCHES = (1, 4, 16, 64)
SCALE = 1 / math.sqrt(D)
DTYPE = torch.bfloat16
DEVICE = "cuda"
LINES: list[str] = []


def close(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """The largest error, and whether every element is within bf16's
    tolerance (2e-2 absolute plus 2e-2 relative: outputs near 4 are 1/32 apart)."""
    diff = (out.float() - ref.float()).abs()
    return diff.max().item(), bool((diff <= 2e-2 + 2e-2 * ref.float().abs()).all().item())


def emit(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def section(name: str, body: Callable[[], None]) -> bool:
    try:
        body()
        return True
    except Exception as e:  # report and go on: one run should show every section
        emit(f"{name} ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        traceback.print_exc(file=sys.stdout)
        return False


class Pool:
    """``kv [P, LAYERS, 2, PAGE, HKV, D]`` with room for 64 full rows; pages
    handed out at random. Page 0 and every position past a row's length are
    NaN, so a read the op must not make shows up as NaN."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen
        self.kv = torch.randn((2 + max(BATCHES) * WIDTH, LAYERS, 2, PAGE, HKV, D), dtype=DTYPE, device=DEVICE,
                              generator=gen)
        self.kv[0] = float("nan")

    def rows(self, lens: torch.Tensor) -> torch.Tensor:
        """A page table for rows of these lengths (NaN past each length)."""
        batch = lens.numel()
        ids = torch.randperm(self.kv.shape[0] - 2, generator=self.gen, device=DEVICE)[:batch * WIDTH] + 2
        table = ids.view(batch, WIDTH).to(torch.int32)
        owned = (lens + PAGE - 1) // PAGE
        table[torch.arange(WIDTH, device=DEVICE)[None, :] >= owned[:, None]] = 0
        for b, n in enumerate(lens.tolist()):
            if n % PAGE:
                self.kv[int(table[b, (n - 1) // PAGE]), :, :, n % PAGE:] = float("nan")
        return table

    def refill(self) -> None:
        """Real values back where earlier tables put NaN (page 0 stays NaN)."""
        self.kv[1:].normal_(generator=self.gen)


def lengths(batch: int, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(low, high + 1, (batch,), generator=gen, device=DEVICE)


def correctness(pool: Pool, gen: torch.Generator) -> None:
    for batch in BATCHES:
        pool.refill()
        lens = lengths(batch, 1, CTX, gen)
        table = pool.rows(lens)
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEVICE, generator=gen)
        for layer, window, softcap in [(0, 0, 0.0), (LAYERS - 1, 0, 0.0), (7, 256, 30.0)]:
            k, v = pool.kv[:, layer, 0], pool.kv[:, layer, 1]
            out = pa.paged_decode_attention(q, k, v, table, lens, SCALE, window, softcap)
            ref = pa.paged_decode_reference(q, k, v, table, lens, SCALE, window, softcap)
            err, ok = close(out, ref)
            emit(f"correct B={batch} layer={layer} window={window} softcap={softcap:g} max_abs_err={err:.2e} "
                 f"{'ok' if ok else 'FAIL'}")
            if not ok:
                raise AssertionError(f"B={batch} layer={layer}: error {err}")


def graph_time_us(step: Callable[[], object], per_call: int, reps: int = 15, inner: int = 5) -> float:
    """Median GPU microseconds of one of the ``per_call`` calls ``step`` makes,
    replayed from a CUDA graph (no launch overhead, as in the engine's steps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / inner / per_call)
    return statistics.median(times)


def op_step(pool: Pool, q: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
            **launch: int) -> Callable[[], object]:
    """One decode step's attention: every layer of the pool (their K/V do not
    all fit in L2, as in a real step)."""
    def step() -> object:
        if not launch:
            return [pa.paged_decode_attention(q, pool.kv[:, i, 0], pool.kv[:, i, 1], table, lens, SCALE)
                    for i in range(LAYERS)]
        return [pa._launch(q, pool.kv[:, i, 0], pool.kv[:, i, 1], table, lens, SCALE, **launch)
                for i in range(LAYERS)]
    return step


def sdpa_steps(batch: int, lens: torch.Tensor, gen: torch.Generator) -> tuple[Callable[[], object], ...]:
    """The static-cache decode: q [B, Hq, 1, D] against [B, Hkv, CTX, D] per
    layer with a boolean mask of the filled positions; transformers repeats
    the kv heads (repeat_kv) when there is a mask, then SDPA (torch's backend)."""
    cache = torch.randn(LAYERS, 2, batch, HKV, CTX, D, dtype=DTYPE, device=DEVICE, generator=gen)
    q = torch.randn(batch, HQ, 1, D, dtype=DTYPE, device=DEVICE, generator=gen)
    mask = (torch.arange(CTX, device=DEVICE)[None, :] < lens[:, None])[:, None, None, :]
    group = HQ // HKV

    def repeated() -> object:
        return [torch.nn.functional.scaled_dot_product_attention(
            q, cache[i, 0].repeat_interleave(group, 1), cache[i, 1].repeat_interleave(group, 1), attn_mask=mask)
            for i in range(LAYERS)]

    expanded = cache.repeat_interleave(group, 3)  # the repeat done once: SDPA alone

    def kernel_only() -> object:
        return [torch.nn.functional.scaled_dot_product_attention(q, expanded[i, 0], expanded[i, 1], attn_mask=mask)
                for i in range(LAYERS)]

    return repeated, kernel_only


def timing(pool: Pool, gen: torch.Generator) -> None:
    for target in (300, CTX):
        for batch in BATCHES:
            pool.refill()
            lens = lengths(batch, max(1, target - 16), target, gen)
            table = pool.rows(lens)
            q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEVICE, generator=gen)
            op = graph_time_us(op_step(pool, q, table, lens), LAYERS)
            repeated, kernel_only = sdpa_steps(batch, lens, gen)
            sdpa_repeat = graph_time_us(repeated, LAYERS)
            sdpa = graph_time_us(kernel_only, LAYERS)
            emit(f"time B={batch} seq~{target} op_us={op:.1f} sdpa_repeat_kv_us={sdpa_repeat:.1f} "
                 f"sdpa_us={sdpa:.1f} speedup_vs_repeat={sdpa_repeat / op:.2f}x")


def sweep(pool: Pool, gen: torch.Generator) -> None:
    """The launch parameters around the defaults (per-layer microseconds)."""
    variants = [dict(split=s, block_n=n, num_warps=w, num_stages=st)
                for s, n, w, st in [(64, 64, 4, 1), (64, 64, 8, 1), (64, 32, 4, 1), (64, 64, 4, 2), (32, 32, 4, 1),
                                    (128, 64, 4, 1), (128, 64, 4, 2), (128, 128, 8, 1), (256, 64, 4, 2)]]
    for target in (300, CTX):
        for batch in (1, 16, 64):
            pool.refill()
            lens = lengths(batch, max(1, target - 16), target, gen)
            table = pool.rows(lens)
            q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEVICE, generator=gen)
            results = [(graph_time_us(op_step(pool, q, table, lens, **v), LAYERS), v) for v in variants]
            for us, v in results:
                emit(f"sweep B={batch} seq~{target} " + " ".join(f"{k}={x}" for k, x in v.items()) + f" op_us={us:.1f}")
            best = min(results, key=lambda r: r[0])
            emit(f"sweep_best B={batch} seq~{target} {best[1]} op_us={best[0]:.1f}")


class TwoLayers(torch.nn.Module):
    def forward(self, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return torch.stack([pa.paged_decode_attention(q, kv[:, i, 0], kv[:, i, 1], table, lens, SCALE)
                            for i in range(2)])


def two_layer_inputs(batch: int, pages: int, gen: torch.Generator) -> list[torch.Tensor]:
    kv = torch.randn(pages, 2, 2, PAGE, HKV, D, dtype=DTYPE, device=DEVICE, generator=gen)
    lens = lengths(batch, 1, CTX, gen)
    owned = (lens + PAGE - 1) // PAGE
    table = torch.randint(1, pages, (batch, WIDTH), generator=gen, device=DEVICE, dtype=torch.int32)
    table[torch.arange(WIDTH, device=DEVICE)[None, :] >= owned[:, None]] = 0
    return [torch.randn(batch, HQ, D, dtype=DTYPE, device=DEVICE, generator=gen), kv, table, lens]


def expected(args: list[torch.Tensor]) -> torch.Tensor:
    q, kv, table, lens = args
    return torch.stack([pa.paged_decode_reference(q, kv[:, i, 0], kv[:, i, 1], table, lens, SCALE) for i in range(2)])


def check(name: str, out: torch.Tensor, args: list[torch.Tensor]) -> None:
    err, ok = close(out, expected(args))
    emit(f"{name} B={args[0].shape[0]} P={args[1].shape[0]} max_abs_err={err:.2e} {'ok' if ok else 'FAIL'}")
    if not ok:
        raise AssertionError(f"{name}: error {err}")


def aoti(gen: torch.Generator, folder: Path) -> None:
    batch, pages = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("pages", min=2, max=1 << 20)
    started = time.perf_counter()
    program = torch.export.export(TwoLayers(), tuple(two_layer_inputs(4, 300, gen)),
                                  dynamic_shapes=({0: batch}, {0: pages}, {0: batch}, {0: batch}))
    ops = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function" and "aoti" in str(n.target)})
    emit(f"aoti export_s={time.perf_counter() - started:.1f} ops={ops}")
    started = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "paged.pt2"))
    emit(f"aoti compile_s={time.perf_counter() - started:.1f}")
    runner = torch._inductor.aoti_load_package(path)
    for b, p in [(3, 200), (64, 4200), (1, 70)]:
        args = two_layer_inputs(b, p, gen)
        check("aoti_run", runner(*args), args)

    # The single-threaded runner (the one a graph can capture) in a CUDA
    # graph, replayed with new lengths, tables and queries in its inputs.
    loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", True, 1, 0)
    inputs = two_layer_inputs(16, 1100, gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            loader.run(inputs)
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = loader.run(inputs)
    for replay in range(3):
        fresh = two_layer_inputs(16, 1100, gen)
        for buffer, new in zip(inputs, fresh):
            if buffer is not inputs[1]:  # the pool stays (its address is captured); rows change
                buffer.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        check(f"aoti_graph replay={replay}", outs[0], inputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the lines here")
    args = parser.parse_args()
    import triton

    emit(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
         f"op_registered={pa.HAS_TRITON_OP} defaults split={pa.POSITIONS_PER_SPLIT} block_n={pa.BLOCK_N} "
         f"warps={pa.NUM_WARPS_SMALL_D}/{pa.NUM_WARPS_LARGE_D} stages={pa.NUM_STAGES}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    started = time.perf_counter()
    ok = True
    with torch.no_grad():
        pool = Pool(gen)
        ok &= section("correct", lambda: correctness(pool, gen))
        ok &= section("time", lambda: timing(pool, gen))
        ok &= section("sweep", lambda: sweep(pool, gen))
        del pool
        torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory() as folder:
            ok &= section("aoti", lambda: aoti(gen, Path(folder)))
    emit(f"{'PASS' if ok else 'FAIL'} total_s={time.perf_counter() - started:.0f}")
    if args.out:
        args.out.write_text("\n".join(LINES) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
