"""Structured output's cost in the step loop itself (no server): ROWS chats
decode together through one LLM on the bench_serve model, each turn held to
bench_serve's long JSON schema (masks every step) or not, in turn, ROUNDS
times; per variant the ms a step by the wall and the loop's phases a step
(LLM.stats: queueing, waiting for the device, reading and handing out, which
holds a guided step's masks and sampling), min / median / max over rounds;
then cProfile's table of the step thread over one guided round.

    python bench/profile_grammar.py [--device cuda] [--rows 16] [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import LONG_JSON, bench_package, user_message  # noqa: E402
from profile_llm import step_thread_profiled  # noqa: E402

from aoti_sessions.llm import LLM, ChatSession, Constraint  # noqa: E402
from aoti_sessions.llm.runtime import _grammar  # noqa: E402
from aoti_sessions.llm.process._remote_engine import SWITCH_INTERVAL_S  # noqa: E402

SCHEMA = Constraint.json_schema(LONG_JSON["json_schema"]["schema"])  # type: ignore[index]


def turn(llm: LLM, chats: list[ChatSession], tokens: int, constraint: Constraint | None) -> dict[str, float]:
    """One turn of every chat (reset first), decoding together; the loop's figures a step."""
    for c in chats:
        c.reset()
    before = dict(llm.stats())
    t0 = time.perf_counter()
    gens = [c.start([{"role": "user", "content": user_message(i, 0)}], max_tokens=tokens, temperature=0,
                    ignore_eos=True, constraint=constraint) for i, c in enumerate(chats)]
    for g in gens:
        while g.step() is not None:
            pass
    wall = time.perf_counter() - t0
    after = llm.stats()
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    steps = max(1, d["steps"])
    return {"step": 1e3 * wall / steps, "queue": 1e3 * d["step_queue_seconds"] / steps,
            "wait": 1e3 * d["step_wait_seconds"] / steps, "text": 1e3 * d["step_text_seconds"] / steps,
            "tokens/s": sum(g.completion_tokens for g in gens) / wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # (as a server's engine process does)
    package = bench_package(args.device)
    variants = {"text": (None, _grammar.MASK_SERIAL_ROWS), "json": (SCHEMA, _grammar.MASK_SERIAL_ROWS),
                "json-serial": (SCHEMA, 1 << 20)}
    with LLM(package, device=args.device) as llm:
        chats = [llm.new_session() for _ in range(args.rows)]
        for constraint, _ in variants.values():  # warm: graphs captured, pool grown, grammar compiled
            turn(llm, chats, args.tokens, constraint)
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        default_serial = _grammar.MASK_SERIAL_ROWS
        for _ in range(args.rounds):
            for name, (constraint, serial) in variants.items():
                _grammar.MASK_SERIAL_ROWS = serial
                figures[name].append(turn(llm, chats, args.tokens, constraint))
        _grammar.MASK_SERIAL_ROWS = default_serial
    print(f"{args.rows} rows, {args.tokens} tokens a turn, {args.rounds} rounds; ms a step (and tokens/s): "
          "median (min / max)")
    for name, rounds in figures.items():
        cells = []
        for key in ("tokens/s", "step", "queue", "wait", "text"):
            values = [r[key] for r in rounds]
            cells.append(f"{key} {statistics.median(values):.3f} ({min(values):.3f} / {max(values):.3f})")
        print(f"{name:12s} " + "; ".join(cells), flush=True)
    profile = cProfile.Profile()
    with step_thread_profiled(profile), LLM(package, device=args.device) as llm:
        chats = [llm.new_session() for _ in range(args.rows)]
        turn(llm, chats, args.tokens, SCHEMA)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    print("cProfile of the step thread, one guided turn (prefill and warm-up included):")
    print(out.getvalue())


if __name__ == "__main__":
    main()
