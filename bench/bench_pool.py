"""Batched decode over pooled state, at the engine (issue 18).

    python bench/bench_pool.py [--device cuda|cpu] [--rounds 3] [--out FILE]

On bench_serve's model (random Qwen3; 16 layers, hidden 1024, bf16 on CUDA),
exported by ``aoti_sessions.llm.export`` (pooled, paged KV cache):

- decode step time and tokens/s against the number of sessions stepped at
  once (``Engine.run_batch``, graphs per padded batch size), each session
  holding 128 tokens, min / median / max over rounds; the ratio to one session;
- that every row of a batched step equals the same session stepped alone;
- memory: 64 sessions of 128 tokens each, the pool's pages in use and the
  pool allocated, against 64 sessions' full static caches (context x layers x
  2 x kv heads x head dim);
- a fork of a 512-token session: pages copied by the fork and by the first
  step of each side (copy on write), and the fork's time.

Prints one line per configuration and writes a markdown table with --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import CONTEXT, bench_package  # noqa: E402

import aoti_sessions as ais  # noqa: E402
from aoti_sessions.llm._spec import read_llm_package  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64)
HELD = 128     # tokens each session holds when stepped
STEPS = 40     # timed decode steps per configuration and round


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def prefill(engine: ais.Engine, sessions: list[ais.Session], tokens: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    chunk = 64
    for s in sessions:
        ids = torch.randint(0, vocab, (tokens,), generator=g)
        for start in range(0, tokens, chunk):
            part = ids[start:start + chunk].to(engine.device)
            s.run("prefill", part[None])


def step_times(engine: ais.Engine, rows: int, rounds: int, vocab: int, device: str) -> list[float]:
    """Milliseconds per decode step of `rows` sessions, one figure per round."""
    sessions = [engine.new_session() for _ in range(rows)]
    try:
        prefill(engine, sessions, HELD, vocab, seed=rows)
        ids = torch.randint(0, vocab, (rows, 1), device=engine.device)
        for _ in range(6):  # warm-up: eager runs, then the bucket's graph is captured
            engine.run_batch("decode", sessions, ids)
        out = []
        for _ in range(rounds):
            for s in sessions:
                s.truncate(HELD)  # every round steps from the same length
            sync(device)
            start = time.perf_counter()
            for _ in range(STEPS):
                engine.run_batch("decode", sessions, ids)
            sync(device)
            out.append((time.perf_counter() - start) / STEPS * 1e3)
        return out
    finally:
        for s in sessions:
            s.close()


def rows_agree(engine: ais.Engine, vocab: int) -> float:
    """Largest difference between a batched step's rows and the same sessions stepped alone."""
    alone = [engine.new_session() for _ in range(5)]
    batched = [engine.new_session() for _ in range(5)]
    prefill(engine, alone, 40, vocab, seed=5)
    prefill(engine, batched, 40, vocab, seed=5)
    ids = torch.randint(0, vocab, (5, 1), device=engine.device)
    worst = 0.0
    for _ in range(4):
        together = engine.run_batch("decode", batched, ids).float()
        each = torch.cat([engine.run_batch("decode", [s], ids[i:i + 1]) for i, s in enumerate(alone)]).float()
        worst = max(worst, float((together - each).abs().max()))
        ids = together.argmax(-1, keepdim=True)
    for s in alone + batched:
        s.close()
    return worst


def memory(engine: ais.Engine, vocab: int) -> dict[str, float]:
    pool = engine.pool
    assert pool is not None
    sessions = [engine.new_session() for _ in range(64)]
    prefill(engine, sessions, HELD, vocab, seed=64)
    stats = engine.stats()
    page_bytes = pool["page_bytes"]
    per_token = page_bytes / pool["page_size"]
    full = 64 * CONTEXT * per_token
    used = stats["pool_pages_used"] * page_bytes
    allocated = engine.memory_report()["device" if engine.device.type == "cuda" else "host"]["pool"]
    for s in sessions:
        s.close()
    return {"full_mb": full / 2**20, "used_mb": used / 2**20, "allocated_mb": allocated / 2**20,
            "used_ratio": used / full, "allocated_ratio": allocated / full}


def fork_copies(engine: ais.Engine, vocab: int, device: str) -> dict[str, float]:
    s = engine.new_session()
    prefill(engine, [s], 512 - 5, vocab, seed=512)  # 507 tokens: the last page is partly full
    before = engine.stats()["pages_copied"]
    sync(device)
    start = time.perf_counter()
    child = s.fork()
    sync(device)
    fork_ms = (time.perf_counter() - start) * 1e3
    at_fork = engine.stats()["pages_copied"] - before
    ids = torch.zeros(1, 1, dtype=torch.long, device=engine.device)
    engine.run_batch("decode", [s], ids)
    engine.run_batch("decode", [child], ids)
    after_steps = engine.stats()["pages_copied"] - before
    pages = engine.stats()["pool_pages_used"]
    s.close()
    child.close()
    return {"fork_ms": fork_ms, "copied_by_fork": at_fork, "copied_after_both_step": after_steps,
            "pages_in_use": pages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = args.device
    package = bench_package(device)
    engine = ais.Engine(package, device=device)
    vocab = read_llm_package(package).spec.vocab_size
    lines = [f"# bench_pool ({device}: {torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}, "
             f"torch {torch.__version__})", "", f"pool: {engine.pool}", ""]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"rows agree with solo steps: max |diff| = {rows_agree(engine, vocab):.3g}")
    say("")
    say("| sessions | step ms (min / median / max) | tokens/s (median) | vs 1 session |")
    say("|---:|---:|---:|---:|")
    base = None
    for rows in (int(r) for r in args.rows.split(",")):
        times = step_times(engine, rows, args.rounds, vocab, device)
        rate = rows / statistics.median(times) * 1e3
        base = base or rate
        say(f"| {rows} | {spread(times)} | {rate:,.0f} | {rate / base:.2f}x |")
    say("")
    m = memory(engine, vocab)
    say(f"memory, 64 sessions x {HELD} tokens (context {CONTEXT}): pages in use {m['used_mb']:.1f} MiB = "
        f"{m['used_ratio']:.1%} of 64 full caches ({m['full_mb']:.1f} MiB); pool allocated {m['allocated_mb']:.1f} "
        f"MiB = {m['allocated_ratio']:.1%}")
    f = fork_copies(engine, vocab, device)
    say(f"fork of a 507-token session: {f['copied_by_fork']:.0f} pages copied by the fork ({f['fork_ms']:.3f} ms), "
        f"{f['copied_after_both_step']:.0f} after both sides stepped once; {f['pages_in_use']:.0f} pages in use")
    say(f"stats: {engine.stats()['pool_grows']} pool grows, {engine.stats()['graph_captures']} graph captures")
    engine.close()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
