"""Weight-only quantization at export (torchao): ``int8wo`` (int8 weights,
a scale per output row) and ``int4wo`` (int4 weights in groups of 128 along
the input, a scale and zero point a group). A decode step of one chat reads
every weight once, so its time follows the weights' bytes: int8 halves
bf16's, int4 quarters them (scales aside). Activations stay in the model's
dtype; the weights are dequantized inside the matrix multiply (int8 on CUDA:
a Triton matmul of ours, ``_int8_mm.py``, and Inductor's dequantizing matmul
elsewhere; int4: torch's int4 packed kernels, tinygemm's tiles, CUDA and
bfloat16 alone).

Quantized: every linear layer's weight (fused projections included,
llm/exporting/_fused.py) but the output head, which stays in the model's dtype (its
error lands straight on the logits, and a head tied to the embeddings would
quantize the embedding table too). The caller's model gets its weights back
after the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ._fused import FusedLinear
from ._int8_mm import int8_linears_on_kernel
from .._spec import QUANTIZATIONS

__all__ = ["SCHEMES", "check_scheme", "check_target", "inductor_configs", "quantized_weights"]

SCHEMES = QUANTIZATIONS
INT4_GROUP = 128


def check_scheme(scheme: str | None) -> None:
    """Raises ValueError for a scheme that is not one of SCHEMES (None: none),
    or ImportError naming the package where torchao is missing."""
    if scheme is None:
        return
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)} (or None), got {scheme!r}")
    try:
        import torchao  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        raise ImportError(f"quantize={scheme!r} needs torchao: pip install 'aoti-sessions[quantize]'") from None


def check_target(scheme: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError where ``scheme``'s kernels do not run: int4wo packs
    for torch's CUDA int4 kernel (tinygemm), which takes bfloat16."""
    if scheme == "int4wo" and (device.type != "cuda" or dtype != torch.bfloat16):
        raise ValueError(f"quantize='int4wo' exports for CUDA in bfloat16 (torch's int4 kernel), not for "
                         f"{device.type} in {str(dtype).removeprefix('torch.')}: export with device='cuda', "
                         "dtype='bfloat16', or quantize='int8wo'")


def _config(scheme: str, device: torch.device) -> Any:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig  # type: ignore[import-untyped]

    # set_inductor_config=False: torchao would set Inductor's global config for the rest of the process
    # (every later compile tuned by coordinate descent); export passes them to this compile alone instead.
    if scheme == "int8wo":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    # int4: packed in the tiles torch's CUDA kernel (tinygemm, _weight_int4pack_mm) reads.
    return Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                set_inductor_config=False)


def inductor_configs(scheme: str | None) -> dict[str, Any]:
    """The Inductor settings torchao recommends for quantized models (its
    ``recommended_inductor_config_setter``: tuned Triton kernels, the int8
    matmul fused with its scale), for a compile of ``scheme``; none for None."""
    if scheme is None:
        return {}
    return {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
            "force_fuse_int_mm_with_mul": True}


def _quantizable(module: torch.nn.Module, head: torch.nn.Module | None, scheme: str) -> bool:
    if module is head or not isinstance(module, (torch.nn.Linear, FusedLinear)):
        return False
    weight = module.weight
    # int4 packs groups of 128 inputs; a layer narrower than that (a test model's) stays as it is.
    return scheme != "int4wo" or (weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % 8 == 0)


@contextmanager
def quantized_weights(model: torch.nn.Module, scheme: str | None, int8_kernel: bool = False) -> Iterator[int]:
    """``model``'s linear weights quantized by ``scheme`` for the block (see
    the module's doc; None: nothing changes); yields how many layers were.
    The original weights are put back afterwards. ``int8_kernel`` (export's):
    on CUDA, int8wo's linears on ``_int8_mm``'s matmul for the block; off,
    they compute as torchao's own linear does (the tests' eager reference)."""
    if scheme is None:
        yield 0
        return
    from torch.nn.utils import parametrize
    from torchao.quantization import quantize_
    from torchao.utils import UnwrapTensorSubclass  # type: ignore[import-untyped]

    outputs = getattr(model, "get_output_embeddings", None)
    head = outputs() if callable(outputs) else None
    targets: dict[int, torch.nn.Module] = {id(m): m for m in model.modules() if _quantizable(m, head, scheme)}
    saved = [(m, m.weight) for m in targets.values()]
    device = saved[0][1].device if saved and isinstance(saved[0][1], torch.Tensor) else torch.device("cpu")
    try:
        if targets:
            quantize_(model, _config(scheme, device), filter_fn=lambda m, _fqn: id(m) in targets)
            # Export takes plain tensors: each quantized weight as a parametrization of its parts
            # (the int8 or packed int4 data, its scales), which the package stores as weights.
            # (torchao's unwrap_tensor_subclass does this for nn.Linear alone, not fused projections.)
            for module in targets.values():
                parametrize.register_parametrization(module, "weight", UnwrapTensorSubclass())
        # On CUDA, int8 linears on our matmul: Inductor would rewrite torchao's into torch's fp32 loop (_int8_mm.py).
        with int8_linears_on_kernel() if int8_kernel and scheme == "int8wo" and device.type == "cuda" \
                else nullcontext():
            yield len(targets)
    finally:
        for module, weight in saved:
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            module.weight = weight
