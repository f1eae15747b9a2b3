"""``ais.compile``: export, find the mutated buffers, compile and package.

Each method's package carries, in its AOTI metadata under ``aoti_sessions``, a
JSON document the Engine reads back::

    {"version": 1,
     "mutable_buffers": ["layers.0.k_cache", ...],   # exact per-session state
     "inputs": [{"name": "tokens", "dtype": "int64", "sizes": [1, null],
                 "symbols": [null, "s0"], "strides": null}, ...],
     "outputs": [{"dtype": "float32", "sizes": [1, 128]}],   # null if not all tensors
     "ranges": [{"symbol": "s0", "min": 2, "max": 64}]}

``sizes`` has ``null`` for dynamic dimensions, which ``symbols`` names (dimensions
of one symbol are equal); ``strides`` is ``null`` where the model expects a
contiguous input, else the exact strides it was compiled for. ``name`` is the
exported name of the input: its keyword, or the parameter's name for a
positional one. A multi-method package's weights index lists the methods in the
order they were given (``methods``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch

from ._package import (METADATA_KEY, METADATA_VERSION, OP_MODULES, WEIGHTS_ALIGN, WEIGHTS_BLOB, WEIGHTS_INDEX,
                       WEIGHTS_VERSION, cache_dir, top_folder)
from ._proxy import op_modules
from ._pool import Pool, pool_document
from ._program import (Exported, Method, export, input_specs, mutated_buffers, output_specs, symbol_ranges,
                       warn_folded_counters)
from ._verify import verify_package

__all__ = ["Method", "Pool", "compile", "compile_cached", "mutated_buffers", "input_specs"]

VERIFY_STEPS = 3  # steps of verify=True
# What compile writes into a package, for compile_cached's key: raise it when
# that changes, so cached packages are made again. 2: input names, outputs,
# dimension symbols, the methods' order.
PACKAGE_FORMAT = 2
# torch deep-copies its own tree specs while compiling and warns about its own
# deprecated class (torch 2.13): nothing a caller can act on.
_TORCH_NOISE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def _as_method(name: str, spec: Any) -> Method:
    if isinstance(spec, Method):
        return spec
    if not isinstance(spec, tuple) or not 1 <= len(spec) <= 3 or not isinstance(spec[0], tuple):
        raise TypeError(f"method '{name}': expected ais.Method or a tuple (args,), (args, kwargs) or "
                        f"(args, kwargs, dynamic_shapes) with args a tuple, got {spec!r:.80}")
    return Method(*spec)


def _metadata(name: str, method: Method, exported: Exported, configs: Mapping[str, Any],
              **extra: Any) -> dict[str, Any]:
    ep = exported.program
    inputs, ranges = input_specs(ep), symbol_ranges(ep)
    doc = {"version": METADATA_VERSION, "mutable_buffers": exported.mutated, "inputs": inputs,
           "outputs": output_specs(ep), "ranges": ranges, **extra}
    if method.pool is not None:
        doc["pool"] = pool_document(name, method.pool, ep, exported.decomposed, inputs, ranges, exported.mutated)
    out = dict(configs)
    metadata = dict(out.get("aot_inductor.metadata") or {})
    metadata[METADATA_KEY] = json.dumps(doc)
    out["aot_inductor.metadata"] = metadata
    return out


def _verify_steps(verify: object) -> int:
    if isinstance(verify, bool):
        return VERIFY_STEPS if verify else 0
    if not isinstance(verify, int):
        raise TypeError(f"verify must be a bool or a number of steps, got {type(verify).__name__}")
    if verify < 0:
        raise ValueError(f"verify must be a number of steps >= 0, got {verify}")
    return verify


def _phase(progress: TextIO | None, message: str) -> AbstractContextManager[None]:
    return _progress(f"ais.compile: {message}", progress) if progress else nullcontext()


def compile(
    module: torch.nn.Module,
    args: tuple[Any, ...] | Mapping[str, Method | tuple[Any, ...]],
    kwargs: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] = "m.pt2",
    dynamic_shapes: Any = None,
    *,
    inductor_configs: Mapping[str, Any] | None = None,
    strict: bool | None = None,
    verify: bool | int = False,
    progress: TextIO | None = sys.stderr,
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
    The engine lists the methods in the order given. A :class:`Method`'s
    ``attention`` picks the attention backends that method compiles to (on
    an H100 torch picks cuDNN's, which plans every new input shape anew, per
    thread: a poor fit for a method whose shapes change every call).

    Either way the package records the buffers each program mutates (the
    per-session state) and each method's call signature (input names, dtypes
    and shapes, which calls are checked against; outputs).

    ``strict``: ``None`` (default) exports with torch's non-strict trace, and
    again strictly (logged) where that trace cannot give a correct program (a
    module reaching its buffers through attributes outside its module tree, as
    transformers' static cache does); ``True`` / ``False`` force one.

    ``verify``: after compiling, run the package (an :class:`Engine`, one
    session) against a deep copy of the module, ``verify`` steps (``True``:
    3), each step every method in the order given with its example inputs,
    comparing the outputs and every mutated buffer after each call; raises
    :class:`~aoti_sessions.errors.VerifyError` naming the method, the step
    and what differs. The module itself is left untouched.

    ``progress``: where to report each phase with the elapsed time (the
    compile takes seconds to minutes); ``None`` is silent.

    Returns the package path.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    steps = _verify_steps(verify)
    configs = {**_dynamic_safe(), **(inductor_configs or {})}
    if isinstance(args, Mapping):
        if kwargs is not None or dynamic_shapes is not None:
            raise TypeError("with a mapping of methods, give kwargs and dynamic_shapes per method")
        methods = _named_methods(args)
        if not os.fspath(path).endswith(".pt2"):
            raise ValueError(f"package path must end in .pt2, got {os.fspath(path)}")
    elif isinstance(args, tuple):
        methods = [("forward", Method(args, kwargs, dynamic_shapes))]
    else:
        raise TypeError(f"args must be a tuple or a mapping of method names, got {type(args).__name__}")
    if steps and any(m.pool is not None for _, m in methods):
        raise ValueError("verify= does not check pooled methods (their state lives in the engine's pool, "
                         "not in the module); check them against the module with Engine.run_batch")
    # The eager reference starts from the state the package starts from.
    reference = copy.deepcopy(module) if steps else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_NOISE, category=FutureWarning)
        if isinstance(args, Mapping):
            out = _compile_methods(module, methods, os.fspath(path), configs, strict, progress)
        else:
            out = _compile_one(module, methods[0][1], path, configs, strict, progress)
    _record_op_modules(out)
    if reference is not None:
        with _phase(progress, f"verifying {', '.join(n for n, _ in methods)} against the module, {steps} steps"):
            verify_package(reference, out, methods, steps)
    return out


# Inductor passes that break a package whose shapes are dynamic, off unless the caller sets them:
# - shape padding (``pad_mm``) guards a bfloat16 matmul's row count against the size where padding pays
#   (``rows < 64``), and the compiled library then refuses every call above it (torch 2.11, CUDA);
# - a scatter of a scalar into a constant tensor rewritten as a pointwise ``where`` takes the scalar's dtype
#   (int64) for the tensor's (torch 2.11's CUDA compile of DeepSeek-V2's group-limited router fails on it).
def _dynamic_safe() -> dict[str, Any]:
    from torch._inductor import config  # (imported when compiling, not with the package)

    return {key: False for key in ("shape_padding", "optimize_scatter_upon_const_tensor") if hasattr(config, key)}


def _named_methods(methods: Mapping[str, Method | tuple[Any, ...]]) -> list[tuple[str, Method]]:
    if not methods:
        raise ValueError("compile needs at least one method")
    for name in methods:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"method names must be identifiers, got {name!r}")
    return [(name, _as_method(name, spec)) for name, spec in methods.items()]


def _compile_one(module: torch.nn.Module, method: Method, path: str | os.PathLike[str],
                 configs: dict[str, Any], strict: bool | None, progress: TextIO | None) -> str:
    configs = {**configs, **(method.inductor_configs or {})}
    with method.attention_backends(), method.size_reasoning():
        with _phase(progress, f"exporting {method.entry}"):
            exported = export(module, method.entry, method, strict)
        warn_folded_counters(exported, method.entry, configs)
        with _phase(progress, f"compiling {method.entry} with AOTInductor"):
            out = torch._inductor.aoti_compile_and_package(exported.program, package_path=os.fspath(path),
                                                           inductor_configs=_metadata("forward", method, exported,
                                                                                      configs))
    return str(out)


def _compile_methods(module: torch.nn.Module, methods: list[tuple[str, Method]], path: str,
                     configs: dict[str, Any], strict: bool | None, progress: TextIO | None) -> str:
    from torch._inductor.package.package import package_aoti

    files: dict[str, list[str]] = {}
    tensors: dict[str, list[tuple[torch.Tensor, list[str]]]] = {}  # fqn -> distinct values, methods
    with tempfile.TemporaryDirectory() as work:
        for i, (name, method) in enumerate(methods, 1):
            label = f"method '{name}' ({i}/{len(methods)})"
            # Both export and compile choose attention and reason about sizes.
            with method.attention_backends(), method.size_reasoning():
                with _phase(progress, f"exporting {label}"):
                    exported = export(module, name, method, strict)
                own = {**configs, **(method.inductor_configs or {})}
                warn_folded_counters(exported, name, own)
                ep = exported.program
                for fqn, value in (*ep.state_dict.items(), *ep.constants.items()):
                    if not isinstance(value, torch.Tensor):
                        continue
                    variants = tensors.setdefault(fqn, [])
                    same = next((v for v in variants if _identical(v[0], value)), None)
                    if same is None:
                        variants.append((value.detach(), [name]))
                    else:
                        same[1].append(name)
                method_configs = _metadata(name, method, exported, own, weights=WEIGHTS_INDEX)
                method_configs.update({
                    "aot_inductor.package": True,
                    "aot_inductor.package_constants_in_so": False,
                    "aot_inductor.output_path": os.path.join(work, name),
                })
                with _phase(progress, f"compiling {label} with AOTInductor"):
                    compiled = torch._inductor.aot_compile(ep.module(), ep.example_inputs[0], ep.example_inputs[1],
                                                           options=method_configs)
                if not isinstance(compiled, list):
                    raise RuntimeError(f"method '{name}': AOTInductor produced {type(compiled).__name__}, not files")
                files[name] = [str(f) for f in compiled]
        package_aoti(path, files)  # type: ignore[arg-type]
        _append_weights(path, tensors, [name for name, _ in methods])
    return path


def _record_op_modules(path: str) -> None:
    """Writes OP_MODULES into the package where its methods call custom ops:
    a process loading it imports them if it has not (aoti_sessions._proxy)."""
    modules = op_modules(path)
    if modules:
        with zipfile.ZipFile(path, "a", allowZip64=True) as zf:
            zf.writestr(f"{top_folder(zf.namelist())}/{OP_MODULES}", json.dumps(modules))


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


def _append_weights(path: str, tensors: Mapping[str, list[tuple[torch.Tensor, list[str]]]],
                    methods: list[str]) -> None:
    """Adds the weights file (one copy of every distinct tensor) and its index,
    which also lists the methods in the order given."""
    with zipfile.ZipFile(path, "a", allowZip64=True) as zf:
        top = top_folder(zf.namelist())
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
                                                          "methods": methods, "entries": entries}))


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
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        done.set()
        thread.join()
        prefix = "\r" if interactive else ""
        stream.write(f"{prefix}{message} {outcome} {time.monotonic() - start:.0f}s\n")
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
    config), the torch version, the package format and the inductor configs.
    ``build`` runs only on a cache miss."""
    digest = hashlib.sha256()
    for part in (torch.__version__, f"format {PACKAGE_FORMAT}", *key, repr(sorted((inductor_configs or {}).items())),
                 repr(dynamic_shapes)):
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
        if progress:
            progress.write(f"compiling {name} (cached afterwards)\n")
            progress.flush()
        module, args, kwargs = build()
        with torch.no_grad():
            compile(module, args, kwargs, tmp, dynamic_shapes, inductor_configs=inductor_configs,
                    progress=progress)
        os.replace(tmp, target)
    return target
