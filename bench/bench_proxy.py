"""Ops run through AOTInductor's proxy executor: a decode step of a stack of
transformers' Qwen3-MoE sparse blocks (their experts call the custom op
``transformers::grouped_mm_fallback``, one call a layer) through an Engine
session (aoti_sessions' proxy executor: csrc/core/proxy_executor.h and
aoti_sessions/_proxy.py) against torch's own runner (``aoti_load_package``,
its OSSProxyExecutor), on the same package, in the same process.

    python bench/bench_proxy.py --device cpu
    python bench/bench_proxy.py --device cuda --out bench/results/proxy_cuda.md

Rounds alternate the two runners; each round times ``--iters`` calls of one
token ([1, 1, hidden]) after a warm-up. Figures: median (min / max) over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

import aoti_sessions as ais


class MoEStack(torch.nn.Module):
    """``layers`` Qwen3-MoE sparse blocks with residuals: x + block(x), repeated."""

    def __init__(self, config: object, layers: int) -> None:
        super().__init__()
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        self.blocks = torch.nn.ModuleList(Qwen3MoeSparseMoeBlock(config) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def proxy_calls(package: str) -> int:
    """Extern nodes the package's libraries run through the proxy executor."""
    with zipfile.ZipFile(package) as archive:
        return sum(len(json.loads(archive.read(n)).get("nodes") or []) for n in archive.namelist()
                   if n.endswith(".json") and "/data/aotinductor/" in n and not n.endswith("metadata.json"))


def per_call_ms(run: object, x: torch.Tensor, iters: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run(x)  # type: ignore[operator]
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def spread(xs: list[float], digits: int = 3) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f} / {max(xs):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--dtype", help="float32 or bfloat16 (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (the CPU's kernels)")
    parser.add_argument("--out")
    args = parser.parse_args()
    import transformers

    cuda = args.device.startswith("cuda")
    device = torch.device(args.device)
    hidden = args.hidden or (1024 if cuda else 512)
    experts = args.experts or (32 if cuda else 16)
    iters = args.iters or (200 if cuda else 50)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if cuda else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=hidden // 2,
                                         num_experts=experts, num_experts_per_tok=args.top_k, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"  # what a model's from_config / from_pretrained picks
    torch.manual_seed(0)
    module = MoEStack(config, args.layers).to(device, dtype).eval()
    x = torch.randn(1, 1, hidden, device=device, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        package = ais.compile(module, (x,), path=f"{tmp}/moe.pt2")
        calls = proxy_calls(package)
        if calls < args.layers:
            sys.exit(f"the package runs {calls} ops through the proxy executor, expected one a layer ({args.layers})")
        torch_runner = torch._inductor.aoti_load_package(package)
        engine = ais.Engine(package, device=args.device)
        session = engine.new_session()
        method = engine.methods[0]

        def ours(t: torch.Tensor) -> torch.Tensor:
            return session.run(method, t)

        want = module(x)
        for name, run in (("aoti_sessions", ours), ("torch", torch_runner)):
            torch.testing.assert_close(run(x).float(), want.float(), atol=5e-2, rtol=5e-2)
        times: dict[str, list[float]] = {"aoti_sessions": [], "torch": []}
        for name, run in (("aoti_sessions", ours), ("torch", torch_runner)):
            per_call_ms(run, x, iters // 4, cuda)  # warm-up
        for r in range(args.rounds):
            order = (("aoti_sessions", ours), ("torch", torch_runner)) if r % 2 == 0 else \
                (("torch", torch_runner), ("aoti_sessions", ours))
            for name, run in order:
                times[name].append(per_call_ms(run, x, iters, cuda))
        engine.close()
    ratios = [a / b for a, b in zip(times["aoti_sessions"], times["torch"])]
    card = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    lines = [f"# A MoE decode step through the proxy executor (bench/bench_proxy.py, {args.device})", "",
             f"{card}; torch {torch.__version__}; transformers {transformers.__version__}. {args.layers} "
             f"Qwen3-MoE sparse blocks (hidden {hidden}, {experts} experts, top {args.top_k}, {dtype}), one token a "
             f"call; {calls} extern-node calls a step through the proxy executor. {args.rounds} rounds of {iters} "
             "calls, runners alternating; median (min / max) over rounds.", "",
             "| runner | ms a step |", "|---|---:|",
             f"| aoti_sessions `Session.run` (its proxy executor) | {spread(times['aoti_sessions'])} |",
             f"| torch `aoti_load_package` (OSSProxyExecutor) | {spread(times['torch'])} |", "",
             f"aoti_sessions / torch, per round: {spread(ratios)} (target <= 1.10)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
