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

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ._package import METADATA_KEY

__all__ = ["compile", "mutated_buffers", "input_specs"]


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
