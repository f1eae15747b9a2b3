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
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from ._package import (METADATA_KEY, METADATA_VERSION, WEIGHTS_ALIGN, WEIGHTS_BLOB, WEIGHTS_INDEX,
                       WEIGHTS_VERSION, cache_dir)

__all__ = ["Method", "compile", "compile_cached", "mutated_buffers", "input_specs"]


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


@dataclass(frozen=True)
class Method:
    """One method of a multi-method :func:`compile`: example inputs, and the
    module's entry point that serves it (``forward`` unless told)."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] | None = None
    dynamic_shapes: Any = None
    entry: str = "forward"


def _as_method(name: str, spec: Any) -> Method:
    if isinstance(spec, Method):
        return spec
    if not isinstance(spec, tuple) or not 1 <= len(spec) <= 3 or not isinstance(spec[0], tuple):
        raise TypeError(f"method '{name}': expected ais.Method or a tuple (args,), (args, kwargs) or "
                        f"(args, kwargs, dynamic_shapes) with args a tuple, got {spec!r:.80}")
    return Method(*spec)


def _export(module: torch.nn.Module, method: Method, strict: bool) -> torch.export.ExportedProgram:
    entry = getattr(module, method.entry, None)
    if not callable(entry):
        raise TypeError(f"module {type(module).__name__} has no method '{method.entry}'")
    if method.entry == "forward":
        return torch.export.export(module, method.args, kwargs=dict(method.kwargs or {}),
                                   dynamic_shapes=method.dynamic_shapes, strict=strict)
    # Export another entry point under the module's own FQNs: route forward to it.
    module.forward = entry
    try:
        return torch.export.export(module, method.args, kwargs=dict(method.kwargs or {}),
                                   dynamic_shapes=method.dynamic_shapes, strict=strict)
    finally:
        del module.forward


def _metadata(ep: torch.export.ExportedProgram, configs: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    doc = {"version": METADATA_VERSION, "mutable_buffers": mutated_buffers(ep), "inputs": input_specs(ep),
           **extra}
    out = dict(configs)
    metadata = dict(out.get("aot_inductor.metadata") or {})
    metadata[METADATA_KEY] = json.dumps(doc)
    out["aot_inductor.metadata"] = metadata
    return out


def compile(
    module: torch.nn.Module,
    args: tuple[Any, ...] | Mapping[str, Method | tuple[Any, ...]],
    kwargs: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] = "m.pt2",
    dynamic_shapes: Any = None,
    *,
    inductor_configs: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> str:
    """Export ``module`` and compile it into an AOTI package for :class:`Engine`.

    Single method: ``compile(module, args, kwargs, path, dynamic_shapes)``
    exports ``module.forward``; its weights are embedded in the library, so
    torch's own ``aoti_load_package`` loads the package as well.

    Several methods: ``compile(module, {"prefill": (args, kwargs, shapes),
    "decode": (args,)}, path=...)`` (values are tuples or :class:`Method`)
    compiles one library per method *without* weights and stores every
    tensor constant once, in ``data/aoti_sessions/weights.bin`` inside the
    package, so the Engine loads each weight once and binds every method to it.

    Either way the package records the buffers each program mutates (the
    per-session state) and the input specs calls are checked against.
    Returns the package path.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(args, Mapping):
        if kwargs is not None or dynamic_shapes is not None:
            raise TypeError("with a mapping of methods, give kwargs and dynamic_shapes per method")
        return _compile_methods(module, args, path, dict(inductor_configs or {}), strict)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple or a mapping of method names, got {type(args).__name__}")
    ep = _export(module, Method(args, kwargs, dynamic_shapes), strict)
    configs = _metadata(ep, inductor_configs or {})
    out = torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path),
                                                   inductor_configs=configs)
    return str(out)


def _compile_methods(module: torch.nn.Module, methods: Mapping[str, Method | tuple[Any, ...]],
                     path: str | os.PathLike[str], configs: dict[str, Any], strict: bool) -> str:
    from torch._inductor.package.package import package_aoti

    if not methods:
        raise ValueError("compile needs at least one method")
    for name in methods:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"method names must be identifiers, got {name!r}")
    path = os.fspath(path)
    if not path.endswith(".pt2"):
        raise ValueError(f"package path must end in .pt2, got {path}")
    files: dict[str, list[str]] = {}
    tensors: dict[str, list[tuple[torch.Tensor, list[str]]]] = {}  # fqn -> distinct values, methods
    with tempfile.TemporaryDirectory() as work:
        for name, spec in methods.items():
            ep = _export(module, _as_method(name, spec), strict)
            for fqn, value in (*ep.state_dict.items(), *ep.constants.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                variants = tensors.setdefault(fqn, [])
                same = next((v for v in variants if _identical(v[0], value)), None)
                if same is None:
                    variants.append((value.detach(), [name]))
                else:
                    same[1].append(name)
            method_configs = _metadata(ep, configs, weights=WEIGHTS_INDEX)
            method_configs.update({
                "aot_inductor.package": True,
                "aot_inductor.package_constants_in_so": False,
                "aot_inductor.output_path": os.path.join(work, name),
            })
            compiled = torch._inductor.aot_compile(ep.module(), ep.example_inputs[0], ep.example_inputs[1],
                                                   options=method_configs)
            if not isinstance(compiled, list):
                raise RuntimeError(f"method '{name}': AOTInductor produced {type(compiled).__name__}, not files")
            files[name] = [str(f) for f in compiled]
        package_aoti(path, files)  # type: ignore[arg-type]
        _append_weights(path, tensors)
    return path


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device and bool(torch.equal(a, b)))


def _span_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s storage span (its layout kept, storage offset dropped)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = t.detach().cpu().as_strided((span,), (1,), t.storage_offset()).contiguous()
    return flat.view(torch.uint8) if flat.dtype.itemsize else flat


def _append_weights(path: str, tensors: Mapping[str, list[tuple[torch.Tensor, list[str]]]]) -> None:
    """Adds the weights file (one copy of every distinct tensor) and its index."""
    with zipfile.ZipFile(path, "a", allowZip64=True) as zf:
        top = zf.namelist()[0].split("/", 1)[0]
        entries = []
        with zf.open(f"{top}/{WEIGHTS_BLOB}", "w", force_zip64=True) as blob:
            offset = 0
            for fqn, variants in tensors.items():
                for value, used_by in variants:
                    data = _span_bytes(value)
                    pad = -offset % WEIGHTS_ALIGN
                    blob.write(b"\0" * pad)
                    offset += pad
                    raw = data.numpy().tobytes()
                    blob.write(raw)
                    entries.append({
                        "fqn": fqn, "methods": used_by, "dtype": str(value.dtype).removeprefix("torch."),
                        "sizes": list(value.shape), "strides": list(value.stride()),
                        "offset": offset, "nbytes": len(raw),
                    })
                    offset += len(raw)
        zf.writestr(f"{top}/{WEIGHTS_INDEX}", json.dumps({"version": WEIGHTS_VERSION, "blob": WEIGHTS_BLOB,
                                                          "entries": entries}))


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


# (module, args or a mapping of methods, kwargs): what compile_cached compiles.
Built = tuple[torch.nn.Module, tuple[Any, ...] | Mapping[str, Any], Mapping[str, Any] | None]


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
