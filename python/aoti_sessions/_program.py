"""What ``ais.compile`` reads from a module's exported program: the export
itself (strict or not), the buffers it mutates, its call signature, and the
patterns AOTInductor is known to compile into a wrong model."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx.experimental._config as fx_config
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._pool import Pool
from ._words import first_names
from .errors import CompileError, CompileWarning

__all__ = ["Method", "Exported", "export", "mutated_buffers", "input_specs", "output_specs", "symbol_ranges",
           "FOLDING_CONFIG"]

log = logging.getLogger("aoti_sessions")

# The inductor option whose folding pass reads one-element buffers as constants.
FOLDING_CONFIG = "joint_graph_constant_folding"
# torch's non-strict trace of a program whose lifted constants alias its
# buffers fails in run_decompositions with this (torch 2.11-2.13).
_ALIAS_FAILURE = "expected compiled_fn to be GraphModule"


@dataclass(frozen=True)
class Method:
    """One method of a multi-method :func:`compile`: example inputs, and the
    module's entry point that serves it (``forward`` unless told)."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] | None = None
    dynamic_shapes: Any = None
    entry: str = "forward"
    # The scaled-dot-product-attention backends the method may compile to
    # (``torch.nn.backends.SDPBackend``, as ``torch.nn.attention.sdpa_kernel``
    # takes them); None: torch's choice for the device.
    attention: tuple[SDPBackend, ...] | None = None
    # How the method addresses the engine's pooled state (docs/batching.md).
    pool: Pool | None = None
    # Inductor settings for this method's compile alone, over compile()'s
    # (e.g. autotuning a one-row decode step, not the prefill beside it).
    inductor_configs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.pool is not None and not isinstance(self.pool, Pool):
            raise TypeError(f"pool must be an ais.Pool, got {type(self.pool).__name__}")
        configs = self.inductor_configs
        if configs is not None and (not isinstance(configs, Mapping) or not all(isinstance(k, str) for k in configs)):
            raise TypeError(f"inductor_configs must be a mapping of Inductor setting names, got {configs!r:.80}")
        if self.attention is None:
            return
        backends = tuple(self.attention)
        if not backends or not all(isinstance(b, SDPBackend) for b in backends):
            raise TypeError(f"attention must be a non-empty sequence of torch.nn.attention.SDPBackend, "
                            f"got {self.attention!r}")
        object.__setattr__(self, "attention", backends)

    def attention_backends(self) -> AbstractContextManager[None]:
        """What the method's export and compile run under: its attention backends."""
        return nullcontext() if self.attention is None else sdpa_kernel(list(self.attention))

    def size_reasoning(self) -> AbstractContextManager[None]:
        """What the method's export and compile reason about sizes under. A
        pooled method's rows may be one session: torch otherwise assumes every
        dynamic size is at least 2, and the compiled model refuses a batch of
        one."""
        if self.pool is None:
            return nullcontext()
        patch: AbstractContextManager[None] = cast(Any, fx_config).patch(backed_size_oblivious=True)
        return patch


@dataclass(frozen=True)
class Exported:
    """One exported method: the program, its decomposition (functional: every
    buffer mutation explicit) and whether the export was strict."""

    program: ExportedProgram
    decomposed: ExportedProgram
    strict: bool

    @property
    def mutated(self) -> list[str]:
        return _mutated_by(self.decomposed)


def _mutated_by(decomposed: ExportedProgram) -> list[str]:
    return sorted(set(decomposed.graph_signature.buffers_to_mutate.values()))


def mutated_buffers(ep: ExportedProgram) -> list[str]:
    """FQNs of the buffers the program mutates (after decompositions, which turn
    in-place ops into explicit buffer mutations)."""
    return _mutated_by(ep.run_decompositions())


def _export_once(module: torch.nn.Module, method: Method, strict: bool) -> ExportedProgram:
    entry = getattr(module, method.entry, None)
    if not callable(entry):
        raise TypeError(f"module {type(module).__name__} has no method '{method.entry}'")
    # The package serves inference: no autograd in the trace (dynamo's strict
    # trace otherwise warns about .grad of tensors the module computed at init).
    with torch.no_grad(), method.size_reasoning():
        program = _trace(module, entry, method, strict)
    if method.pool is not None:
        _copy_sliced_view_sources(program)
    return program


def _copy_sliced_view_sources(program: ExportedProgram) -> None:
    """A view of a slice (a fused projection split in parts, as Phi-3's qkv)
    views a contiguous copy instead. Inductor computes such a view's strides
    assuming every dynamic size is at least 2, and the compiled model then
    refuses a pooled method's batch of one session; the copy is of one
    activation, never of a graph input. Not where the program mutates
    anything but its inputs in place: a copy would not see (or make) a write
    through an alias."""
    graph = program.graph_module.graph
    inputs = _input_aliases(graph)
    if inputs is None:
        return
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in views:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or source.target is not torch.ops.aten.slice.Tensor \
                or source in inputs:
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(torch.ops.aten.clone.default, (source,),
                                       {"memory_format": torch.contiguous_format})
        value = source.meta.get("val")
        if isinstance(value, torch.Tensor):
            with value.fake_mode:  # type: ignore[attr-defined]
                copy.meta["val"] = torch.ops.aten.clone.default(value, memory_format=torch.contiguous_format)
        copy.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_input_with(source, copy)
        changed = True
    if changed:
        program.graph_module.recompile()


def _trace(module: torch.nn.Module, entry: Any, method: Method, strict: bool) -> ExportedProgram:
    # Another entry point is exported under the module's own FQNs: forward is routed to it.
    routed = method.entry != "forward"
    if routed:
        module.forward = entry
    try:
        return torch.export.export(module, method.args, kwargs=dict(method.kwargs or {}),
                                   dynamic_shapes=method.dynamic_shapes, strict=strict)
    finally:
        if routed:
            del module.forward


def _input_aliases(graph: torch.fx.Graph) -> set[torch.fx.Node] | None:
    """The graph's inputs and what aliases them (an in-place op's result, a
    view of an input); None where the graph writes in place to anything else."""
    inputs: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            inputs.add(node)
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or target is torch.ops.aten.detach_.default:  # writes no data (a constant's trace has it)
            continue
        schema = target._schema
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None:
                continue
            given = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if argument.alias_info.is_write and given not in inputs:
                return None
            if given in inputs and any(r.alias_info is not None for r in schema.returns):
                inputs.add(node)  # its result aliases that input
    return inputs


def _aliased_constants(ep: ExportedProgram) -> list[tuple[str, str]]:
    """(constant, buffer or parameter) pairs of one storage: tensors the module
    reaches through plain attributes (outside its module tree), which a
    non-strict trace lifts as constants beside the buffers they are."""
    owners: dict[Any, str] = {}
    constants = []
    for spec in ep.graph_signature.input_specs:
        target = spec.target
        if target is None:
            continue
        value = ep.state_dict.get(target, ep.constants.get(target))
        if not isinstance(value, torch.Tensor):
            continue
        storage = value.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = (value.device, storage.data_ptr())
        if spec.kind in (InputKind.BUFFER, InputKind.PARAMETER):
            owners.setdefault(key, target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants.append((key, target))
    return [(name, owners[key]) for key, name in constants if key in owners]


def _aliases_text(pairs: list[tuple[str, str]]) -> str:
    return first_names(list(dict.fromkeys(b for _, b in pairs)), 4)


def _attempt(module: torch.nn.Module, name: str, method: Method, strict: bool) -> Exported:
    """One export and its decomposition; a CompileError where the non-strict
    trace lifted constants that alias buffers (torch compiles those wrong or not at all)."""
    program = _export_once(module, method, strict)
    aliased = _aliased_constants(program)
    if aliased:
        raise CompileError(f"method '{name}': the {'strict' if strict else 'non-strict'} export lifted the "
                           f"buffers {_aliases_text(aliased)} a second time, as constants: the module also reaches "
                           "them through attributes outside its module tree (as transformers' static cache does)"
                           + ("; pass strict=True" if not strict else ""))
    try:
        decomposed = program.run_decompositions()
    except AssertionError as e:
        if strict or _ALIAS_FAILURE not in str(e):
            raise
        raise CompileError(f"method '{name}': torch cannot decompose the non-strict export ({e}); "
                           "pass strict=True") from e
    return Exported(program, decomposed, strict)


def export(module: torch.nn.Module, name: str, method: Method, strict: bool | None) -> Exported:
    """Exports one method. ``strict=None``: non-strict (torch's default trace),
    and strict where that trace cannot give a correct program (logged once)."""
    if strict is not None:
        return _attempt(module, name, method, strict)
    try:
        return _attempt(module, name, method, False)
    except CompileError as e:
        note = str(e).removesuffix("; pass strict=True")
    log.warning("%s; exporting it again with strict=True (pass strict=True to skip the non-strict attempt)", note)
    return _attempt(module, name, method, True)


def _tensor_doc(val: torch.Tensor) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "dtype": str(val.dtype).removeprefix("torch."),
        "sizes": [s if isinstance(s, int) else None for s in val.shape],
    }
    if any(not isinstance(s, int) for s in val.shape):
        doc["symbols"] = [None if isinstance(s, int) else str(s) for s in val.shape]
    return doc


def input_specs(ep: ExportedProgram) -> list[dict[str, Any]]:
    """Name (the exported one: the keyword, or the parameter's name for a
    positional input), dtype, sizes and strides of every tensor input, in the
    container's order; ``symbols`` names each dynamic dimension."""
    user_inputs = set(ep.graph_signature.user_inputs)
    specs = []
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # ints and other non-tensors are not container inputs
        static = all(isinstance(s, int) for s in (*val.shape, *val.stride()))
        strides = [int(s) for s in val.stride()] if static and not val.is_contiguous() else None
        specs.append({"name": node.name, **_tensor_doc(val), "strides": strides})
    return specs


def output_specs(ep: ExportedProgram) -> list[dict[str, Any]] | None:
    """dtype and sizes of every user output, in order; None if one is not a tensor."""
    names = set(ep.graph_signature.user_outputs)
    outputs = [n for n in ep.graph.output_node().args[0] if isinstance(n, torch.fx.Node) and n.name in names]
    vals = [v for n in outputs if isinstance(v := n.meta.get("val"), torch.Tensor)]
    if len(vals) != len(ep.graph_signature.user_outputs):
        return None
    return [_tensor_doc(v) for v in vals]


def symbol_ranges(ep: ExportedProgram) -> list[dict[str, Any]]:
    """Each dynamic dimension's symbol and its bounds (None: unbounded)."""
    def bound(x: Any) -> int | None:
        # An unbounded dimension's bound is one of sympy's or torch's infinities.
        if getattr(x, "is_finite", False) is not True or getattr(x, "is_integer", False) is not True:
            return None
        try:
            return int(x)
        except (TypeError, ValueError, AttributeError, OverflowError):
            return None

    return [{"symbol": str(sym), "min": bound(r.lower), "max": bound(r.upper)}
            for sym, r in ep.range_constraints.items()]


_aten = torch.ops.aten
# Ops that read only the shape, dtype and device of their first argument.
_METADATA_OF_FIRST = {_aten.full_like.default, _aten.zeros_like.default, _aten.ones_like.default,
                      _aten.empty_like.default, _aten.new_zeros.default, _aten.new_ones.default,
                      _aten.new_full.default, _aten.new_empty.default, _aten.copy.default}


def _value_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose values `node` reads (`fill_` becomes full_like(buffer),
    which reads the buffer's shape only)."""
    if node.target in _METADATA_OF_FIRST and node.args and isinstance(node.args[0], torch.fx.Node):
        first = node.args[0]
        rest = [*node.args[1:], *node.kwargs.values()]
        return [n for n in node.all_input_nodes if n is not first or first in rest]
    return list(node.all_input_nodes)


def warn_folded_counters(exported: Exported, name: str, configs: Mapping[str, Any]) -> list[str]:
    """Warns about one-element buffers that AOTInductor compiles into constants.

    Inductor's joint-graph constant folding (UniformValueConstantFolder) reads
    any one-element tensor attribute as a known constant, mutated buffers
    included: a step counter updated from itself and constants only
    (``self.step += 1``) is folded to its initial value plus one, so the
    compiled model writes the same value every call and never accumulates
    (torch's own runner as well). Returns the FQNs warned about.
    """
    if configs.get(FOLDING_CONFIG) is False:
        return []
    ep = exported.decomposed
    sig = ep.graph_signature
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}

    def one_element(placeholder: str) -> bool:
        fqn = lifted.get(placeholder)
        value = None if fqn is None else ep.state_dict.get(fqn, ep.constants.get(fqn))
        return isinstance(value, torch.Tensor) and value.numel() == 1

    nodes = {n.name: n for n in ep.graph.nodes}
    folded = []
    for out_name, fqn in sig.buffers_to_mutate.items():
        own = next((p for p, f in sig.inputs_to_buffers.items() if f == fqn), None)
        if own is None or not one_element(own):
            continue
        leaves, seen, todo = set(), set(), [nodes[out_name]]
        while todo:
            node = todo.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op == "placeholder":
                leaves.add(node.name)
            todo.extend(_value_inputs(node))
        if own in leaves and all(one_element(p) for p in leaves):
            folded.append(fqn)
    if folded:
        warnings.warn(
            f"method '{name}': the one-element buffer(s) {', '.join(repr(f) for f in folded)} are updated from "
            "their own value and constants only (as a step counter `self.step += 1` is): AOTInductor's constant "
            "folding reads such a buffer as its initial value, so the compiled model would never accumulate it. "
            f"Compile with inductor_configs={{'{FOLDING_CONFIG}': False}}, or make the update read an input; "
            "verify= checks the compiled model against the module", CompileWarning, stacklevel=4)
    return folded
