"""The main job: the built-in decoder, compiled once and cached, serving
several sessions decoded step by step in turn, each checked against a solo run.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch

from . import models
from ._compile import compile as compile_package
from ._engine import Engine, Session
from ._package import cache_dir

__all__ = ["compiled_decoder", "run_demo", "greedy_decode"]


@contextmanager
def _progress(message: str, stream: TextIO) -> Iterator[None]:
    """Shows `message` with the elapsed seconds until the block ends."""
    start = time.monotonic()
    done = threading.Event()
    interactive = stream.isatty()

    def tick() -> None:
        while not done.wait(1.0 if interactive else 15.0):
            elapsed = time.monotonic() - start
            stream.write(f"\r{message} {elapsed:.0f}s" if interactive else f"{message} {elapsed:.0f}s\n")
            stream.flush()

    stream.write(f"{message} ...\n" if not interactive else f"{message} 0s")
    stream.flush()
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        prefix = "\r" if interactive else ""
        stream.write(f"{prefix}{message} done in {time.monotonic() - start:.0f}s\n")
        stream.flush()


def compiled_decoder(
    cfg: models.DecoderConfig = models.SMALL,
    device: str = "cpu",
    steps: int = 1,
    *,
    inductor_configs: dict[str, Any] | None = None,
    progress: TextIO | None = sys.stderr,
) -> Path:
    """The decoder for `cfg` compiled with `steps` tokens per call, from the cache
    (keyed by torch version, model source, config and device) or compiled now."""
    key = hashlib.sha256()
    for part in (torch.__version__, inspect.getsource(models), repr(cfg), torch.device(device).type,
                 str(steps), repr(sorted((inductor_configs or {}).items()))):
        key.update(part.encode())
    target = cache_dir() / "models" / f"decoder-{key.hexdigest()[:24]}.pt2"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    model = models.TinyDecoder(cfg).to(device).eval()
    args = tuple(a.to(device) for a in model.example_inputs(steps))
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=target.parent)
    os.close(fd)
    label = f"compiling the {cfg.layers}-layer decoder for {torch.device(device).type} (T={steps}, cached afterwards)"
    try:
        with torch.no_grad(), (_progress(label, progress) if progress else _nullcontext()):
            compile_package(model, args, path=tmp, inductor_configs=inductor_configs)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield


def greedy_decode(session: Session, prompt: list[int], steps: int, device: torch.device,
                  method: str | None = None) -> tuple[list[int], list[float]]:
    """Feeds `prompt` one token at a time, then `steps` greedy tokens. Returns the
    generated tokens and the seconds of every call."""
    tokens: list[int] = []
    times: list[float] = []
    token = prompt[0]
    for pos in range(len(prompt) + steps - 1):
        if pos < len(prompt):
            token = prompt[pos]
        x = torch.tensor([[token]], device=device)
        p = torch.tensor([pos], device=device)
        start = time.perf_counter()
        logits = session.run(method, x, p) if method else session(x, p)
        token = int(logits[0, -1].argmax())
        times.append(time.perf_counter() - start)
        if pos >= len(prompt) - 1:
            tokens.append(token)
    return tokens, times


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + 1) % vocab for j in range(length)] for i in range(n)]


def run_demo(device: str = "cpu", sessions: int = 4, steps: int = 32, out: TextIO = sys.stdout) -> bool:
    """Decodes `sessions` prompts interleaved step by step and checks each against a
    solo run. Prints a table; returns whether isolation held."""
    if sessions < 1 or steps < 1:
        raise ValueError("sessions and steps must be at least 1")
    dev = torch.device(device)
    cfg = models.SMALL
    path = compiled_decoder(cfg, device)
    engine = Engine(path, device=device)
    prompts = _prompts(sessions, 4, cfg.vocab)
    if len(prompts[0]) + steps > cfg.max_seq:
        raise ValueError(f"steps must be at most {cfg.max_seq - len(prompts[0])} for this model")

    # Interleaved: every call switches to another session (sessions > 1).
    live = [engine.new_session() for _ in range(sessions)]
    generated: list[list[int]] = [[] for _ in range(sessions)]
    switching: list[float] = []
    token = [p[0] for p in prompts]
    before = engine.stats()
    for pos in range(len(prompts[0]) + steps - 1):
        for i, s in enumerate(live):
            if pos < len(prompts[i]):
                token[i] = prompts[i][pos]
            x = torch.tensor([[token[i]]], device=dev)
            p = torch.tensor([pos], device=dev)
            start = time.perf_counter()
            token[i] = int(s(x, p)[0, -1].argmax())
            switching.append(time.perf_counter() - start)
            if pos >= len(prompts[i]) - 1:
                generated[i].append(token[i])
    after = engine.stats()
    binds = after["binds"] - before["binds"]
    bind_seconds = (after["bind_seconds"] - before["bind_seconds"]) / max(binds, 1)
    for s in live:
        s.close()

    # Solo: each prompt alone in a fresh session; every call after the first
    # finds its session already bound.
    same: list[float] = []
    results = []
    for i in range(sessions):
        with engine.new_session() as s:
            solo, times = greedy_decode(s, prompts[i], steps, dev)
        same.extend(times[1:])
        results.append(solo == generated[i])

    ok = all(results)
    rows = [
        ("model", f"{cfg.layers}-layer decoder, dim {cfg.dim}, {cfg.max_seq}-token KV cache, {device}"),
        ("weights", f"{engine.weight_bytes / 2**20:.2f} MiB (loaded once)"),
        ("bytes per session", f"{engine.bytes_per_session / 2**20:.2f} MiB ({len(engine.mutable_fqns)} buffers)"),
        ("sessions x steps", f"{sessions} x {steps} (+{len(prompts[0]) - 1} prompt steps)"),
        ("step, same session", f"{statistics.median(same) * 1e6:.1f} us (median)"),
        ("step, switching", f"{statistics.median(switching) * 1e6:.1f} us (median)"),
        ("bind (switch cost)", f"{bind_seconds * 1e6:.2f} us ({binds} binds)"),
    ]
    for i, good in enumerate(results):
        rows.append((f"session {i} vs solo", f"{'PASS' if good else 'FAIL'}  {generated[i][:8]}..."))
    rows.append(("isolation", "PASS" if ok else "FAIL"))
    width = max(len(k) for k, _ in rows)
    out.write("\naoti-sessions demo\n")
    for k, v in rows:
        out.write(f"  {k:<{width}}  {v}\n")
    engine.close()
    return ok
