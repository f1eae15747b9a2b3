"""Session lifecycle on a GPU, all figures from one run.

For each model (default: the built-in small and large decoders):
  1. offload (device -> pinned host) and restore (host -> device) of one
     session's state, against torch copies of the same bytes between pinned
     host memory and the device (target: 80%+ of that bandwidth);
  2. save to and load from local disk, against writing (with fsync) and reading
     the same bytes with plain file calls;
  3. decode throughput of sessions taking turns: 10x more sessions than
     memory_budget holds (so every turn restores one session and evicts
     another) against the same sessions all resident, for bursts of 1 and 16
     tokens per turn. Tokens are checked equal between the two.

Writes a Markdown report (default bench/results/lifecycle.md) and prints it.

    python bench/bench_lifecycle.py [--models small,large] [--device cuda] [--out ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import aoti_sessions as ais
from aoti_sessions import models
from aoti_sessions.demo import compiled_decoder

MiB = 1 << 20
GB = 1e9


def make_sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def timed(sync: Callable[[], None], fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def copy_baseline(nbytes: int, device: str, reps: int) -> tuple[float, float]:
    """Seconds of torch's pinned host -> device and device -> host copies of
    `nbytes`, each waited for (as offload and restore are), averaged over
    `reps` back to back after a warm-up."""
    pin = device.startswith("cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream_sync = torch.cuda.current_stream().synchronize if pin else (lambda: None)
    h2d, d2h = [], []
    for i in range(reps + 3):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        stream_sync()
        middle = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        stream_sync()
        if i >= 3:
            h2d.append(middle - start)
            d2h.append(time.perf_counter() - middle)
    return statistics.mean(h2d), statistics.mean(d2h)


def tiers(engine: ais.Engine, reps: int) -> tuple[float, float]:
    """Seconds of one offload and one restore (each returns once the state has
    arrived), averaged over `reps` back to back after a warm-up."""
    s = engine.new_session()
    offload, restore = [], []
    for i in range(reps + 3):  # the first offload allocates the pinned block
        start = time.perf_counter()
        s.offload()
        middle = time.perf_counter()
        s.restore()
        if i >= 3:
            offload.append(middle - start)
            restore.append(time.perf_counter() - middle)
    s.close()
    return statistics.mean(offload), statistics.mean(restore)


def disk(engine: ais.Engine, folder: Path, reps: int, sync: Callable[[], None]) -> dict[str, float]:
    s = engine.new_session()
    path = folder / "session.ais"
    start = time.perf_counter()
    s.save(path)  # first save hashes the model files (the engine's fingerprint)
    out = {"first_save": time.perf_counter() - start}
    saves, loads = [], []
    for _ in range(reps):
        saves.append(timed(sync, lambda: s.save(path)))
        loaded: list[ais.Session] = []
        loads.append(timed(sync, lambda: loaded.append(engine.load_session(path))))
        loaded[0].close()
    out["save"], out["load"] = median(saves), median(loads)
    out["file_bytes"] = path.stat().st_size
    # Plain file calls on the same bytes from host memory.
    data = os.urandom(1 << 20) * max(1, out["file_bytes"] // (1 << 20))
    raw = folder / "raw.bin"
    writes, reads = [], []
    target = bytearray(len(data))  # allocated (and faulted in) once, like the engine's staging block
    target[:] = data
    for _ in range(reps):
        start = time.perf_counter()
        with open(raw, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        with open(raw, "rb") as f:
            f.readinto(target)
        reads.append(time.perf_counter() - start)
    out["raw_write"], out["raw_read"], out["raw_bytes"] = median(writes), median(reads), len(data)
    s.close()
    return out


def round_robin(path: Path, device: str, cfg: models.DecoderConfig, fit: int, burst: int, rounds: int,
                sync: Callable[[], None]) -> dict[str, float]:
    """Tokens per second of 10 x `fit` sessions taking turns, `burst` tokens a
    turn: on an engine whose memory_budget holds `fit` sessions, and on one
    with all of them resident. Rounds alternate between the two engines."""
    n = 10 * fit
    probe = ais.Engine(path, device=device)
    per = probe.bytes_per_session
    probe.close()
    modes = {}
    for mode, budget in (("resident", None), ("round_robin", fit * per)):
        engine = ais.Engine(path, device=device, memory_budget=budget)
        modes[mode] = {"engine": engine, "sessions": [engine.new_session() for _ in range(n)],
                       "tokens": [[(7 * i + 1) % cfg.vocab] for i in range(n)], "seconds": 0.0}
    positions = {mode: [0] * n for mode in modes}
    prepared = [torch.tensor([p], device=device) for p in range(cfg.max_seq)]

    def play_round(mode: str) -> None:
        m = modes[mode]
        for i, s in enumerate(m["sessions"]):
            seq = m["tokens"][i]
            for _ in range(burst):
                pos = positions[mode][i]
                logits = s(torch.tensor([[seq[-1]]], device=device), prepared[pos])
                seq.append(int(logits[0, -1].argmax()))
                positions[mode][i] = pos + 1

    for mode in modes:  # warm-up round (not timed): every session made and moved once
        play_round(mode)
    before = modes["round_robin"]["engine"].stats()
    for _ in range(rounds):
        for mode in modes:
            sync()
            start = time.perf_counter()
            play_round(mode)
            sync()
            modes[mode]["seconds"] += time.perf_counter() - start
    after = modes["round_robin"]["engine"].stats()
    results = {mode: n * rounds * burst / m["seconds"] for mode, m in modes.items()}
    results["round_robin_restores"] = after["restores"] - before["restores"]
    results["identical"] = float(modes["resident"]["tokens"] == modes["round_robin"]["tokens"])
    for m in modes.values():
        for s in m["sessions"]:
            s.close()
        m["engine"].close()
    return results


def run(args: argparse.Namespace) -> tuple[str, bool]:
    device = args.device
    sync = make_sync(device)
    if device.startswith("cuda"):
        card = torch.cuda.get_device_name()
        where = f"Card: {card}"
    else:
        where = "CPU"
    lines = [
        "# aoti-sessions session lifecycle (bench/bench_lifecycle.py)",
        "",
        f"{where}; torch {torch.__version__}; {datetime.date.today()}. Host tier: pinned memory on CUDA. "
        "Copies and offload / restore: means over at least 2 GB moved, each call waited for; disk: medians.",
    ]
    ok = True
    configs = {"small": (models.SMALL, 4), "large": (models.LARGE, 2)}
    for name in args.models.split(","):
        cfg, fit = configs[name]
        path = compiled_decoder(cfg, device)
        engine = ais.Engine(path, device=device)
        S = engine.bytes_per_session
        lines += ["", f"### {name}: {cfg.layers} layers, dim {cfg.dim}, {cfg.max_seq}-token cache, {cfg.dtype}",
                  "", f"State per session S = {S / MiB:.2f} MiB."]
        reps = max(args.reps, int(2e9 // S))  # at least 2 GB moved each way
        h2d, d2h = copy_baseline(S, device, reps)
        offload, restore = tiers(engine, reps)
        off_ratio, res_ratio = d2h / offload, h2d / restore
        lines += [
            "",
            "| move S bytes | ms | GB/s | vs torch pinned copy |",
            "|---|---:|---:|---:|",
            f"| torch copy device -> pinned host | {d2h * 1e3:.3f} | {S / d2h / GB:.1f} | 1.000x |",
            f"| `session.offload()` | {offload * 1e3:.3f} | {S / offload / GB:.1f} | {off_ratio:.3f}x |",
            f"| torch copy pinned host -> device | {h2d * 1e3:.3f} | {S / h2d / GB:.1f} | 1.000x |",
            f"| `session.restore()` | {restore * 1e3:.3f} | {S / restore / GB:.1f} | {res_ratio:.3f}x |",
        ]
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as folder:
            d = disk(engine, Path(folder), args.reps, sync)
        engine.close()
        fb, rb = d["file_bytes"], d["raw_bytes"]
        lines += [
            "",
            f"| to local disk ({args.disk_dir or tempfile.gettempdir()}) | ms | GB/s | vs plain file calls |",
            "|---|---:|---:|---:|",
            f"| plain write + fsync ({rb / MiB:.0f} MiB) | {d['raw_write'] * 1e3:.1f} | {rb / d['raw_write'] / GB:.2f} | 1.00x |",
            f"| `session.save()` (atomic, checksummed; {fb / MiB:.1f} MiB) | {d['save'] * 1e3:.1f} | "
            f"{fb / d['save'] / GB:.2f} | {(fb / d['save']) / (rb / d['raw_write']):.2f}x |",
            f"| plain read (page cache) | {d['raw_read'] * 1e3:.1f} | {rb / d['raw_read'] / GB:.2f} | 1.00x |",
            f"| `engine.load_session()` (checked, to the device) | {d['load'] * 1e3:.1f} | "
            f"{fb / d['load'] / GB:.2f} | {(fb / d['load']) / (rb / d['raw_read']):.2f}x |",
            "",
            f"First save (also hashes the model files for the engine's fingerprint, once): "
            f"{d['first_save'] * 1e3:.0f} ms.",
        ]
        lines += ["", f"Round-robin decode: {10 * fit} sessions taking turns; memory_budget = {fit} x S "
                  "(each turn restores one session and evicts the least recently used), against the same "
                  "sessions all resident.", "",
                  "| tokens per turn | all resident tok/s | round-robin tok/s | ratio | restores | tokens identical |",
                  "|---:|---:|---:|---:|---:|---|"]
        for burst in (1, 16):
            rounds = max(3, args.tokens // (10 * fit * burst))
            r = round_robin(path, device, cfg, fit, burst, rounds, sync)
            same = bool(r["identical"])
            ok = ok and same
            lines.append(f"| {burst} | {r['resident']:.0f} | {r['round_robin']:.0f} | "
                         f"{r['round_robin'] / r['resident']:.3f}x | {r['round_robin_restores']:.0f} | "
                         f"{'yes' if same else 'NO'} |")
        target = "met" if min(off_ratio, res_ratio) >= 0.8 else "MISSED"
        lines += ["", f"Offload / restore at 80%+ of pinned copy bandwidth: {target} "
                  f"({off_ratio:.0%} / {res_ratio:.0%})."]
        print("\n".join(lines[-40:]), flush=True)
    return "\n".join(lines) + "\n", ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=640, help="tokens per round-robin measurement (about)")
    parser.add_argument("--disk-dir", default=None, help="folder on the disk to measure (default: the temp dir)")
    parser.add_argument("--out", default=str(Path(__file__).parent.joinpath("results", "lifecycle.md")))
    args = parser.parse_args()
    report, ok = run(args)
    Path(args.out).write_text(report)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
