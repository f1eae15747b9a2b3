"""A method's call signature as one line of text (``Engine.signature``,
``aoti-sessions info``): input names, dtypes and shapes, outputs::

    decode(input_ids: int64[1, 1], cache_position: int64[1]) -> float32[1, 128]
    prefill(tokens: int64[1, s0], /) -> float32[1, s0, 128]  where 2 <= s0 <= 64

Inputs given by position in the export are positional-only (before ``/``);
keyword inputs may also be given by position, in the order shown. Names are
the exported ones; packages that do not record them show the container's
input index (``#0``), and dynamic dimensions whose symbol is not recorded ``?``.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from ._package import InputDoc, OutputDoc, SessionsMetadata

__all__ = ["signature"]


def _tensor(doc: InputDoc | OutputDoc | None) -> str:
    if doc is None:
        return "Tensor"
    symbols = doc.symbols or [None] * len(doc.sizes)
    dims = [str(size) if size is not None else (symbol or "?") for size, symbol in zip(doc.sizes, symbols)]
    return f"{doc.dtype}[{', '.join(dims)}]"


def _structure(spec: pytree.TreeSpec, leaf: Any) -> str:
    """`spec` written as Python writes its containers, each leaf by `leaf()`."""
    if spec.is_leaf():
        return str(leaf())
    if spec.type is type(None):
        return "None"
    parts = [_structure(child, leaf) for child in spec.children()]
    if spec.type is dict:
        return "{" + ", ".join(f"{key!r}: {part}" for key, part in zip(spec.context, parts)) + "}"
    if spec.type is list:
        return "[" + ", ".join(parts) + "]"
    if spec.type is tuple:
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    return f"{getattr(spec.type, '__name__', spec.type)}(" + ", ".join(parts) + ")"


def _inputs(in_spec: pytree.TreeSpec | None, count: int, docs: list[InputDoc] | None) -> str:
    def doc(i: int) -> InputDoc | None:
        return docs[i] if docs is not None and i < len(docs) else None

    def label(i: int) -> str:
        d = doc(i)
        return d.name if d is not None and d.name else f"#{i}"

    standard = (in_spec is not None and in_spec.type is tuple and in_spec.num_children == 2
                and in_spec.num_leaves == count and in_spec.children()[0].type is tuple
                and in_spec.children()[1].type is dict)
    if in_spec is None or not standard:  # no spec, or non-tensor inputs baked in: the container's inputs
        return ", ".join(f"{label(i)}: {_tensor(doc(i))}" for i in range(count))
    args_spec, kwargs_spec = in_spec.children()
    counter = iter(range(count))
    parts = []
    for position, child in enumerate(args_spec.children()):
        if child.is_leaf():
            i = next(counter)
            parts.append(f"{label(i)}: {_tensor(doc(i))}")
        else:
            parts.append(f"#{position}: " + _structure(child, lambda: _tensor(doc(next(counter)))))
    if parts:
        parts.append("/")
    for key, child in zip(kwargs_spec.context, kwargs_spec.children()):
        parts.append(f"{key}: " + _structure(child, lambda: _tensor(doc(next(counter)))))
    return ", ".join(parts)


def signature(name: str, in_spec: pytree.TreeSpec | None, out_spec: pytree.TreeSpec | None, num_inputs: int,
              metadata: SessionsMetadata | None) -> str:
    """One method's signature; see the module's docstring."""
    docs = metadata.inputs if metadata is not None else None
    text = f"{name}({_inputs(in_spec, num_inputs, docs)})"
    outputs = metadata.outputs if metadata is not None else None
    if out_spec is not None:
        leaves = iter(outputs) if outputs is not None and len(outputs) == out_spec.num_leaves else None
        text += " -> " + _structure(out_spec, lambda: _tensor(next(leaves) if leaves is not None else None))
    if metadata is not None and metadata.ranges:
        tensors: list[InputDoc | OutputDoc] = [*(docs or []), *(outputs or [])]
        used = {s for d in tensors for s in (d.symbols or []) if s}
        bounds = [f"{lo if lo is not None else 0} <= {sym}" + (f" <= {hi}" if hi is not None else "")
                  for sym, (lo, hi) in metadata.ranges.items() if sym in used]
        if bounds:
            text += "  where " + ", ".join(bounds)
    return text
