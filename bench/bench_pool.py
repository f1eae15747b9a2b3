"""Batched decode over pooled state, at the engine (issue 18).

    python bench/bench_pool.py [--device cuda|cpu] [--family qwen3|qwen3_moe|gpt_oss|qwen3_next|qwen3_5_moe|lfm2|
                               mamba2] [--rows 1,2,4,...] [--rounds 3] [--dtype float32] [--out FILE]

On bench_serve's model of ``--family`` (random weights: the dense Qwen3 by
default, 16 layers, hidden 1024, bf16 on CUDA; the other families at the same
widths, 4 layers on the CPU and 8 on CUDA: ``bench_serve.family_config``), exported by
``aoti_sessions.llm.export`` (pooled: a paged KV cache, and slot tensors,
one slot a session, where the package has them: the recurrent state of
hybrid models and Mamba2, GPT-OSS's rings of its window layers):

- decode step time and tokens/s against the number of sessions stepped at
  once (``Engine.run_batch``, graphs per padded batch size), each session
  holding 128 tokens, min / median / max over rounds; the ratio to one session.
  Row counts past the decode method's most rows are left out; those under its
  least (``min_rows``: 2 for recurrent state) run padded with scratch rows;
- that every row of a batched step equals the same session stepped alone:
  the logits and the session's state after the steps (pages and slots);
- memory: 64 sessions of 128 tokens each, the pool's pages and slots in use
  and the pool allocated, against 64 sessions' full static caches (context x
  layers x 2 x kv heads x head dim, plus a slot each);
- a fork of a 512-token session: pages copied by the fork and by the first
  step of each side (copy on write), and the fork's time.

Sessions are prefilled as the package says (``prefill_rows`` in its
``llm.json``: many sessions a call, or one for recurrent state); a session
with a slot rewinds to a checkpoint between rounds. Prints one line per
configuration and writes a markdown table with --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import CONTEXT, FAMILIES, bench_package  # noqa: E402

import aoti_sessions as ais  # noqa: E402
from aoti_sessions._package import open_model  # noqa: E402
from aoti_sessions.llm._spec import LLMSpec, read_llm_package  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64)
HELD = 128     # tokens each session holds when stepped
STEPS = 40     # timed decode steps per configuration and round
CHUNK = 64     # tokens a prefill call feeds each session
SESSIONS = 64  # sessions of the memory figure
# How far a batched row may be from the same session stepped alone, relative
# to the tensor's largest value (logits, each pooled tensor): a row's sums may
# round differently in another row count's kernels; recurrent state carries a
# step's rounding into the next steps.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def chunks(tokens: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of prefill calls over `tokens`, each 2 to `size` long (a prefill takes 2 tokens or more)."""
    bounds = list(range(0, tokens, size)) + [tokens]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < 2:
        bounds[-2] -= 2 - (bounds[-1] - bounds[-2])
    return list(zip(bounds, bounds[1:]))


def prefill(engine: ais.Engine, spec: LLMSpec, sessions: list[ais.Session], tokens: int, seed: int) -> None:
    """`tokens` random tokens into each session, `spec.prefill_rows` sessions a call."""
    ids = torch.randint(0, spec.vocab_size, (len(sessions), tokens), generator=torch.Generator().manual_seed(seed))
    rows = max(1, min(spec.prefill_rows, len(sessions)))
    for first in range(0, len(sessions), rows):
        group = sessions[first:first + rows]
        for start, end in chunks(tokens, min(CHUNK, spec.max_prefill)):
            engine.run_batch("prefill", group, ids[first:first + len(group), start:end].to(engine.device))


def step_times(engine: ais.Engine, spec: LLMSpec, rows: int, rounds: int, device: str) -> list[float]:
    """Milliseconds per decode step of `rows` sessions, one figure per round."""
    sessions = [engine.new_session() for _ in range(rows)]
    try:
        prefill(engine, spec, sessions, HELD, seed=rows)
        if spec.recurrent:  # a slot rewinds only to a checkpoint
            for s in sessions:
                s.checkpoint(keep=1)
        ids = torch.randint(0, spec.vocab_size, (rows, 1), device=engine.device)
        for _ in range(6):  # warm-up: eager runs, then the bucket's graph is captured
            engine.run_batch("decode", sessions, ids)
        out = []
        for _ in range(rounds):
            for s in sessions:
                s.truncate(HELD)  # every round steps from the same length (and state)
                if spec.recurrent and HELD not in s.checkpoints:
                    s.checkpoint(keep=1)
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


def largest(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """max |a - b| and max |b| (in float32)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max()), float(b.abs().max())


def rows_agree(engine: ais.Engine, spec: LLMSpec, sessions: int = 5, steps: int = 4) -> str:
    """Largest differences between a batched step's rows and the same sessions stepped alone: logits at each
    step, then each pooled tensor of the sessions' state; and whether the greedy tokens agree."""
    alone = [engine.new_session() for _ in range(sessions)]
    batched = [engine.new_session() for _ in range(sessions)]
    try:
        prefill(engine, spec, alone, 40, seed=5)
        prefill(engine, spec, batched, 40, seed=5)
        ids = torch.randint(0, spec.vocab_size, (sessions, 1), device=engine.device)
        logits = [0.0, 0.0]
        same_tokens = True
        for _ in range(steps):
            together = engine.run_batch("decode", batched, ids)
            each = torch.cat([engine.run_batch("decode", [s], ids[i:i + 1]) for i, s in enumerate(alone)])
            diff, scale = largest(together, each)
            logits = [max(logits[0], diff), max(logits[1], scale)]
            same_tokens &= bool(torch.equal(together.argmax(-1), each.argmax(-1)))
            ids = each.argmax(-1, keepdim=True)
        state: dict[str, list[float]] = {}
        for b, a in zip(batched, alone):
            solo = a.state()
            for name, t in b.state().items():
                if t.numel():  # (a Mamba2 package's pages hold nothing)
                    diff, scale = largest(t, solo[name])
                    worst = state.setdefault(name, [0.0, 0.0])
                    state[name] = [max(worst[0], diff), max(worst[1], scale)]
    finally:
        for s in alone + batched:
            s.close()
    parts = [f"logits {logits[0]:.3g} (of max |logit| {logits[1]:.3g})"]
    parts += [f"{name} {d:.3g} (of {m:.3g})" for name, (d, m) in state.items()]
    figures = [logits, *state.values()]
    tolerance = TOLERANCE.get(spec.dtype, TOLERANCE["float32"])
    if all(d == 0 for d, _ in figures):
        verdict = "exact"
    elif all(d <= tolerance * m for d, m in figures):
        verdict = f"not exact, within {tolerance:g} of each tensor's largest value"
    else:
        verdict = f"OVER {tolerance:g} of a tensor's largest value"
    return (f"rows agree with solo steps ({sessions} sessions, {steps} steps): max |diff| = " + ", ".join(parts)
            + f"; {verdict}; greedy tokens {'equal' if same_tokens else 'DIFFER'}")


def memory(engine: ais.Engine, spec: LLMSpec) -> dict[str, float]:
    pool = engine.pool
    assert pool is not None
    before = engine.stats()
    sessions = [engine.new_session() for _ in range(SESSIONS)]
    prefill(engine, spec, sessions, HELD, seed=SESSIONS)
    stats = engine.stats()
    page_bytes, slot_bytes = pool["page_bytes"], pool["slot_bytes"]
    full_pages = SESSIONS * CONTEXT * page_bytes / pool["page_size"]
    full_slots = SESSIONS * slot_bytes
    pages = (stats["pool_pages_used"] - before["pool_pages_used"]) * page_bytes
    slots = (stats["pool_slots_used"] - before["pool_slots_used"]) * slot_bytes
    allocated = engine.memory_report()["device" if engine.device.type == "cuda" else "host"]["pool"]
    for s in sessions:
        s.close()
    full = full_pages + full_slots
    mib = 2**20
    return {"full_mb": full / mib, "full_pages_mb": full_pages / mib, "full_slots_mb": full_slots / mib,
            "pages_mb": pages / mib, "slots_mb": slots / mib, "allocated_mb": allocated / mib,
            "used_ratio": (pages + slots) / full, "allocated_ratio": allocated / full}


def fork_copies(engine: ais.Engine, spec: LLMSpec, device: str) -> dict[str, float]:
    s = engine.new_session()
    prefill(engine, spec, [s], 512 - 5, seed=512)  # 507 tokens: the last page is partly full
    before = engine.stats()
    sync(device)
    start = time.perf_counter()
    child = s.fork()
    sync(device)
    fork_ms = (time.perf_counter() - start) * 1e3
    at_fork = engine.stats()["pages_copied"] - before["pages_copied"]
    ids = torch.zeros(1, 1, dtype=torch.long, device=engine.device)
    engine.run_batch("decode", [s], ids)
    engine.run_batch("decode", [child], ids)
    stats = engine.stats()
    s.close()
    child.close()
    return {"fork_ms": fork_ms, "copied_by_fork": at_fork,
            "copied_after_both_step": stats["pages_copied"] - before["pages_copied"],
            "pages_in_use": stats["pool_pages_used"], "slots_in_use": stats["pool_slots_used"]}


def decode_rows(package: Path) -> tuple[int, int]:
    """The least and most rows a decode call takes, from the package's pool metadata."""
    method = next(m for m in open_model(package) if m.name == "decode")
    assert method.metadata is not None and method.metadata.pool is not None, "decode is not a pooled method"
    return method.metadata.pool.min_rows, method.metadata.pool.max_rows


def row_counts(asked: Sequence[int], most: int) -> tuple[list[int], list[int]]:
    """`asked` split into the counts a decode call takes and those past its `most`."""
    return [r for r in asked if r <= most], [r for r in asked if r > most]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--family", default="qwen3", choices=FAMILIES, help="the model's family (default qwen3)")
    parser.add_argument("--dtype", default=None, help="the weights' dtype (default: float32 on CPU, bf16 on CUDA)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="sessions a step, comma separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = args.device
    package = bench_package(device, args.family, **({"dtype": args.dtype} if args.dtype else {}))
    spec = read_llm_package(package).spec
    least, most = decode_rows(package)
    engine = ais.Engine(package, device=device)
    assert engine.pool is not None
    card = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    lines = [f"# bench_pool {args.family} ({spec.architecture}, {spec.dtype}; {device}: {card}, "
             f"torch {torch.__version__})", "",
             f"package: decode rows {least}..{most}, prefill rows {spec.prefill_rows}, max prefill "
             f"{spec.max_prefill}, recurrent state: {'yes' if spec.recurrent else 'no'}", "",
             f"pool: {engine.pool}", ""]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    print("\n".join(lines), flush=True)
    rows, past = row_counts([int(r) for r in args.rows.split(",")], min(most, engine.pool["max_rows"]))
    say(rows_agree(engine, spec))
    say("")
    if past:
        say(f"(left out: {', '.join(map(str, past))} sessions, past the {most} rows a decode call takes)")
    say("| sessions | step ms (min / median / max) | tokens/s (median) | vs 1 session |")
    say("|---:|---:|---:|---:|")
    base = None
    for n in rows:
        times = step_times(engine, spec, n, args.rounds, device)
        rate = n / statistics.median(times) * 1e3
        base = base or rate
        shown = f"{n} (runs {least} rows)" if n < least else str(n)
        say(f"| {shown} | {spread(times)} | {rate:,.0f} | {rate / base:.2f}x |")
    say("")
    m = memory(engine, spec)
    say(f"memory, {SESSIONS} sessions x {HELD} tokens (context {CONTEXT}): pages in use {m['pages_mb']:.1f} MiB + "
        f"slots in use {m['slots_mb']:.1f} MiB = {m['used_ratio']:.1%} of {SESSIONS} full caches "
        f"({m['full_mb']:.1f} MiB: pages {m['full_pages_mb']:.1f} + slots {m['full_slots_mb']:.1f}); "
        f"pool allocated {m['allocated_mb']:.1f} MiB = {m['allocated_ratio']:.1%}")
    f = fork_copies(engine, spec, device)
    say(f"fork of a 507-token session: {f['copied_by_fork']:.0f} pages copied by the fork ({f['fork_ms']:.3f} ms), "
        f"{f['copied_after_both_step']:.0f} after both sides stepped once; {f['pages_in_use']:.0f} pages and "
        f"{f['slots_in_use']:.0f} slots in use")
    say(f"stats: {engine.stats()['pool_grows']} pool grows, {engine.stats()['graph_captures']} graph captures")
    engine.close()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
