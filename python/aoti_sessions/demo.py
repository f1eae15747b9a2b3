"""The main job: the built-in decoder, compiled once and cached, serving
several sessions decoded step by step in turn, each checked against a solo run.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch

from . import models
from ._compile import compile_cached
from ._engine import Engine, Session

__all__ = ["compiled_decoder", "run_demo", "GreedyDecoding", "quiet_torch"]


@contextmanager
def quiet_torch() -> Iterator[None]:
    """Hides torch's notes about its own internals (deprecations inside torch,
    compiler hints; some raised through copyreg on its behalf), which a demo
    user can do nothing about; warnings of aoti_sessions still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch(\.|$)")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("default", module=r"aoti_sessions(\.|$)")  # checked first
        yield


def compiled_decoder(
    cfg: models.DecoderConfig = models.SMALL,
    device: str = "cpu",
    steps: int = 1,
    *,
    inductor_configs: dict[str, Any] | None = None,
    progress: TextIO | None = sys.stderr,
) -> Path:
    """The decoder for `cfg`, compiled for `device` with `steps` tokens per call;
    cached by torch version, model source, config and device."""
    dev = torch.device(device)

    def build() -> tuple[torch.nn.Module, tuple[Any, ...], None]:
        model = models.TinyDecoder(cfg).to(dev).eval()
        return model, tuple(a.to(dev) for a in model.example_inputs(steps)), None

    return compile_cached(
        build,
        (inspect.getsource(models), repr(cfg), dev.type, str(steps)),
        name=f"decoder-{cfg.layers}l-{dev.type}-t{steps}",
        inductor_configs=inductor_configs,
        progress=progress,
    )


class GreedyDecoding:
    """One session decoding greedily, a token per call: `prompt` fed one token at
    a time, then `steps` generated tokens. `method` names the engine method to
    call (None: the engine's only one)."""

    def __init__(self, session: Session, prompt: list[int], steps: int, method: str | None = None) -> None:
        self.session = session
        self.prompt = prompt
        self.method = method
        self.total = len(prompt) + steps - 1
        self.position = 0
        self.token = prompt[0]
        self.generated: list[int] = []
        self.seconds: list[float] = []  # wall time of every call

    @property
    def done(self) -> bool:
        return self.position >= self.total

    def step(self) -> None:
        pos = self.position
        if pos < len(self.prompt):
            self.token = self.prompt[pos]
        device = self.session.engine.device
        x = torch.tensor([[self.token]], device=device)
        p = torch.tensor([pos], device=device)
        start = time.perf_counter()
        logits = self.session.run(self.method, x, p) if self.method else self.session(x, p)
        self.token = int(logits[0, -1].argmax())
        self.seconds.append(time.perf_counter() - start)
        if pos >= len(self.prompt) - 1:
            self.generated.append(self.token)
        self.position += 1

    def run(self) -> list[int]:
        while not self.done:
            self.step()
        return self.generated


def _spread(seconds: list[float]) -> str:
    """Median with min and max: one figure alone misleads on a loaded machine."""
    us = [t * 1e6 for t in seconds]
    return f"{statistics.median(us):.1f} us median (min {min(us):.1f}, max {max(us):.1f}, {len(us)} calls)"


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + 1) % vocab for j in range(length)] for i in range(n)]


def run_demo(device: str = "cpu", sessions: int = 4, steps: int = 32, out: TextIO = sys.stdout) -> bool:
    """Decodes `sessions` prompts interleaved step by step and checks each against a
    solo run. Prints a table; returns whether isolation held."""
    if sessions < 1 or steps < 1:
        raise ValueError("sessions and steps must be at least 1")
    with quiet_torch():
        return _run_demo(device, sessions, steps, out)


def _run_demo(device: str, sessions: int, steps: int, out: TextIO) -> bool:
    dev = torch.device(device)
    cfg = models.SMALL
    path = compiled_decoder(cfg, device)
    engine = Engine(path, device=device)
    prompts = _prompts(sessions, 4, cfg.vocab)
    if len(prompts[0]) + steps > cfg.max_seq:
        raise ValueError(f"steps must be at most {cfg.max_seq - len(prompts[0])} for this model")

    # Interleaved: every call switches to another session (sessions > 1).
    live = [engine.new_session() for _ in range(sessions)]
    interleaved = [GreedyDecoding(s, p, steps) for s, p in zip(live, prompts)]
    before = engine.stats()
    while not interleaved[0].done:
        for decoding in interleaved:
            decoding.step()
    after = engine.stats()
    binds = after["binds"] - before["binds"]
    bind_seconds = (after["bind_seconds"] - before["bind_seconds"]) / max(binds, 1)
    for s in live:
        s.close()

    # Solo: each prompt alone in a fresh session; every call after the first
    # finds its session already bound.
    same: list[float] = []
    results = []
    for i, prompt in enumerate(prompts):
        with engine.new_session() as s:
            solo = GreedyDecoding(s, prompt, steps)
            solo.run()
        same.extend(solo.seconds[1:])
        results.append(solo.generated == interleaved[i].generated)
    switching = [t for d in interleaved for t in d.seconds]

    ok = all(results)
    rows = [
        ("model", f"{cfg.layers}-layer decoder, dim {cfg.dim}, {cfg.max_seq}-token KV cache, {device}"),
        ("weights", f"{engine.weight_bytes / 2**20:.2f} MiB (loaded once)"),
        ("bytes per session", f"{engine.bytes_per_session / 2**20:.2f} MiB ({len(engine.mutable_fqns)} buffers)"),
        ("sessions x steps", f"{sessions} x {steps} (+{len(prompts[0]) - 1} prompt steps)"),
        ("step, same session", _spread(same)),
        ("step, switching", _spread(switching)),
        ("bind (switch cost)", f"{bind_seconds * 1e6:.2f} us ({binds} binds for "
                               f"{sum(len(d.seconds) for d in interleaved)} interleaved steps)"),
        ("lanes", f"{after['lanes']} containers per method: up to {after['lanes']} hot sessions "
                  "switch without a bind"),
    ]
    for i, good in enumerate(results):
        tokens = interleaved[i].generated
        rows.append((f"session {i} vs solo", f"{'PASS' if good else 'FAIL'}  {tokens[:8]}..."))
    rows.append(("isolation", "PASS" if ok else "FAIL"))
    width = max(len(k) for k, _ in rows)
    out.write("\naoti-sessions demo\n")
    for k, v in rows:
        out.write(f"  {k:<{width}}  {v}\n")
    engine.close()
    return ok
