"""``ais.compile``: export, find the mutated buffers, compile and package.

The package carries, in its AOTI metadata under ``aoti_sessions``, a JSON
document the Engine reads back::

    {"version": 1,
     "mutable_buffers": ["layers.0.k_cache", ...],   # exact per-session state
     "inputs": [{"dtype": "int64", "sizes": [1, null], "strides": null}, ...]}

``sizes`` has ``null`` for dynamic dimensions; ``strides`` is ``null`` where the
model expects a contiguous input, else the exact strides it was compiled for.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch

from ._package import METADATA_KEY, cache_dir

__all__ = ["compile", "compile_cached", "mutated_buffers", "input_specs"]


def mutated_buffers(ep: torch.export.ExportedProgram) -> list[str]:
    """FQNs of the buffers the program mutates (after decompositions, which turn
    in-place ops into explicit buffer mutations)."""
    decomposed = ep.run_decompositions()
    return sorted(set(decomposed.graph_signature.buffers_to_mutate.values()))


def input_specs(ep: torch.export.ExportedProgram) -> list[dict[str, Any]]:
    """dtype, sizes and strides of every tensor input, in the container's order."""
    user_inputs = set(ep.graph_signature.user_inputs)
    specs = []
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # ints and other non-tensors are not container inputs
        sizes = [s if isinstance(s, int) else None for s in val.shape]
        static = all(isinstance(s, int) for s in val.stride()) and None not in sizes
        strides = [int(s) for s in val.stride()] if static and not val.is_contiguous() else None
        specs.append({
            "dtype": str(val.dtype).removeprefix("torch."),
            "sizes": sizes,
            "strides": strides,
        })
    return specs


def compile(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] = "m.pt2",
    dynamic_shapes: Any = None,
    *,
    inductor_configs: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> str:
    """Export ``module`` with ``args``/``kwargs`` and compile it into an AOTI package.

    The package records the buffers the program mutates, so an :class:`Engine`
    gives each session exactly those, and the input specs it validates calls
    against. Returns the package path.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    ep = torch.export.export(module, args, kwargs=dict(kwargs or {}), dynamic_shapes=dynamic_shapes,
                             strict=strict)
    doc = {"version": 1, "mutable_buffers": mutated_buffers(ep), "inputs": input_specs(ep)}
    configs = dict(inductor_configs or {})
    metadata = dict(configs.get("aot_inductor.metadata") or {})
    metadata[METADATA_KEY] = json.dumps(doc)
    configs["aot_inductor.metadata"] = metadata
    out = torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path),
                                                   inductor_configs=configs)
    return str(out)


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

    stream.write(f"{message} 0s" if interactive else f"{message} ...\n")
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


Built = tuple[torch.nn.Module, tuple[Any, ...], Mapping[str, Any] | None]


def compile_cached(
    build: Callable[[], Built],
    key: Sequence[str],
    *,
    name: str = "model",
    dynamic_shapes: Any = None,
    inductor_configs: Mapping[str, Any] | None = None,
    progress: TextIO | None = sys.stderr,
) -> Path:
    """:func:`compile` the module ``build()`` returns, once: the package is cached
    under ``cache_dir()/models``, keyed by ``key`` (say the model's source and
    config), the torch version and the inductor configs. ``build`` runs only on
    a cache miss."""
    digest = hashlib.sha256()
    for part in (torch.__version__, *key, repr(sorted((inductor_configs or {}).items())), repr(dynamic_shapes)):
        digest.update(part.encode())
        digest.update(b"\0")
    target = cache_dir() / "models" / f"{name}-{digest.hexdigest()[:24]}.pt2"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target under its own name (the package's top folder is
    # named after the file), then move it in place atomically.
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        tmp = os.path.join(staging, target.name)
        with _progress(f"compiling {name} (cached afterwards)", progress) if progress else nullcontext():
            module, args, kwargs = build()
            with torch.no_grad():
                compile(module, args, kwargs, tmp, dynamic_shapes, inductor_configs=inductor_configs)
        os.replace(tmp, target)
    return target
