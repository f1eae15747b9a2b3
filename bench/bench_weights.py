"""Weights held once: load time and device memory of a two-method model, all
figures from one run on a GPU.

The built-in decoder (``--config large``: models.LARGE, about 1.48 GB of bf16
weights; ``small`` for a quick check) is compiled with two methods, ``prefill``
(16 tokens) and ``decode`` (1 token), into two packages, cached under
``cache_dir()/bench``:

  * ``ais``: ``ais.compile(module, {"prefill": ..., "decode": ...})``, the
    libraries without weights and every weight once in a file in the package;
  * ``foreign``: what plain torch makes, one ``aot_compile`` per method
    (weights embedded in each library) packed by ``package_aoti``.

Measured, each load after one unmeasured warm-up load of the same kind (file
cache, package extraction) and from a settled device (gc, synchronize,
empty_cache):

  1. loads: (a) aoti-sessions loading the ais package, (b) aoti-sessions
     loading the foreign package, (c) torch loading both methods of the
     foreign package, (d) torch loading both methods of the ais package and
     feeding it the weights with ``load_constants``. Load time, device memory
     at rest after the load and its peak during the load, both against one
     copy of the weights W (parameters and read-only buffers of the eager
     module); for (a) also at rest with one session against W + S;
  2. ``Engine.update_weights`` from pageable and pinned CPU tensors, in place
     and double-buffered: time, GB/s and peak extra device memory;
  3. the targets: (a) at rest with one session <= 1.03 x (W + S), peak during
     (a)'s load <= 1.10 x W.

Outputs of both methods from a fresh session of (a) and (b) are checked
against the eager module.

Device memory is total - free of ``cudaMemGetInfo`` (the loads allocate
outside torch's caching allocator). Peaks are sampled every ~1 ms by a helper
process reading NVML (``libnvidia-ml.so.1``), which keeps sampling while a
call holds the GIL (torch's loader does); without NVML, by a thread in this
process (``--sampler thread``), which cannot.

Writes a Markdown report (default bench/results/weights.md) with the card,
torch version and date, and prints it. Compiling needs the system compiler on
the GPU machines (CXX=/usr/bin/g++ CC=/usr/bin/gcc).

    python bench/bench_weights.py [--config large|small] [--out bench/results/weights.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch._inductor.package import AOTICompiledModel, package_aoti

import aoti_sessions as ais
from aoti_sessions import _compile as ais_compile_module
from aoti_sessions import models
from aoti_sessions._package import cache_dir

MiB = 1 << 20
DEVICE = torch.device("cuda")
PREFILL_TOKENS = 16
METHODS = ("prefill", "decode")
# bf16 keeps 8 bits of mantissa: fused compiled kernels and eager ops round at
# different points, and the differences grow over the layers. Tolerances are
# relative to the largest logit.
RTOL, ATOL_OF_MAX = 3e-2, 3e-2
# Targets for (a).
REST_TARGET, PEAK_TARGET = 1.03, 1.10

T = TypeVar("T")


# -- device memory -----------------------------------------------------------

def sync() -> None:
    torch.cuda.synchronize()


def used_now() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def settled() -> int:
    """Device bytes in use once garbage is collected and torch's cache emptied."""
    gc.collect()
    sync()
    torch.cuda.empty_cache()
    return used_now()


class Sampler(Protocol):
    """Peak device memory in use between start() and stop()."""

    description: str
    samples: int  # samples taken by the last start()/stop()

    def start(self) -> None: ...

    def stop(self) -> int:
        """Peak bytes in use above the first sample, taken by start()."""
        ...

    def close(self) -> None: ...


# Runs in a helper process, standard library only: reads NVML, which needs no
# CUDA context (so the helper costs no device memory) and no GIL of ours.
# Protocol on stdin/stdout: "ready"; then "start" -> "go" (first sample taken),
# "stop" -> "<first> <peak> <samples>".
_NVML_SAMPLER = r"""
import ctypes, sys, threading, time

class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

nvml = ctypes.CDLL("libnvidia-ml.so.1")
if nvml.nvmlInit_v2() != 0:
    sys.exit(3)
handle = ctypes.c_void_p()
if (nvml.nvmlDeviceGetHandleByPciBusId_v2(sys.argv[1].encode(), ctypes.byref(handle)) != 0
        and nvml.nvmlDeviceGetHandleByUUID(sys.argv[2].encode(), ctypes.byref(handle)) != 0):
    sys.exit(4)
memory = Memory()

def used():
    if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
        sys.exit(5)
    return memory.total - memory.free

used()
print("ready", flush=True)
while sys.stdin.readline().strip() == "start":
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
    first = peak = used()
    samples = 1
    print("go", flush=True)
    while not done.is_set():
        time.sleep(0.001)
        peak = max(peak, used())
        samples += 1
    peak = max(peak, used())
    print(first, peak, samples + 1, flush=True)
"""


class ProcessSampler:
    description = "a helper process reading NVML every ~1 ms (not held up by the GIL)"

    def __init__(self, device: int) -> None:
        props = torch.cuda.get_device_properties(device)
        domain, bus_id, dev = (int(getattr(props, k)) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        bus = f"{domain:08X}:{bus_id:02X}:{dev:02X}.0"
        uuid = str(props.uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        self.samples = 0
        self._proc = subprocess.Popen([sys.executable, "-c", _NVML_SAMPLER, bus, uuid], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._read() != "ready":
            self.close()
            raise RuntimeError(f"NVML sampler did not start (exit {self._proc.poll()})")

    def _read(self) -> str:
        assert self._proc.stdout is not None
        return self._proc.stdout.readline().strip()

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def start(self) -> None:
        self._send("start")
        if self._read() != "go":
            raise RuntimeError("NVML sampler failed")

    def stop(self) -> int:
        self._send("stop")
        first, peak, self.samples = (int(x) for x in self._read().split())
        return peak - first

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ThreadSampler:
    description = ("a thread in this process calling cudaMemGetInfo every ~1 ms; it cannot sample "
                   "while a call holds the GIL (torch's loader does), so its peaks may be low")

    def __init__(self, device: int) -> None:
        self._device = device
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._first = self._peak = 0
        self._switch = sys.getswitchinterval()
        self.samples = 0

    def _sample(self) -> None:
        free, total = torch.cuda.mem_get_info(self._device)
        self._peak = max(self._peak, int(total - free))
        self.samples += 1

    def _loop(self) -> None:
        while not self._done.wait(0.001):
            self._sample()

    def start(self) -> None:
        self.samples = 0
        self._first = self._peak = 0
        self._sample()
        self._first = self._peak
        self._done.clear()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # let the sampler in between Python bytecodes
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        sys.setswitchinterval(self._switch)
        self._sample()
        return self._peak - self._first

    def close(self) -> None:
        pass


def make_sampler(kind: str) -> Sampler:
    device = torch.cuda.current_device()
    if kind in ("auto", "process"):
        try:
            return ProcessSampler(device)
        except Exception as e:  # no NVML here, or torch without PCI ids
            if kind == "process":
                raise
            print(f"NVML sampler unavailable ({e}); sampling from a thread", file=sys.stderr)
    return ThreadSampler(device)


@dataclass
class Measured:
    base: int      # device bytes in use, settled, before
    seconds: float
    rest: int      # settled, after, above base
    peak: int      # sampled peak above base (at least rest)
    samples: int


def measure(fn: Callable[[], T], sampler: Sampler) -> tuple[T, Measured]:
    """Runs `fn` from a settled device: its wall time (device synchronised), the
    memory it leaves in use and its sampled peak."""
    base = settled()
    sampler.start()
    try:
        start = time.perf_counter()
        result = fn()
        sync()
        seconds = time.perf_counter() - start
    finally:
        peak = sampler.stop()
    rest = settled() - base
    # The sampler reads the device as a whole, in its own units; the peak is at
    # least what stays.
    return result, Measured(base, seconds, rest, max(peak, rest), sampler.samples)


# -- the model and its packages ----------------------------------------------

def build_module(cfg: models.DecoderConfig) -> models.TinyDecoder:
    """The eager decoder on cuda, as demo.compiled_decoder builds it."""
    return models.TinyDecoder(cfg).to(DEVICE).eval()


def example_args(module: models.TinyDecoder) -> dict[str, tuple[torch.Tensor, ...]]:
    """Compile-time inputs per method: (tokens [B, T], positions [T]) on cuda."""
    return {
        "prefill": tuple(a.to(DEVICE) for a in module.example_inputs(PREFILL_TOKENS)),
        "decode": tuple(a.to(DEVICE) for a in module.example_inputs(1)),
    }


def package_target(kind: str, cfg_name: str, cfg: models.DecoderConfig) -> Path:
    """Cache path of a package, keyed by torch version, model source and config
    (and, for the ais package, by the compiler's source)."""
    digest = hashlib.sha256()
    parts = [torch.__version__, kind, repr(cfg), str(PREFILL_TOKENS), inspect.getsource(models)]
    if kind == "ais":
        parts += [ais.__version__, inspect.getsource(ais_compile_module)]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return cache_dir() / "bench" / f"weights-{cfg_name}-{kind}-{digest.hexdigest()[:20]}.pt2"


def compile_ais(module: torch.nn.Module, args: Mapping[str, tuple[torch.Tensor, ...]], path: str) -> None:
    ais.compile(module, {name: (args[name],) for name in METHODS}, path=path)


def compile_foreign(module: torch.nn.Module, args: Mapping[str, tuple[torch.Tensor, ...]], path: str) -> None:
    """Both methods the plain torch way: weights embedded in each library."""
    files: dict[str, Any] = {}
    for name in METHODS:
        ep = torch.export.export(module, args[name], strict=False)
        out = torch._inductor.aot_compile(ep.module(), args[name], options={"aot_inductor.package": True})
        assert isinstance(out, list), "aot_compile with aot_inductor.package returns its files"
        files[name] = out
    package_aoti(path, files)


def cached_package(target: Path, make: Callable[[str], None], label: str) -> Path:
    """`make(path)` once: compiled beside the target under its own name (the
    package's top folder is named after the file), then moved in place."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"compiling the {label} package (cached afterwards) ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        tmp = os.path.join(staging, target.name)
        make(tmp)
        os.replace(tmp, target)
    print(f"compiled the {label} package in {time.monotonic() - start:.0f}s: {target}", file=sys.stderr)
    return target


# -- the eager reference -----------------------------------------------------

@dataclass
class Reference:
    prefill_inputs: tuple[torch.Tensor, torch.Tensor]  # cuda
    decode_inputs: tuple[torch.Tensor, torch.Tensor]
    prefill_out: torch.Tensor  # float32 logits on the CPU
    decode_out: torch.Tensor
    state_cpu: dict[str, torch.Tensor]  # the whole initial state dict (buffers too), on the CPU
    params: list[str]   # parameter FQNs
    mutated: list[str]  # buffers the forward writes (the KV caches)
    weight_bytes: int   # W: parameters + buffers the forward only reads
    state_bytes: int    # the mutated buffers' bytes


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def reference(module: models.TinyDecoder) -> Reference:
    """Prefill then decode from the initial state, on the eager module; the
    buffers whose version counter moves are the ones the forward writes."""
    cfg = module.cfg
    state_cpu = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def inputs(start: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Tensors of their own, not slices: inputs as a caller builds them.
        tokens = [[(7 * j + 3 + 11 * b) % cfg.vocab for j in range(start, start + steps)] for b in range(cfg.batch)]
        return (torch.tensor(tokens, dtype=torch.int64, device=DEVICE),
                torch.arange(start, start + steps, dtype=torch.int64, device=DEVICE))

    prefill_inputs, decode_inputs = inputs(0, PREFILL_TOKENS), inputs(PREFILL_TOKENS, 1)
    buffers = dict(module.named_buffers())
    versions = {k: b._version for k, b in buffers.items()}
    prefill_out = module(*prefill_inputs).float().cpu()
    decode_out = module(*decode_inputs).float().cpu()
    mutated = sorted(k for k, b in buffers.items() if b._version != versions[k])
    params = [k for k, _ in module.named_parameters()]
    weight_bytes = (sum(nbytes(p) for p in module.parameters())
                    + sum(nbytes(b) for k, b in buffers.items() if k not in mutated))
    state_bytes = sum(nbytes(buffers[k]) for k in mutated)
    return Reference(prefill_inputs, decode_inputs, prefill_out, decode_out, state_cpu, params, mutated,
                     weight_bytes, state_bytes)


@dataclass
class Check:
    label: str
    diffs: dict[str, float]  # method -> max abs diff against the eager logits
    scale: float             # largest eager logit
    ok: bool


def max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    return float((got.detach().float().cpu() - expected).abs().max())


def run_both(session: ais.Session, ref: Reference) -> dict[str, torch.Tensor]:
    """Prefill then decode in one session (the decode step reads prefill's cache)."""
    out = {"prefill": session.run("prefill", *ref.prefill_inputs)}
    out["decode"] = session.run("decode", *ref.decode_inputs)
    return {k: v.detach().float().cpu() for k, v in out.items()}


def check(label: str, session: ais.Session, ref: Reference) -> Check:
    got = run_both(session, ref)
    expected = {"prefill": ref.prefill_out, "decode": ref.decode_out}
    scale = max(float(e.abs().max()) for e in expected.values())
    ok = all(got[m].shape == expected[m].shape
             and torch.allclose(got[m], expected[m], rtol=RTOL, atol=ATOL_OF_MAX * scale) for m in METHODS)
    return Check(label, {m: max_diff(got[m], expected[m]) for m in METHODS}, scale, ok)


# -- loads -------------------------------------------------------------------

@dataclass
class Load:
    label: str
    m: Measured | None = None
    note: str = ""
    error: str | None = None
    # aoti-sessions loads only:
    engine_weight_bytes: int | None = None
    bytes_per_session: int | None = None
    mutable: tuple[str, ...] = ()
    memory_report: dict[str, dict[str, int]] | None = None
    with_session: int | None = None  # at rest with one session, above the same base
    check: Check | None = None


def torch_method(path: Path, name: str) -> AOTICompiledModel:
    """One method of a package, loaded alone the way torch's load_package does
    (load_package itself first loads every model in the package)."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), name, False, 1, -1)
    except TypeError:  # an older binding: (path, model_name) only
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), name)  # type: ignore[call-arg]
    return AOTICompiledModel(loader)


def feed_weights(loaded: AOTICompiledModel, weights_cpu: Mapping[str, torch.Tensor]) -> str:
    """How a torch user feeds a package without embedded weights: its constants
    from a CPU state dict. Returns a note when torch refuses CPU tensors and they
    go over to cuda one at a time instead."""
    wanted = set(loaded.get_constant_fqns())
    constants = {k: v for k, v in weights_cpu.items() if k in wanted}
    try:
        loaded.load_constants(constants, check_full_update=False, user_managed=False)
        return ""
    except RuntimeError as e:
        reason = first_line(e)
    for k, v in constants.items():
        loaded.load_constants({k: v.to(DEVICE)}, check_full_update=False, user_managed=False)
    return f"CPU tensors refused ({reason[:80]}): fed from cuda one tensor at a time"


def load_ours(label: str, path: Path, ref: Reference, sampler: Sampler, *, mutable: list[str] | None,
              with_session: bool, warmup: int, note: str = "") -> Load:
    def load() -> ais.Engine:
        return ais.Engine(path, device=str(DEVICE), mutable=mutable)

    for _ in range(warmup):
        load().close()
    engine, m = measure(load, sampler)
    try:
        out = Load(label, m, note=note, engine_weight_bytes=engine.weight_bytes,
                   bytes_per_session=engine.bytes_per_session, mutable=engine.mutable_fqns)
        with engine.new_session() as session:
            if with_session:
                out.with_session = settled() - m.base
            out.memory_report = engine.memory_report()
            out.check = check(label, session, ref)
        return out
    finally:
        engine.close()


def load_torch(label: str, path: Path, ref: Reference, sampler: Sampler, *, feed: bool, warmup: int) -> Load:
    notes: list[str] = []

    def load() -> list[AOTICompiledModel]:
        loaded = []
        for name in METHODS:
            method = torch_method(path, name)
            if feed:
                notes.append(feed_weights(method, ref.state_cpu))
            loaded.append(method)
        return loaded

    for _ in range(warmup):
        del_all(load())
    notes.clear()
    loaded, m = measure(load, sampler)
    del_all(loaded)
    note = "; ".join(sorted({n for n in notes if n}))
    if feed:
        note = note or "weights fed from a CPU state dict by load_constants"
    return Load(label, m, note=note)


def del_all(items: list[Any]) -> None:
    items.clear()
    gc.collect()


def guarded(label: str, fn: Callable[[], Load]) -> Load:
    """A load that fails is reported, not fatal: the others still run."""
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        return Load(label, error=first_line(e))


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


# -- update_weights ----------------------------------------------------------

@dataclass
class Update:
    source: str       # pageable | pinned
    double_buffer: bool
    seconds: list[float] = field(default_factory=list)
    peak: int = 0     # largest sampled extra device memory
    rest: int = 0     # largest extra left in use after
    samples: int = 0


@dataclass
class UpdateRun:
    bytes: int
    runs: list[Update]
    changed: float   # max logit change after the scaled weights went in
    restored: float  # max logit diff after the original weights went back
    ok: bool
    error: str | None = None


def update_weights(path: Path, ref: Reference, sampler: Sampler, reps: int) -> UpdateRun:
    scaled = {k: (ref.state_cpu[k] * 1.01).to(ref.state_cpu[k].dtype).contiguous() for k in ref.params}
    pinned = {k: v.pin_memory() for k, v in scaled.items()}
    original = {k: ref.state_cpu[k].contiguous() for k in ref.params}
    size = sum(nbytes(v) for v in scaled.values())
    engine = ais.Engine(path, device=str(DEVICE))
    try:
        def outputs() -> dict[str, torch.Tensor]:
            with engine.new_session() as s:
                return run_both(s, ref)

        before = outputs()
        session = engine.new_session()
        session.run("decode", *ref.decode_inputs)  # a live session that has run
        sync()
        runs = []
        for source, sd in (("pageable", scaled), ("pinned", pinned)):
            for double in (False, True):
                run = Update(source, double)
                for _ in range(reps):
                    _, m = measure(lambda: engine.update_weights(sd, double_buffer=double), sampler)
                    run.seconds.append(m.seconds)
                    run.peak, run.rest = max(run.peak, m.peak), max(run.rest, m.rest)
                    run.samples = max(run.samples, m.samples)
                runs.append(run)
        session.run("decode", *ref.decode_inputs)  # still runs after the swaps
        after = outputs()
        engine.update_weights(original)
        restored = outputs()
        session.close()
    finally:
        engine.close()
    changed = max(max_diff(after[k], before[k]) for k in METHODS)
    back = max(max_diff(restored[k], before[k]) for k in METHODS)
    scale = max(float(v.abs().max()) for v in before.values())
    return UpdateRun(size, runs, changed, back, ok=changed > 0 and back <= 1e-3 * scale)


# -- report ------------------------------------------------------------------

def mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def report(cfg_name: str, cfg: models.DecoderConfig, ref: Reference, loads: list[Load],
           update: UpdateRun, sampler: Sampler, warmup: int) -> tuple[list[str], list[tuple[str, bool]]]:
    w = ref.weight_bytes
    lines = [
        f"Model: `{cfg_name}`, {cfg.layers} layers, dim {cfg.dim}, vocab {cfg.vocab}, {cfg.max_seq}-token cache, "
        f"{cfg.dtype}; methods prefill ({PREFILL_TOKENS} tokens) and decode (1 token).",
        "",
        f"One copy of the weights W = {mib(w)} MiB (parameters and read-only buffers of the eager module); "
        f"per-session state {mib(ref.state_bytes)} MiB ({len(ref.mutated)} buffers the forward writes).",
        "",
        f"Device memory: total - free (cudaMemGetInfo) after gc + synchronize + empty_cache, above the same "
        f"before each load; peaks sampled by {sampler.description}. Each load follows {warmup} unmeasured "
        "warm-up load(s) of the same kind.",
        "",
        "## Loads",
        "",
        "| load | s | at rest MiB | peak MiB | at rest / W | peak / W | samples | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for load in loads:
        if load.m is None:
            lines.append(f"| {load.label} | - | - | - | - | - | - | failed: {load.error} |")
            continue
        m = load.m
        lines.append(f"| {load.label} | {m.seconds:.3f} | {mib(m.rest)} | {mib(m.peak)} | {ratio(m.rest, w)} | "
                     f"{ratio(m.peak, w)} | {m.samples} | {load.note} |")
    ours = [x for x in loads if x.engine_weight_bytes is not None]
    targets: list[tuple[str, bool]] = []
    first = loads[0]
    if first.with_session is not None and first.bytes_per_session is not None:
        ideal = w + first.bytes_per_session
        lines += ["", f"(a) with one session: {mib(first.with_session)} MiB at rest, W + S = {mib(ideal)} MiB "
                  f"(S = bytes_per_session = {mib(first.bytes_per_session)} MiB): "
                  f"{ratio(first.with_session, ideal)} x (W + S)."]
    for load in ours:
        lines += ["", f"{load.label}: `weight_bytes` {mib(load.engine_weight_bytes or 0)} MiB "
                  f"({ratio(load.engine_weight_bytes or 0, w)} x W), `bytes_per_session` "
                  f"{mib(load.bytes_per_session or 0)} MiB, mutable: {len(load.mutable)} buffers"
                  + ("" if sorted(load.mutable) == ref.mutated else
                     f" (the eager module writes {len(ref.mutated)}: "
                     f"{', '.join(sorted(set(load.mutable) ^ set(ref.mutated))[:6])} differ)") + "."]
        if load.memory_report:
            keys = list(next(iter(load.memory_report.values())))
            lines += ["", "| memory_report() MiB | " + " | ".join(keys) + " |",
                      "|---|" + "---:|" * len(keys)]
            for where, parts in load.memory_report.items():
                lines.append(f"| {where} | " + " | ".join(mib(parts[k]) for k in keys) + " |")
    lines += ["", "## Outputs against the eager module", ""]
    for load in ours:
        c = load.check
        if c is None:
            continue
        diffs = ", ".join(f"{k} {v:.3g}" for k, v in c.diffs.items())
        lines.append(f"- {c.label}: {'PASS' if c.ok else 'FAIL'}, max abs diff {diffs} (largest logit "
                     f"{c.scale:.3g}; rtol {RTOL}, atol {ATOL_OF_MAX} x largest)")

    lines += ["", "## update_weights", ""]
    if update.error:
        lines.append(f"Failed: {update.error}")
    else:
        lines += [f"{len(ref.params)} parameters, {mib(update.bytes)} MiB (params x 1.01, contiguous CPU tensors), "
                  "with a live session that has run a decode step. Time: median of the repeats; memory: the "
                  "largest over them, above the settled device before each.", "",
                  "| source | mode | ms | GB/s | peak extra MiB | peak extra / bytes | at rest after MiB |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in update.runs:
            t = statistics.median(r.seconds)
            mode = "double_buffer=True" if r.double_buffer else "in place"
            lines.append(f"| {r.source} | {mode} | {t * 1e3:.1f} | {update.bytes / t / 1e9:.2f} | {mib(r.peak)} | "
                         f"{ratio(r.peak, update.bytes)} | {mib(r.rest)} |")
        lines += ["", f"Check: {'PASS' if update.ok else 'FAIL'}: the scaled weights moved the logits by up to "
                  f"{update.changed:.3g}; after the original weights went back, max diff {update.restored:.3g}."]

    if first.m is not None and first.with_session is not None and first.bytes_per_session is not None:
        ideal = w + first.bytes_per_session
        targets += [
            (f"{cfg_name}: (a) at rest with one session <= {REST_TARGET} x (W + S)",
             first.with_session <= REST_TARGET * ideal),
            (f"{cfg_name}: (a) peak during load <= {PEAK_TARGET} x W", first.m.peak <= PEAK_TARGET * w),
        ]
    else:
        targets += [(f"{cfg_name}: (a) at rest with one session <= {REST_TARGET} x (W + S) (load failed)", False),
                    (f"{cfg_name}: (a) peak during load <= {PEAK_TARGET} x W (load failed)", False)]
    return lines, targets


# -- main --------------------------------------------------------------------

@torch.no_grad()
def run(args: argparse.Namespace) -> tuple[str, bool]:
    configs = {"small": models.SMALL, "large": models.LARGE}
    cfg = configs[args.config]
    module = build_module(cfg)
    example = example_args(module)
    ais_path = cached_package(package_target("ais", args.config, cfg), lambda p: compile_ais(module, example, p),
                              "ais")
    foreign_path = cached_package(package_target("foreign", args.config, cfg),
                                  lambda p: compile_foreign(module, example, p), "foreign")
    ref = reference(module)
    del module, example
    settled()

    sampler = make_sampler(args.sampler)
    try:
        warmup = args.warmup
        a, b, c, d = ("(a) aoti-sessions, ais package", "(b) aoti-sessions, foreign package",
                      "(c) torch, foreign package", "(d) torch, ais package + load_constants")
        loads = [
            guarded(a, lambda: load_ours(a, ais_path, ref, sampler, mutable=None, with_session=True,
                                         warmup=warmup)),
            guarded(b, lambda: load_ours(b, foreign_path, ref, sampler, mutable=ref.mutated, with_session=False,
                                         warmup=warmup, note="mutable= the buffers the eager forward writes "
                                         "(the package declares none)")),
            guarded(c, lambda: load_torch(c, foreign_path, ref, sampler, feed=False, warmup=warmup)),
            guarded(d, lambda: load_torch(d, ais_path, ref, sampler, feed=True, warmup=warmup)),
        ]
        try:
            update = update_weights(ais_path, ref, sampler, args.reps)
        except Exception as e:
            traceback.print_exc()
            update = UpdateRun(0, [], 0.0, 0.0, ok=False, error=first_line(e))
    finally:
        sampler.close()

    lines, targets = report(args.config, cfg, ref, loads, update, sampler, args.warmup)
    doc = [
        "# Weights held once (bench/bench_weights.py)",
        "",
        f"Card: {torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"{datetime.date.today().isoformat()}.",
        "",
        *lines,
        "",
        "## Targets",
        "",
        "| target | |",
        "|---|---|",
        *(f"| {t} | {'met' if ok else 'MISSED'} |" for t, ok in targets),
    ]
    for load in loads[:2]:
        if load.check is not None:
            print(f"{load.label}: outputs {'match' if load.check.ok else 'DO NOT match'} the eager module, "
                  f"max abs diff " + ", ".join(f"{k} {v:.3g}" for k, v in load.check.diffs.items()))
    correct = all(x.check is not None and x.check.ok for x in loads[:2]) and update.ok
    return "\n".join(doc) + "\n", correct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("large", "small"), default="large")
    parser.add_argument("--reps", type=int, default=3, help="update_weights calls per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured loads before each measured one")
    parser.add_argument("--sampler", choices=("auto", "process", "thread"), default="auto",
                        help="peak sampler: NVML in a helper process (auto: if available) or a thread")
    parser.add_argument("--out", default=str(Path(__file__).parent.joinpath("results", "weights.md")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_weights needs a CUDA GPU", file=sys.stderr)
        return 2
    text, correct = run(args)
    Path(args.out).write_text(text)
    print(text)
    if not correct:
        print("bench_weights: outputs did not match (see the report)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
