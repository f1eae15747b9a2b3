"""Per-step cost of sessions and of switching between them, on the built-in decoder.

Compares, in one run and on one model:
  * a plain ``torch._inductor.aoti_load_package`` call (no sessions),
  * torch's bare runner (``loader.run``, no Python wrapper),
  * an aoti_sessions session stepping alone (no bind after its first step),
  * two sessions switched every step (each keeps a lane: no bind),
  * the same with one lane (one bind per step),
and the cost of one bind against torch's own ``load_constants(...,
user_managed=True)`` from Python and against switching by copying state in/out.

Configurations are measured in interleaved rounds, so drift hits all alike;
each round times a burst of calls per configuration (the device synchronised
around it), and the report prints median (min / max) over rounds of the time
per call. One line per configuration.

    python bench/bench_switch.py [--device cpu|cuda] [--model small|large] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import aoti_sessions as ais
from aoti_sessions import models
from aoti_sessions.demo import compiled_decoder


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def once(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return once


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("small", "large"), default="small")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50, help="calls per configuration per round")
    parser.add_argument("--json", help="also write the figures (seconds) to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = models.SMALL if args.model == "small" else models.LARGE
    path = compiled_decoder(cfg, args.device)
    once = _timer(device)

    plain = torch._inductor.aoti_load_package(str(path))
    engine = ais.Engine(path, device=args.device, cuda_graphs=False)
    solo = engine.new_session()
    pair = [engine.new_session(), engine.new_session()]
    one_lane = ais.Engine(path, device=args.device, cuda_graphs=False, lanes=1)
    thrash = [one_lane.new_session(), one_lane.new_session()]
    token = torch.tensor([[7]], device=device)
    positions = [torch.tensor([p], device=device) for p in range(cfg.max_seq)]

    # torch's own rebind, on a second loader so the plain one stays untouched:
    # two sets of state tensors bound alternately.
    rebound = torch._inductor.aoti_load_package(str(path))
    fqns = list(engine.mutable_fqns)
    state_sets = [s.state() for s in pair]
    # Switching by copies: one session's state copied out, another's in.
    live = pair[0].state()
    parked = [s.state() for s in pair]

    keys = ("plain", "runner", "same", "switch", "switch_one_lane", "torch_bind", "copy_switch")

    def copy_switch(i: int) -> None:
        out, into = parked[(i + 1) % 2], parked[i % 2]
        for k in fqns:
            out[k].copy_(live[k])
            live[k].copy_(into[k])

    calls: dict[str, Callable[[int], object]] = {
        "plain": lambda i: plain(token, positions[i]),
        "runner": lambda i: plain.loader.run([token, positions[i]]),
        "same": lambda i: solo(token, positions[i]),
        "switch": lambda i: pair[i % 2](token, positions[i]),
        "switch_one_lane": lambda i: thrash[i % 2](token, positions[i]),
        "torch_bind": lambda i: rebound.load_constants(state_sets[i % 2], check_full_update=False,
                                                       user_managed=True),
        "copy_switch": copy_switch,
    }
    # Each round times a burst of `steps` calls per configuration (the device
    # synchronised around the burst, after a few untimed calls), configurations
    # one after another.
    rounds: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args.rounds + 1):  # round 0 warms up
        for k in keys:
            fn = calls[k]
            for i in range(5):  # untimed: the caches hold what the previous configuration used
                fn(i)
            seconds = once(lambda: [fn((r * args.steps + i) % cfg.max_seq) for i in range(args.steps)])
            if r > 0:
                rounds[k].append(seconds / args.steps)

    stats = one_lane.stats()
    bind = stats["bind_seconds"] / stats["binds"]
    reclaim = stats["reclaim_seconds"] / stats["binds"]
    med = {k: statistics.median(v) for k, v in rounds.items()}
    base = med["plain"]
    print(f"\nbench_switch: {cfg.layers}-layer decoder ({args.model}), {engine.bytes_per_session / 2**20:.2f} MiB "
          f"state in {len(fqns)} buffers, {engine.weight_bytes / 2**20:.1f} MiB weights, {device}, "
          f"torch {torch.__version__}, {args.rounds}x{args.steps} calls each")
    rows = [
        ("plain aoti_load_package call", med["plain"], f"{1.0:.3f}x plain"),
        ("torch's bare runner (loader.run)", med["runner"], f"{med['runner'] / base:.3f}x plain"),
        ("session, same every step", med["same"],
         f"{med['same'] / base:.3f}x plain, {med['same'] / med['runner']:.3f}x runner"),
        ("sessions, switching every step", med["switch"],
         f"{med['switch'] / med['same']:.3f}x same session ({engine.stats()['binds']} binds in all)"),
        ("switching, one lane (binds)", med["switch_one_lane"],
         f"{med['switch_one_lane'] / med['same']:.3f}x same session"),
        ("bind on switch (ours, run path)", bind, f"{stats['binds']} binds"),
        ("handle reclaim (ours, after run)", reclaim, "leak fix, off the bind"),
        ("torch load_constants(user_managed)", med["torch_bind"], f"{med['torch_bind'] / bind:.1f}x our bind"),
        ("switch by copying state out+in", med["copy_switch"], f"{med['copy_switch'] / bind:.1f}x our bind"),
    ]
    spreads = {"plain aoti_load_package call": "plain", "torch's bare runner (loader.run)": "runner",
               "session, same every step": "same", "sessions, switching every step": "switch",
               "switching, one lane (binds)": "switch_one_lane", "torch load_constants(user_managed)": "torch_bind",
               "switch by copying state out+in": "copy_switch"}
    for name, seconds, note in rows:
        key = spreads.get(name)
        extra = f" ({min(rounds[key]) * 1e6:.2f} / {max(rounds[key]) * 1e6:.2f})" if key else ""
        print(f"  {name:<36} {seconds * 1e6:10.2f} us{extra}   {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: seconds for name, seconds, _ in rows}, f)
    engine.close()
    one_lane.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
