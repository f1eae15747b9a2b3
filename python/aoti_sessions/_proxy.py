"""Ops a compiled library runs through AOTInductor's proxy executor (custom
ops made with ``torch.library``, fallback kernels without a C shim entry).

The model's generated code calls the executor with an extern node's index,
its integer arguments and its tensors (inputs, then the outputs to fill);
what each argument is comes from the extern-kernel description AOTInductor
writes beside the library (``<library>.json``). The core's ProxyExecutor
(csrc/core/proxy_executor.h) hands every call here: :func:`proxy_call`
reads the description once, when the package is loaded, into a plan per
node (refusing ops this process has not registered, or arguments it cannot
read, before any request): a Python function generated for that node (its
source built from the description and exec'd, as torch.fx does) that takes
each argument from its fixed place in the call, calls the ``torch.ops`` op
straight through the dispatcher (as torch's own executor does) and hands
all its outputs back at once.

A node's arguments, by the schema's types, as AOTInductor lays them out:
tensors (``as_tensor``, ``as_tensors``, ``as_optional_tensors``) and
integers (``as_int``, ``as_ints``, their symbolic forms, an int Scalar) come
with the call, in schema order; everything else (floats, bools, strings,
dtypes, layouts, memory formats, devices, None) is in the description.

Where an op is not registered yet, the package's recorded op modules
(``op_modules.json``) would define it; importing a module runs its code, so
only these are imported without the caller's leave (``trust_op_modules``):
modules of the installed packages in :data:`TRUSTED_OP_PACKAGES`, found
outside the current directory and the package cache.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import keyword
import os
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._package import cache_dir
from .errors import PackageError

__all__ = ["proxy_call", "description_path", "op_modules", "trust_option", "trusted_by_default", "TRUSTED_OP_PACKAGES"]

ProxyCall = Callable[[int, list[int], list[Any]], list[tuple[int, Any]]]

_steal = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
_give = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
_call_boxed = getattr(torch._C, "_dispatch_call_boxed", None)


def description_path(library: str) -> Path:
    """Where AOTInductor writes a library's extern-kernel description."""
    return Path(library).with_suffix(".json")


@dataclass(frozen=True)
class _Arg:
    """How to get one schema argument: ``kind`` is "static" (``value``),
    "tensor", "tensors" (``count``), "optional_tensors" (``present``: which
    items come), "int" or "ints" (``count``)."""

    name: str
    kwarg_only: bool
    kind: str
    value: Any = None
    count: int = 1
    present: tuple[bool, ...] = ()


Plan = Callable[[list[int], list[torch.Tensor]], list[tuple[int, Any]]]
"""A node's plan: its ints and tensors (stolen) in, (argument index, handle) per output out."""

_TENSOR_KINDS = ("tensor", "tensors", "optional_tensors")


def _entry(op: Any) -> tuple[dict[str, Any], str]:
    """How a plan calls ``op``: the names its code uses and how the call
    starts. An OpOverload goes straight to the dispatcher through its
    operator handle (``torch._C._dispatch_call_boxed``, as torch's own proxy
    executor calls it): the kernels, dispatch keys and dispatch modes of
    ``op(...)``, less its Python-level ``__torch_function__`` checks (the
    tensors are never subclasses; a torch-function mode around a run sees
    none of the model's other ops either)."""
    if _call_boxed is not None and type(op).__call__ is torch._ops.OpOverload.__call__ and hasattr(op, "_handle"):
        return {"_op": _call_boxed, "_h": op._handle}, "_op(_h, "
    return {"_op": op}, "_op("


def _plan(op: Any, args: list[_Arg], outputs: list[tuple[str, int]]) -> Plan:
    """One extern node's plan: a function generated for it (source text,
    exec'd, as torch.fx does) that takes each argument by its fixed place in
    ``i`` (ints) and ``t`` (tensors), calls the op and hands all its output
    tensors back at once. ``outputs``: per schema return, ("tensor" |
    "tensors" | "none", tensors it fills)."""
    inputs = sum(a.count for a in args if a.kind in _TENSOR_KINDS)
    n_ints = sum(a.count for a in args if a.kind in ("int", "ints"))
    n_tensors = inputs + sum(n for _, n in outputs)

    def miscount(ints: int, tensors: int) -> str:
        return f"{op}: called with {ints} ints and {tensors} tensors; its description takes {n_ints} and {n_tensors}"

    def miscounted(returned: int, count: int) -> str:
        return f"{op} returned {returned} tensors where its description has {count}"

    env, start = _entry(op)
    env.update(_give=_give, _miscount=miscount, _miscounted=miscounted)
    t = i = 0
    call: list[str] = []
    for j, a in enumerate(args):
        if a.kind == "static":
            env[f"_c{j}"] = a.value
            expr = f"_c{j}"
        elif a.kind == "tensor":
            expr, t = f"t[{t}]", t + 1
        elif a.kind == "tensors":
            expr, t = "[" + ", ".join(f"t[{k}]" for k in range(t, t + a.count)) + "]", t + a.count
        elif a.kind == "optional_tensors":
            items = []
            for present in a.present:
                items.append(f"t[{t}]" if present else "None")
                t += present
            expr = "[" + ", ".join(items) + "]"
        elif a.kind == "int":
            expr, i = f"i[{i}]", i + 1
        else:
            expr, i = "[" + ", ".join(f"i[{k}]" for k in range(i, i + a.count)) + "]", i + a.count
        if not a.kwarg_only:
            call.append(expr)
        elif a.name.isidentifier() and not keyword.iskeyword(a.name):
            call.append(f"{a.name}={expr}")
        else:
            call.append(f"**{{{a.name!r}: {expr}}}")
    lines = ["def plan(i, t):",
             f"    if len(i) != {n_ints} or len(t) != {n_tensors}:",
             "        raise RuntimeError(_miscount(len(i), len(t)))",
             f"    r = {start}{', '.join(call)})"]
    given: list[str] = []
    for k, (kind, count) in enumerate(outputs):
        value = "r" if len(outputs) == 1 else f"r[{k}]"
        if kind == "tensor":
            given.append(value)
        elif kind == "tensors":
            lines += [f"    if len({value}) != {count}:",
                      f"        raise RuntimeError(_miscounted(len({value}), {count}))"]
            given.append(f"*{value}")
    if given:
        pairs = ", ".join(f"({inputs + k}, h[{k}])" for k in range(n_tensors - inputs))
        lines += [f"    h = _give([{', '.join(given)}])", f"    return [{pairs}]"]
    else:
        lines.append("    return []")
    exec(compile("\n".join(lines) + "\n", f"<aoti_sessions proxy plan: {op}>", "exec"), env)  # noqa: S102
    plan: Plan = env["plan"]
    return plan


def _enum(kind: str, code: int) -> Any:
    from torch._export.serde import serialize

    table = {"as_scalar_type": serialize._SERIALIZE_TO_TORCH_DTYPE,
             "as_memory_format": serialize._SERIALIZE_TO_TORCH_MEMORY_FORMAT,
             "as_layout": serialize._SERIALIZE_TO_TORCH_LAYOUT}[kind]
    return {int(getattr(k, "value", k)): v for k, v in table.items()}[int(code)]


_STATIC = {"as_float": float, "as_bool": bool, "as_string": str, "as_floats": list, "as_bools": list,
           "as_strings": list}


def _arg(target: str, schema_arg: Any, serialized: dict[str, Any], device: torch.device) -> _Arg:
    (kind, value), = serialized.items()
    name, kwarg_only = schema_arg.name, schema_arg.kwarg_only

    def static(v: Any) -> _Arg:
        return _Arg(name, kwarg_only, "static", v)

    if kind == "as_none":
        return static(None)
    if kind == "as_tensor":
        return _Arg(name, kwarg_only, "tensor")
    if kind == "as_tensors":
        return _Arg(name, kwarg_only, "tensors", count=len(value))
    if kind == "as_optional_tensors":
        present = tuple(next(iter(item)) == "as_tensor" for item in value)
        return _Arg(name, kwarg_only, "optional_tensors", present=present, count=sum(present))
    if kind in ("as_int", "as_sym_int"):
        return _Arg(name, kwarg_only, "int")
    if kind in ("as_ints", "as_sym_ints"):
        return _Arg(name, kwarg_only, "ints", count=len(value))
    if kind in _STATIC:
        return static(_STATIC[kind](value))
    if kind in ("as_scalar_type", "as_memory_format", "as_layout"):
        return static(_enum(kind, value))
    if kind == "as_device":
        return static(device)  # the engine's device, as torch's own executor does
    raise PackageError(f"extern kernel {target}: argument '{name}' is serialized as {kind}, which aoti_sessions "
                       "cannot pass to it")


def _outputs(target: str, schema: Any, serialized: list[dict[str, Any]]) -> list[tuple[str, int]]:
    if len(serialized) != len(schema.returns):
        raise PackageError(f"extern kernel {target}: its description has {len(serialized)} outputs, its schema "
                           f"{len(schema.returns)}")
    outputs = []
    for ret, item in zip(schema.returns, serialized):
        (kind, value), = item.items()
        if kind == "as_tensor":
            outputs.append(("tensor", 1))
        elif kind == "as_tensors":
            outputs.append(("tensors", len(value)))
        elif kind == "as_none" or (kind == "as_optional_tensor" and next(iter(value)) == "as_none"):
            outputs.append(("none", 0))
        elif kind == "as_optional_tensor":
            outputs.append(("tensor", 1))
        else:
            raise PackageError(f"extern kernel {target}: output {ret.name or len(outputs)} is serialized as {kind}, "
                               "which aoti_sessions cannot take back from it")
    return outputs


def _lookup(target: str) -> Any:
    name, _, overload = target.partition(".")
    namespace, _, op_name = name.partition("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


# The installed packages whose modules a package may name as its op modules
# without the caller's leave: those whose custom ops the models this project
# exports call (transformers' MoE grouped_mm_fallback, aoti_sessions' own).
# Importing one of their modules runs only code installed here. Any other
# module, a file beside the package or in the current directory included,
# may be the package's own code: it needs trust_op_modules.
TRUSTED_OP_PACKAGES = ("transformers", "aoti_sessions")


def _module_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def trust_option(value: object) -> bool | tuple[str, ...]:
    """``trust_op_modules`` checked: True (import whatever the package names),
    False (only modules of TRUSTED_OP_PACKAGES) or module names also allowed."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(m, str) for m in value):
        raise TypeError(f"trust_op_modules must be True, False or a sequence of module names, got {value!r}")
    for name in value:
        if not _module_name(name):
            raise ValueError(f"trust_op_modules: {name!r} is not a module name")
    return tuple(value)


def trusted_by_default(module: str) -> bool:
    """Whether ``module`` belongs to one of TRUSTED_OP_PACKAGES as installed
    here: that package found (by its finders, which run none of its code) or
    already imported from a folder that is neither the current directory
    (``sys.path``'s ``''``) nor in the package cache."""
    top = module.partition(".")[0]
    if top not in TRUSTED_OP_PACKAGES or not _module_name(module):
        return False
    try:
        spec = importlib.util.find_spec(top)
        here, cache = Path.cwd().resolve(), cache_dir().resolve()
    except (ImportError, ValueError, OSError):
        return False
    if spec is None:
        return False
    # The folders the package was found in: a package's parent, a module's own.
    if spec.submodule_search_locations:
        folders = [Path(p).resolve().parent for p in spec.submodule_search_locations]
    else:
        folders = [Path(spec.origin).resolve().parent] if spec.origin else []
    return bool(folders) and all(f != here and not f.is_relative_to(cache) for f in folders)


def _import_op_modules(method: str, modules: Sequence[str], trust: bool | Sequence[str]) -> None:
    """Imports the package's op modules, or refuses (before importing any)
    where one is neither installed as TRUSTED_OP_PACKAGES are nor allowed."""
    if trust is not True:
        allowed = set() if trust is False else set(trust)
        refused = [m for m in modules if m not in allowed and m not in sys.modules and not trusted_by_default(m)]
        if refused:
            raise PackageError(
                f"method '{method}' calls ops this process has not registered; the package says the Python "
                f"modules {', '.join(refused)} define them, and importing a module runs its code: nothing was "
                f"imported. For a package you trust, allow them: trust_op_modules={refused!r} (Engine, LLM) or "
                f"--trust-op-modules {','.join(refused)} (aoti-sessions serve, info --load); or import them before "
                "loading the package")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of the import is the package's to report
            raise PackageError(f"method '{method}' calls custom ops defined in the Python module {module} "
                               f"(recorded in the package), which cannot be imported here: "
                               f"{type(e).__name__}: {e}") from None


def _resolve(target: str, method: str, modules: Sequence[str], trust: bool | Sequence[str] = False) -> Any:
    """The op ``target`` names; where it is not registered, the package's
    recorded op modules are imported first, as ``trust`` allows."""
    op = _lookup(target)
    if op is None and modules:
        _import_op_modules(method, modules, trust)
        op = _lookup(target)
    if op is None:
        raise PackageError(f"method '{method}' calls the op {target} through AOTInductor's proxy executor, and no "
                           f"such op is registered in this process: import the module (or load the library) that "
                           f"defines it before loading the package")
    return op


def _node(serialized: dict[str, Any], method: str, device: torch.device, modules: Sequence[str],
          trust: bool | Sequence[str] = False) -> Plan:
    target = serialized["target"]
    if target == "call_torchbind":
        raise PackageError(f"method '{method}' calls a torchbind object's method through AOTInductor's proxy "
                           "executor, which aoti_sessions does not run")
    op = _resolve(target, method, modules, trust)
    schema = op._schema
    given = {item["name"]: item["arg"] for item in serialized.get("inputs", [])}
    args = []
    for schema_arg in schema.arguments:
        if schema_arg.name in given:
            args.append(_arg(target, schema_arg, given.pop(schema_arg.name), device))
        elif schema_arg.has_default_value():
            args.append(_Arg(schema_arg.name, schema_arg.kwarg_only, "static", schema_arg.default_value))
        else:
            raise PackageError(f"extern kernel {target}: argument '{schema_arg.name}' is neither described nor has "
                               "a default")
    if given:
        raise PackageError(f"extern kernel {target}: its description names arguments its schema lacks: "
                           f"{', '.join(sorted(given))}")
    return _plan(op, args, _outputs(target, schema, serialized.get("outputs", [])))


def proxy_call(library: str, method: str, device: torch.device, modules: Sequence[str] = (),
               trust: bool | Sequence[str] = False) -> ProxyCall | None:
    """The core's proxy call for ``library`` (see the module's doc), or None
    where it calls no op through the proxy executor; ``modules``: the
    package's op modules, imported where an op is not registered, as
    ``trust`` (``trust_op_modules``) allows. Raises PackageError for a
    description it cannot read or an op it cannot run."""
    path = description_path(library)
    if not path.is_file():
        return None
    try:
        nodes = json.loads(path.read_text()).get("nodes") or []
    except (OSError, ValueError, AttributeError) as e:
        raise PackageError(f"method '{method}': unreadable extern-kernel description {path.name}: {e}") from None
    if not nodes:
        return None
    try:
        plans = [_node(n["node"], method, device, modules, trust) for n in nodes]
    except (KeyError, TypeError, ValueError) as e:
        raise PackageError(f"method '{method}': malformed extern-kernel description {path.name}: {e!r}") from None

    count = len(plans)

    def call(node: int, ints: list[int], handles: list[Any]) -> list[tuple[int, Any]]:
        tensors = _steal(handles)  # owned from here on, whatever happens
        if not 0 <= node < count:
            raise RuntimeError(f"extern node {node} of {count} in {path.name}")
        return plans[node](ints, tensors)

    return call


def op_modules(package: str | os.PathLike[str]) -> list[str]:
    """The Python modules that define (``torch.library.custom_op``) the ops a
    ``.pt2`` package's methods call through the proxy executor, as this
    process knows them: what a process loading the package must import
    first (``aoti_sessions.llm.export`` records them)."""
    from torch._library import custom_ops

    targets: set[str] = set()
    with zipfile.ZipFile(package) as archive:
        for name in archive.namelist():
            parts = name.split("/")
            if len(parts) == 5 and parts[1:3] == ["data", "aotinductor"] and name.endswith(".json") \
                    and not name.endswith("metadata.json"):
                doc = json.loads(archive.read(name))
                targets.update(n["node"]["target"] for n in doc.get("nodes") or [])
    modules = set()
    for target in targets:
        definition = custom_ops.OPDEFS.get(target.partition(".")[0])
        if definition is not None:
            modules.add(definition._init_fn.__module__)
    return sorted(modules)
