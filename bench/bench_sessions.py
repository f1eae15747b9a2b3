"""Sessions on a GPU, small and large built-in decoders, all figures from one run.

For each model:
  1. per-step time: plain ``aoti_load_package`` call vs one session stepping
     alone vs sessions switched every step (plus torch's bare runner, to show
     where the plain call's Python overhead goes);
  2. one bind vs torch's ``load_constants(..., user_managed=True)`` from Python,
     and vs switching by copying state out and in;
  3. session create (and fork) time as a fraction of the bandwidth of a torch
     memset (copy) of the same bytes on the same device;
  4. device memory for N = 1, 2, 4, 8 sessions against W + N x S, and against N
     separately loaded packages.

Writes a Markdown report (default bench/RESULTS.md) with the card, torch
version and date, and prints it.

    python bench/bench_sessions.py [--models small,large] [--out bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import aoti_sessions as ais
from aoti_sessions import models
from aoti_sessions.demo import compiled_decoder

MiB = 1 << 20


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def used_bytes() -> int:
    gc.collect()
    sync()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def host_timed(fn: Callable[[], object]) -> float:
    """Host time of queueing the call (the device synchronised before, not after)."""
    sync()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def step_times(path: Path, cfg: models.DecoderConfig, rounds: int, steps: int) -> dict[str, float]:
    plain = torch._inductor.aoti_load_package(str(path))
    engine = ais.Engine(path, device="cuda")
    solo = engine.new_session()
    pair = [engine.new_session(), engine.new_session()]
    # torch's runner with the state user-managed in torch-allocated tensors:
    # separates the cost of state living outside the container from our wrapper.
    aliased = torch._inductor.aoti_load_package(str(path))
    aliased.load_constants(solo.state(), check_full_update=False, user_managed=True)
    token = torch.tensor([[7]], device="cuda")
    positions = [torch.tensor([p], device="cuda") for p in range(cfg.max_seq)]
    keys = ("plain", "runner", "runner_um", "same", "switch", "host_plain", "host_runner", "host_same")
    times: dict[str, list[float]] = {k: [] for k in keys}
    step = 0
    for _ in range(rounds):
        for _ in range(steps):
            pos = positions[step % cfg.max_seq]
            step += 1
            times["plain"].append(timed(lambda: plain(token, pos)))
            times["runner"].append(timed(lambda: plain.loader.run([token, pos])))
            times["runner_um"].append(timed(lambda: aliased.loader.run([token, pos])))
            times["same"].append(timed(lambda: solo(token, pos)))
            s = pair[step % 2]
            times["switch"].append(timed(lambda: s(token, pos)))
            times["host_plain"].append(host_timed(lambda: plain(token, pos)))
            times["host_runner"].append(host_timed(lambda: plain.loader.run([token, pos])))
            times["host_same"].append(host_timed(lambda: solo(token, pos)))
    del aliased
    stats = engine.stats()
    out = {k: median_us(v) for k, v in times.items()}
    out["bind"] = stats["bind_seconds"] / stats["binds"] * 1e6
    out["reclaim"] = stats["reclaim_seconds"] / stats["binds"] * 1e6

    # torch's own Python rebind, on another loader, of two sets of state tensors.
    rebound = torch._inductor.aoti_load_package(str(path))
    sets = [pair[0].state(), pair[1].state()]
    torch_bind = []
    for i in range(400):
        start = time.perf_counter()
        rebound.load_constants(sets[i % 2], check_full_update=False, user_managed=True)
        torch_bind.append(time.perf_counter() - start)
    out["torch_bind"] = median_us(torch_bind[50:])
    # Switching by copies: one session's state out, the other's in (2 x S bytes moved).
    live, parked = pair[0].state(), [pair[0].state(), pair[1].state()]

    def copy_switch(i: int) -> None:
        for k in live:
            parked[i % 2][k].copy_(live[k])
            live[k].copy_(parked[(i + 1) % 2][k])

    out["copy_switch"] = median_us([timed(lambda: copy_switch(i)) for i in range(100)][10:])
    del rebound, sets, live, parked
    for s in [solo, *pair]:
        s.close()
    engine.close()
    del plain
    return out


def create_times(path: Path, reps: int) -> dict[str, float]:
    engine = ais.Engine(path, device="cuda")
    size = engine.bytes_per_session
    scratch = torch.empty(size, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(scratch)
    memset = median_us([timed(scratch.zero_) for _ in range(reps)][5:])
    copy = median_us([timed(lambda: other.copy_(scratch)) for _ in range(reps)][5:])
    parent = engine.new_session()

    def churn(make: Callable[[], ais.Session]) -> list[float]:
        """Close one, create one: the pool's spare block is reused each time."""
        samples = []
        for _ in range(reps):
            made: list[ais.Session] = []
            samples.append(timed(lambda: made.append(make())))
            made[0].close()
        return samples

    create, fork = churn(engine.new_session), churn(parent.fork)
    parent.close()
    engine.close()
    return {"bytes": size, "memset": memset, "copy": copy, "create": median_us(create[5:]),
            "fork": median_us(fork[5:]), "zero_template": engine.template_bytes == 0}


def memory(path: Path) -> dict[str, object]:
    base = used_bytes()
    engine = ais.Engine(path, device="cuda")
    loaded = used_bytes() - base
    w, s = engine.weight_bytes, engine.bytes_per_session
    ours = {}
    sessions = []
    for n in (1, 2, 4, 8):
        while len(sessions) < n:
            sessions.append(engine.new_session())
        ours[n] = used_bytes() - base
    for x in sessions:
        x.close()
    engine.close()
    del engine, sessions
    separate = {}
    for n in (1, 2, 4, 8):
        copies = [torch._inductor.aoti_load_package(str(path)) for _ in range(n)]
        separate[n] = used_bytes() - base
        del copies
    return {"W": w, "S": s, "loaded": loaded, "ours": ours, "separate": separate}


def report(cfg_name: str, cfg: models.DecoderConfig, steps: dict[str, float], create: dict[str, float],
           mem: dict[str, object]) -> tuple[list[str], list[tuple[str, bool]]]:
    lines = [f"### {cfg_name}: {cfg.layers} layers, dim {cfg.dim}, {cfg.max_seq}-token cache, {cfg.dtype}", ""]
    w, s = int(mem["W"]), int(mem["S"])  # type: ignore[call-overload]
    lines += [f"Weights W = {w / MiB:.1f} MiB, state per session S = {s / MiB:.2f} MiB.", ""]
    lines += ["| per step | us | vs plain |", "|---|---:|---:|"]
    for key, name in (("plain", "plain `aoti_load_package` call"), ("runner", "torch's bare runner (`loader.run`)"),
                      ("runner_um", "torch's bare runner, state user-managed in torch tensors"),
                      ("same", "session, same every step"), ("switch", "sessions, switching every step")):
        lines.append(f"| {name} | {steps[key]:.1f} | {steps[key] / steps['plain']:.3f}x |")
    lines += ["", "| host time to queue one step (no sync after) | us | vs plain |", "|---|---:|---:|"]
    for key, name in (("host_plain", "plain call"), ("host_runner", "torch's bare runner"),
                      ("host_same", "session, same every step")):
        lines.append(f"| {name} | {steps[key]:.1f} | {steps[key] / steps['host_plain']:.3f}x |")
    lines += ["", "| switching cost | us | vs our bind |", "|---|---:|---:|"]
    for key, name in (("bind", "our bind (on the run path)"), ("reclaim", "our leak reclaim (after the run)"),
                      ("torch_bind", "torch `load_constants(user_managed=True)`"),
                      ("copy_switch", "copy state out + in")):
        lines.append(f"| {name} | {steps[key]:.2f} | {steps[key] / steps['bind']:.1f}x |")
    size = create["bytes"]
    lines += ["", "| state of S bytes | us | GB/s |", "|---|---:|---:|"]
    for key, name in (("memset", "torch memset (zero_)"), ("copy", "torch device copy (copy_)"),
                      ("create", "new_session (zero template: memset)"), ("fork", "fork (device copy)")):
        lines.append(f"| {name} | {create[key]:.1f} | {size / create[key] / 1e3:.1f} |")
    ours, separate = mem["ours"], mem["separate"]
    lines += ["", f"Engine loaded: {int(mem['loaded']) / MiB:.1f} MiB (W + the container's own state copy "
              "+ kernels).", "",
              "| N | ours MiB | W + N*S MiB | ratio | N packages MiB | saved |", "|---:|---:|---:|---:|---:|---:|"]
    for n in (1, 2, 4, 8):
        o, sep = ours[n], separate[n]  # type: ignore[index]
        ideal = w + n * s
        lines.append(f"| {n} | {o / MiB:.1f} | {ideal / MiB:.1f} | {o / ideal:.3f} | {sep / MiB:.1f} | "
                     f"{sep / o:.1f}x |")
    memory_ok = all(ours[n] <= (w + n * s + s) * 1.01 for n in (1, 2, 4, 8))  # type: ignore[index]
    create_ok = create["create"] <= create["memset"] / 0.7 if create["zero_template"] else \
        create["create"] <= create["copy"] / 0.7
    targets = [
        (f"{cfg_name}: same-session step within 2% of the plain call", steps["same"] <= steps["plain"] * 1.02),
        (f"{cfg_name}: switching step within 3% of the plain call", steps["switch"] <= steps["plain"] * 1.03),
        (f"{cfg_name}: bind at least 5x cheaper than torch's Python rebind", steps["torch_bind"] >= 5 * steps["bind"]),
        (f"{cfg_name}: session create at 70%+ of memset/copy bandwidth", create_ok),
        (f"{cfg_name}: memory within W + N*S + one state copy + 1%", memory_ok),
    ]
    return lines, targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).with_name("RESULTS.md")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_sessions needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = {"small": models.SMALL, "large": models.LARGE}
    doc = [
        "# aoti-sessions on a GPU (bench/bench_sessions.py)",
        "",
        f"Card: {torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"{datetime.date.today().isoformat()}. Medians of wall time with the device synchronised around "
        "each call; configurations interleaved in rounds.",
        "",
    ]
    targets: list[tuple[str, bool]] = []
    for name in args.models.split(","):
        cfg = configs[name]
        path = compiled_decoder(cfg, "cuda")
        mem = memory(path)
        steps = step_times(path, cfg, args.rounds, args.steps)
        create = create_times(path, 40)
        lines, met = report(name, cfg, steps, create, mem)
        doc += lines + [""]
        targets += met
    doc += ["## Targets", "", "| target | |", "|---|---|"]
    doc += [f"| {t} | {'met' if ok else 'MISSED'} |" for t, ok in targets]
    text = "\n".join(doc) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
