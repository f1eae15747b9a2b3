"""How a package's methods become what the core loads (its typed method
sources: library, input specs, weights, pool) and the calls Python makes of
them (MethodCall: pytree specs, positional and keyword inputs)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

import aoti_sessions._core as _core
from ._package import MethodFiles, open_model
from ._proxy import proxy_call, trust_option
from ._session import MethodCall
from .errors import PackageError

__all__ = ["ModelSource", "method_source", "resolve_methods", "describe", "trust_option"]

ModelSource = str | os.PathLike[str]

_POOL_KINDS = {"pages": _core.PoolKind.PAGES, "slots": _core.PoolKind.SLOTS}


def _dtype_code(method: str, what: str, dtype: str) -> int:
    code = _core.dtype_code(dtype)
    if code < 0:
        raise PackageError(f"method '{method}': {what} has unknown dtype {dtype}")
    return code


def method_source(f: MethodFiles, device: torch.device, trust_op_modules: bool | Sequence[str] = False
                  ) -> _core.MethodSource:
    """The core's description of one method to load (on ``device``;
    ``trust_op_modules``: see :class:`aoti_sessions.Engine`)."""
    src = _core.MethodSource()
    src.name = f.name
    src.library_path = f.library
    src.cubin_dir = f.cubin_dir
    proxy = proxy_call(f.library, f.name, device, f.op_modules, trust_op_modules)
    if proxy is not None:
        src.set_proxy(cast(Any, proxy))  # handles: capsules (the stub's CapsuleType)
    if f.metadata is not None and f.metadata.inputs is not None:
        specs = []
        for i, doc in enumerate(f.metadata.inputs):
            spec = _core.InputSpec()
            spec.dtype = _dtype_code(f.name, f"input {i}", doc.dtype)
            spec.sizes = [-1 if s is None else s for s in doc.sizes]
            spec.strides = doc.strides or []
            specs.append(spec)
        src.inputs = specs
    pool = f.metadata.pool if f.metadata is not None else None
    if pool is not None:
        source = _core.PoolSource()
        source.page_size = pool.page_size
        source.tensors = [_core.PooledInput(i, name, _POOL_KINDS[kind]) for i, name, kind in pool.tensors]
        source.page_table, source.positions, source.slot_ids = pool.page_table, pool.positions, pool.slot_ids
        source.tokens, source.max_rows, source.max_pages = pool.tokens, pool.max_rows, pool.max_pages
        source.min_rows = pool.min_rows
        src.pool = source
    if f.weights_file is not None:
        weights = _core.WeightsFile()
        weights.path = f.weights_file
        weights.entries = [_core.WeightEntry(e.fqn, _dtype_code(f.name, f"weight {e.fqn}", e.dtype), e.sizes,
                                             e.strides, e.offset, e.nbytes) for e in f.weights]
        src.weights = weights
    return src


def resolve_methods(model: ModelSource | Mapping[str, ModelSource]) -> list[MethodFiles]:
    if isinstance(model, Mapping):
        if not model:
            raise ValueError("model mapping is empty: give at least one method")
        methods = []
        for name, path in model.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"method names must be non-empty strings, got {name!r}")
            found = open_model(path)
            if len(found) != 1:
                raise PackageError(
                    f"method '{name}': {path} holds {len(found)} models "
                    f"({', '.join(m.name for m in found)}); give a package with one"
                )
            methods.append(found[0].renamed(name))
        return methods
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or a mapping of method names to paths, got {type(model).__name__}")
    return open_model(model)


def describe(core: _core.Engine, f: MethodFiles, source: _core.MethodSource) -> MethodCall:
    index = core.method_index(f.name)
    in_raw, out_raw = core.call_spec(index)
    in_spec = pytree.treespec_loads(in_raw) if in_raw else None
    out_spec = pytree.treespec_loads(out_raw) if out_raw else None
    pool = f.metadata.pool if f.metadata is not None else None
    if pool is not None and f.metadata is not None and f.metadata.inputs is not None:
        # The caller gives only the inputs the engine does not fill, by position or name.
        mine = [i for i in range(len(f.metadata.inputs)) if i not in pool.engine_filled]
        specs = f.metadata.inputs
        return MethodCall(f.name, index, None, out_spec, True,
                          tuple(specs[i].strides is None for i in mine),
                          out_spec is not None and out_spec.is_leaf(), len(mine), (),
                          tuple(str(specs[i].name or f"#{i}") for i in mine), pooled=True)
    n = core.num_inputs(index)
    flat_call = in_spec is not None and in_spec == pytree.tree_structure((tuple(range(n)), {}))
    contiguous = None if source.inputs is None else tuple(len(s.strides) == 0 for s in source.inputs)
    single = out_spec is not None and out_spec.is_leaf()
    positional = -1
    keywords: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    if in_spec is not None and in_spec.type is tuple and in_spec.num_children == 2:
        args_spec, kwargs_spec = in_spec.children()
        if args_spec.type is tuple and kwargs_spec.type is dict:
            positional, keywords = args_spec.num_children, tuple(kwargs_spec.context)
            docs = f.metadata.inputs if f.metadata is not None else None
            if docs and args_spec.num_leaves == positional <= len(docs) and all(d.name for d in docs):
                names = tuple(str(d.name) for d in docs[:positional])
    return MethodCall(f.name, index, in_spec, out_spec, flat_call, contiguous, single, positional, keywords, names)
