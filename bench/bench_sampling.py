"""The batched sampler alone (aoti_sessions.llm.runtime._sampling.sample): the time
of one call over ROWS rows of a real vocabulary's logits, for each mix of
settings, min / median / max over rounds (each round the mean of CALLS calls).

    python bench/bench_sampling.py [--device cpu|cuda] [--rows 1,16,64] [--vocab 151936] [--rounds 15] [--calls 10] [--threads 1]

On the CPU the times are this thread's CPU time (torch on one thread by
default: --threads), steadier than the wall on a shared machine; a small
--vocab shows the host's own work a call. One line a configuration. The plain mixes (greedy; temperature; top-k +
top-p) are what rows cost without penalties, biases, min-p or logprobs; the
others mix rows with them into the same batch (half the rows, or one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from aoti_sessions.llm.runtime._sampling import Sampler, SamplingParams, sample

PLAIN: dict[str, list[dict[str, Any]]] = {
    "greedy": [{"temperature": 0}],
    "temperature": [{"temperature": 0.8}],
    "top_k+top_p": [{"temperature": 0.7, "top_k": 20, "top_p": 0.8}],
    "greedy/top_p mixed": [{"temperature": 0}, {"temperature": 0.7, "top_p": 0.9}],
}
NEW: dict[str, list[dict[str, Any]]] = {
    "greedy, half penalized": [{"temperature": 0}, {"temperature": 0, "presence_penalty": 0.5,
                                                     "frequency_penalty": 0.3, "repetition_penalty": 1.1}],
    "top_p, half penalized": [{"temperature": 0.7, "top_p": 0.9},
                              {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}],
    "greedy, half logit_bias": [{"temperature": 0}, {"temperature": 0, "logit_bias": {5: 3.0, 7: -100.0}}],
    "temperature, half min_p": [{"temperature": 0.8}, {"temperature": 0.8, "min_p": 0.05}],
    "greedy, half logprobs 5": [{"temperature": 0}, {"temperature": 0, "logprobs": 5}],
    "greedy, one logprobs 20": [{"temperature": 0, "logprobs": 20}] + [{"temperature": 0}] * 63,
    "temperature, all of them": [{"temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                                  "repetition_penalty": 1.1, "logit_bias": {5: 3.0}, "logprobs": 5}],
}


def has_new_fields() -> bool:
    return "min_p" in SamplingParams.__dataclass_fields__


def rows_of(mix: list[dict[str, Any]], rows: int, device: torch.device, vocab: int) -> list[Sampler]:
    """``rows`` samplers of ``mix``'s settings in turn (penalized rows' prompt: 64 tokens)."""
    if not has_new_fields():  # (the sampler before penalties: bench it as it was)
        return [Sampler(SamplingParams(seed=r, **mix[r % len(mix)]), {}, device) for r in range(rows)]
    from aoti_sessions.llm.runtime._penalties import Penalties

    shared = Penalties(device)  # (as a step loop's)
    return [Sampler(SamplingParams(seed=r, **mix[r % len(mix)]), {}, device, [t % vocab for t in range(r, r + 64)],
                    shared)
            for r in range(rows)]


def timed(logits: torch.Tensor, samplers: list[Sampler], rounds: int, calls: int) -> list[float]:
    """Seconds a call, each round's mean: the wall on CUDA, this thread's CPU
    time on the CPU (where the sampler's kernels run on it: a shared
    machine's other work then counts for nothing)."""
    device = logits.device
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for _ in range(3):
        sample(logits, samplers)
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(calls):
            tokens = sample(logits, samplers)
        if device.type == "cuda":
            torch.cuda.synchronize()
        else:
            tokens.tolist()
        out.append((clock() - t0) / calls)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen2.5 / Qwen3
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--only", default="", help="configurations whose name contains this")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    mixes = {**PLAIN, **(NEW if has_new_fields() else {})}
    torch.manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, args.vocab) * 3).to(device, getattr(torch, args.dtype))
        for name, mix in mixes.items():
            if args.only not in name:
                continue
            times = timed(logits, rows_of(mix, rows, device, args.vocab), args.rounds, args.calls)
            print(f"rows {rows:3d} {name:28s} ms a call: min {1e3 * min(times):7.3f}  median "
                  f"{1e3 * statistics.median(times):7.3f}  max {1e3 * max(times):7.3f}", flush=True)


if __name__ == "__main__":
    main()
