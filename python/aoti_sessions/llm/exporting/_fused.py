"""Sibling projections fused at export: a layer's query, key and value
projections become one matrix multiply, and so do its MLP's gate and up
projections, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do. A decode step of one chat reads each
weight once either way; what the fusion saves is launches and their tails
(issue 38: three GEMVs a layer where one reads the same bytes).

The model's own code runs unchanged. Each projection module is swapped,
for the export, for a view of one fused projection: the first sibling
called on an input multiplies it by the concatenated weights once; each
sibling returns its columns of that result for the same input tensor (the
model's code hands its siblings one ``hidden_states``). A sibling called on
another tensor multiplies that by its own rows of the fused weight, so the
fusion never changes what a projection returns, only how often it is
computed. The package then holds the fused weights (``<parent>.fused_qkv``,
``<parent>.fused_gate_up``), never the parts as well; the caller's model is
given its modules back afterwards. (On CUDA the parts wait on the host
meanwhile, so the device never holds both.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

__all__ = ["FusedLinear", "fused_projections", "SIBLINGS"]

# The sibling projections a module may hold (the names transformers' families use), fused in this order,
# and the name of the fused projection on their module.
_NAMES = {("q_proj", "k_proj", "v_proj"): "fused_qkv", ("gate_proj", "up_proj"): "fused_gate_up"}
SIBLINGS: tuple[tuple[str, ...], ...] = tuple(_NAMES)


class FusedLinear(torch.nn.Module):
    """The concatenated weights (and biases) of sibling ``nn.Linear`` layers
    of one input width; :meth:`part` is what the siblings call."""

    def __init__(self, linears: Sequence[torch.nn.Linear]) -> None:
        super().__init__()
        self.widths = [layer.out_features for layer in linears]
        with torch.no_grad():
            self.weight = torch.nn.Parameter(torch.cat(tuple(layer.weight for layer in linears)), requires_grad=False)
            biases = [layer.bias for layer in linears]
            self.bias = None if biases[0] is None else torch.nn.Parameter(torch.cat(tuple(b for b in biases if b is not None)), requires_grad=False)
        # The product of an input and the fused weights; None: F.linear (decode_one sets its kernel: _one_row.py).
        self.product: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s projection of ``x``: its columns of the fused
        product, computed once for the siblings' shared input."""
        if self._input is not x:
            self._input = x
            product = F.linear(x, self.weight, self.bias) if self.product is None else self.product(x)
            self._parts = tuple(torch.split(product, self.widths, dim=-1))
        # A copy, in a layout of its own: Inductor's lowering of the model's
        # ``.view`` of a column slice guards the rows (> 1, its stride rule for a
        # non-contiguous view), so the package would refuse a lone session's
        # row; the copy is a pointwise read fused into its consumer, not a
        # kernel. (Not ``.contiguous()``: its check guards the rows as well.)
        out = self._parts[index].clone(memory_format=torch.contiguous_format)
        if index == len(self.widths) - 1:  # the last sibling: nothing held past the layer's call
            self._input, self._parts = None, ()
        return out


class _Part(torch.nn.Module):
    """A sibling projection as a view of its :class:`FusedLinear` (held
    outside the module tree, so the fused weight is registered once)."""

    def __init__(self, fused: FusedLinear, index: int, original: torch.nn.Linear) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)
        self.index = index
        self.in_features, self.out_features = original.in_features, original.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused: FusedLinear = self.__dict__["fused"]
        return fused.part(self.index, x)


def _fusable(parent: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    """The sibling projections ``names`` of ``parent`` where they are plain
    ``nn.Linear`` layers of one input width, dtype and device, all with a
    bias or all without; None otherwise."""
    layers = [getattr(parent, name, None) for name in names]
    if not all(type(layer) is torch.nn.Linear for layer in layers):
        return None
    linears = [layer for layer in layers if isinstance(layer, torch.nn.Linear)]
    first = linears[0]
    if any(layer.in_features != first.in_features or layer.weight.dtype != first.weight.dtype
           or layer.weight.device != first.weight.device or (layer.bias is None) != (first.bias is None)
           for layer in linears):
        return None
    return linears


@contextmanager
def fused_projections(model: torch.nn.Module) -> Iterator[int]:
    """Every fusable set of sibling projections in ``model`` (see the
    module's doc) fused for the block; yields how many sets were fused.
    Sets whose weights are tied (the same parameters, as Zamba2's shared
    blocks hold them) share one fused projection, so the package holds it
    once, as it holds a tied weight once. The model's modules are put back
    afterwards."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear, torch.device]] = []  # (and the part's device)
    added: list[tuple[torch.nn.Module, str]] = []
    fused_by_weights: dict[tuple[int, ...], FusedLinear] = {}
    try:
        for parent in list(model.modules()):
            for names in SIBLINGS:
                linears = _fusable(parent, names)
                if linears is None:
                    continue
                tied = tuple(id(layer.weight) for layer in linears)
                if tied not in fused_by_weights:
                    fused_by_weights[tied] = FusedLinear(linears)
                fused = fused_by_weights[tied]
                parent.add_module(_NAMES[names], fused)
                added.append((parent, _NAMES[names]))
                for index, (name, layer) in enumerate(zip(names, linears)):
                    swapped.append((parent, name, layer, layer.weight.device))
                    setattr(parent, name, _Part(fused, index, layer))
        # The parts out of the device once every set is fused (a tied part moved earlier would move its twin).
        for _, _, layer, device in swapped:
            if device.type == "cuda":
                layer.to("cpu")
        yield len(added)
    finally:
        for _, _, layer, device in reversed(swapped):
            layer.to(device)
        for parent, name, original, _ in reversed(swapped):
            setattr(parent, name, original)
        for parent, name in added:
            delattr(parent, name)
