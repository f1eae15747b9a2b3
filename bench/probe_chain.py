"""GPU probe: what a decode step's chain of one-row projections loses at its
kernel boundaries, and what programmatic dependent launch (PDL, Hopper)
wins back (issue 38: the 4B slice's bf16 step is 49 projections, 794 us of
kernels for 2.4 GB, ~3.05 TB/s, stop 58).

Times, as CUDA graphs replayed (us a chain, min over 3 timings), the 12 layers
of the 4B slice's four projections (q/k/v, o, gate/up, down; 2.42 GB bf16):

- ``ops``: the package's own kernels (``_gemv.decode_linear``, with the norm,
  SiLU-mul and residual as decode_one calls them);
- ``plain``: a bare one-row kernel (no norm, no epilogue) on ``_config``'s tiles for
  its shape: the same as the op's for q/k/v, o and down, but gate/up bare is one
  matrix of 8 contiguous rows a program on 2 stages, where the op reads 4 gate and
  4 up rows on 4 stages;
- ``pdl``: the same launched with PDL, each program releasing its dependents
  at once and waiting for its predecessor before it reads x;
- ``pdl_prefetch``: ``pdl`` with each program's first weight tile loaded
  before the wait (weights do not depend on the previous kernel);
- ``one_kernel``: ``plain`` over all the chain's weights as one matrix (the
  tiles' bandwidth with no boundary at all);
- ``cublas``: ``F.linear`` a projection; ``torch_sum``: a read of the same bytes;
- ``<kind>.<projection>``: one projection's 12 alone; for the normed ones (q/k/v,
  gate/up) also ``norm0``-``norm4``, a copy of the kernel with the norm's 1 / rms
  computed each way (``_norm_kernel``'s doc);
- ``--configs``: each projection's chain on each of ``CONFIGS``' tiles.

Results: bench/results/decode_cuda.md, stop 58 (tree 26f0c98: since, ``_config`` gives
the down projection another tile, which ``plain`` and ``pdl`` follow).

    python bench/probe_chain.py [--out FILE] [--rounds N] [--only SUBSTRING] [--configs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).parent))
from probe_gemv import emit, graph_time, LINES  # noqa: E402

from aoti_sessions.llm.exporting import _gemv as gv  # noqa: E402

rms_rstd, load_normed = gv.rms_rstd, gv.load_normed  # (called from the kernel below)

DTYPE = torch.bfloat16
LAYERS = 12
# (N, K, norm, silu_mul, residual) a layer, as decode_one calls them on the 4B slice, and their names.
NAMES = ("qkv", "o", "gate_up", "down")
PROJECTIONS = [(6144, 2560, True, False, False), (2560, 4096, False, False, True),
               (19456, 2560, True, True, False), (2560, 9728, False, False, True)]


@triton.jit
def _gemv_kernel(X, W, Y, K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = W + offs_n[:, None].to(tl.int64) * K
    if PDL:
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if PREFETCH:
        w0 = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    if PREFETCH:
        acc += w0.to(tl.float32) * tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K if PREFETCH else 0, K, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_n, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=n_mask)


@triton.jit
def _norm_kernel(X, W, NW, RSTD, Y, eps, K: tl.constexpr, N_OUT: tl.constexpr, SILU_MUL: tl.constexpr,
                 MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RBLOCK: tl.constexpr):
    """A norm-first projection (q/k/v, gate/up) as ``_gemv``'s kernel computes it, the norm's 1 / rms
    (MODE) 0: not at all (x given normalized: the bound); 1: as _gemv does, from x at the program's start;
    2: loaded (computed by a kernel before); 3: computed after the first weight tile's load is issued;
    4: as 1 in one load of RBLOCK (K padded to a power of two)."""
    pid = tl.program_id(0)
    dtype = Y.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = W + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if MODE == 3:
        first = n_mask[:, None] & (offs_k < K)[None, :]
        w0 = tl.load(w_rows + offs_k[None, :], mask=first, other=0.0)
        u0 = w0
        if SILU_MUL:
            u0 = tl.load(w_rows + N_OUT * K + offs_k[None, :], mask=first, other=0.0)
    rstd = 1.0
    if MODE == 1 or MODE == 3:
        rstd = rms_rstd(X, eps, K, BLOCK_K)
    if MODE == 2:
        rstd = tl.load(RSTD)
    if MODE == 4:
        rstd = rms_rstd(X, eps, K, RBLOCK)
    if MODE == 3:
        xf = load_normed(X, NW, offs_k, offs_k < K, rstd, dtype, True)[None, :]
        acc += w0.to(tl.float32) * xf
        acc_up += u0.to(tl.float32) * xf
    for k0 in range(BLOCK_K if MODE == 3 else 0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        xf = load_normed(X, NW, kk, k_mask, rstd, dtype, MODE != 0)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * xf
        if SILU_MUL:
            u = tl.load(w_rows + N_OUT * K + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_up += u.to(tl.float32) * xf
    y = tl.sum(acc, 1)
    if SILU_MUL:
        y = y / (1.0 + tl.exp(-y)) * tl.sum(acc_up, 1)
    tl.store(Y + offs_n, y.to(dtype), mask=n_mask)


def normed(x: torch.Tensor, w: torch.Tensor, nw: torch.Tensor, rstd: torch.Tensor, y: torch.Tensor, silu: bool,
           mode: int) -> Callable[[], object]:
    n, k = w.shape
    n_out = n // 2 if silu else n
    block_n, block_k, warps, stages = gv._config(n_out, k, silu)
    grid = (triton.cdiv(n_out, block_n),)

    def call() -> object:
        return _norm_kernel[grid](x, w, nw, rstd, y, 1e-6, K=k, N_OUT=n_out, SILU_MUL=silu, MODE=mode,
                                  BLOCK_N=block_n, BLOCK_K=block_k, RBLOCK=triton.next_power_of_2(k),
                                  num_warps=warps, num_stages=stages)
    return call


def bare(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, pdl: bool, prefetch: bool) -> Callable[[], object]:
    n, k = w.shape
    block_n, block_k, warps, stages = gv._config(n, k, False)
    grid = (triton.cdiv(n, block_n),)
    extra = {"launch_pdl": True} if pdl else {}

    def call() -> object:
        return _gemv_kernel[grid](x, w, y, K=k, N=n, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                  PREFETCH=prefetch, num_warps=warps, num_stages=stages, **extra)
    return call


# Tiles tried for each projection in its chain (--configs; the first was _config's when stop 58 ran it: down's
# is the last since).
CONFIGS = {
    "qkv": [(8, 512, 4, 2), (8, 512, 4, 1), (8, 512, 4, 3), (4, 512, 4, 2), (16, 512, 4, 2), (8, 256, 4, 2),
            (8, 1024, 8, 2), (16, 256, 4, 2), (4, 1024, 4, 2), (16, 512, 8, 2)],
    "o": [(4, 1024, 8, 1), (2, 1024, 8, 1), (4, 512, 4, 2), (2, 512, 4, 2), (4, 2048, 8, 1), (1, 1024, 4, 2),
          (8, 1024, 8, 1), (2, 2048, 8, 2)],
    "gate_up": [(4, 512, 4, 4), (4, 512, 4, 1), (4, 512, 4, 2), (2, 512, 4, 2), (8, 512, 4, 2), (4, 256, 4, 2),
                (4, 1024, 8, 2), (8, 256, 4, 2), (2, 1024, 4, 2), (8, 512, 8, 2)],
    "down": [(4, 1024, 8, 4), (2, 1024, 8, 4), (4, 1024, 8, 2), (2, 512, 4, 2), (4, 2048, 8, 2), (1, 1024, 4, 2),
             (8, 1024, 8, 4), (2, 2048, 8, 2)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="the chains whose names contain this alone")
    parser.add_argument("--configs", action="store_true", help="each projection's chain over CONFIGS' tiles too")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [[(torch.randn(n, k, dtype=DTYPE, device="cuda") / k ** 0.5, norm, silu, res)
               for n, k, norm, silu, res in PROJECTIONS] for _ in range(LAYERS)]
    nbytes = sum(w.numel() * 2 for layer in layers for w, *_ in layer)
    xs = {k: torch.randn(1, k, dtype=DTYPE, device="cuda") for k in (2560, 4096, 9728)}
    nws = {k: torch.rand(k, dtype=DTYPE, device="cuda") + 0.5 for k in xs}
    rstd = torch.rsqrt(xs[2560].float().pow(2).mean() + 1e-6).reshape(1)
    ys = {n: torch.empty(1, n, dtype=DTYPE, device="cuda") for n in (6144, 2560, 19456, 9728)}
    emit(f"# probe_chain: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
         f"{LAYERS} layers x {len(PROJECTIONS)} projections, {nbytes / 1e9:.3f} GB bf16")

    def chain(kind: str, only: int | None = None,
              config: tuple[int, int, int, int] | None = None) -> list[Callable[[], object]]:
        calls: list[Callable[[], object]] = []
        for layer in layers:
            for w, norm, silu, res in layer if only is None else [layer[only]]:
                n, k = w.shape
                x = xs[k]
                if kind == "ops":
                    r = ys[n // 2 if silu else n] if res else None
                    calls.append(lambda x=x, w=w, norm=norm, silu=silu, r=r: gv._launch(
                        x, w, None, nws[x.shape[1]] if norm else None, 1e-6, silu, r, config=config))
                elif kind.startswith("norm"):
                    if not norm:
                        continue
                    calls.append(normed(x, w, nws[k], rstd, ys[n // 2 if silu else n], silu, int(kind[4:])))
                elif kind == "cublas":
                    calls.append(lambda x=x, w=w: F.linear(x, w))
                else:
                    calls.append(bare(x, w, ys[n], kind.startswith("pdl"), kind == "pdl_prefetch"))
        return calls

    for mode in range(5):  # the norm kernel's modes against the op (x normalized for mode 0)
        w = layers[0][2][0]
        x = xs[2560] if mode else gv.rms_norm_reference(xs[2560], nws[2560], 1e-6)
        y = torch.empty(1, w.shape[0] // 2, dtype=DTYPE, device="cuda")
        normed(x, w, nws[2560], rstd, y, True, mode)()
        want = gv.decode_linear(xs[2560], w, None, nws[2560], 1e-6, True)
        emit(f"check norm{mode}: largest error against the op {(y.float() - want.float()).abs().max().item():.4f} "
             f"(of {want.abs().max().item():.3f})")
    # Correctness of the bare kernel, each way (its sums against F.linear's).
    for kind in ("plain", "pdl", "pdl_prefetch"):
        w = layers[0][2][0]
        y = torch.empty(1, w.shape[0], dtype=DTYPE, device="cuda")
        bare(xs[2560], w, y, kind != "plain", kind == "pdl_prefetch")()
        err = (y.float() - F.linear(xs[2560], w).float()).abs().max().item()
        emit(f"check {kind}: largest error against F.linear {err:.4f}")
    everything = torch.cat([w.reshape(-1) for layer in layers for w, *_ in layer])
    big = everything[: everything.numel() // 2560 * 2560].view(-1, 2560)
    y_big = torch.empty(1, big.shape[0], dtype=DTYPE, device="cuda")
    kinds: dict[str, Callable[[], list[Callable[[], object]]]] = {
        kind: (lambda kind=kind: chain(kind)) for kind in ("ops", "plain", "pdl", "pdl_prefetch", "cublas")}
    kinds["one_kernel"] = lambda: [bare(xs[2560], big, y_big, False, False)]
    kinds["torch_sum"] = lambda: [lambda: everything.sum()]
    for i, name in enumerate(NAMES):  # each projection's 12 alone
        for kind in ("ops", "plain", "pdl") + (("norm0", "norm1", "norm2", "norm3", "norm4") if i in (0, 2) else ()):
            kinds[f"{kind}.{name}"] = lambda kind=kind, i=i: chain(kind, i)
        if args.configs:
            for config in CONFIGS[name]:
                kinds[f"ops.{name} {config}"] = lambda i=i, config=config: chain("ops", i, config)
    kinds = {kind: make for kind, make in kinds.items() if args.only in kind}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, make in kinds.items():
            calls = make()
            times[kind].append(graph_time(calls, replays=10) * len(calls))
    for kind, ts in times.items():
        med = statistics.median(ts)
        part = nbytes if "." not in kind else sum(layer[NAMES.index(
            kind.split(".")[1].split(" ")[0])][0].numel() * 2 for layer in layers)
        emit(f"{kind}: us a chain min/median/max {min(ts):.1f} / {med:.1f} / {max(ts):.1f}, "
             f"{part / med / 1e6:.2f} TB/s, {100 * part / med / 1e6 / 4.8:.0f}% of 4.8 TB/s")
    if args.out:
        args.out.write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
