"""``ais.compile(..., verify=N)``: the compiled package, run through an Engine
on one session, against the eager module, step by step, state included."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ._engine import Engine
from ._program import FOLDING_CONFIG, Method
from .errors import VerifyError

__all__ = ["verify_package", "TOLERANCES"]

# (rtol, atol) per floating dtype: the compiled kernels fuse and reorder
# arithmetic, so floats match closely, not bit for bit. Other dtypes: exact.
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def _device_of(module: torch.nn.Module, methods: list[tuple[str, Method]]) -> torch.device:
    """Where the example inputs (else the module's tensors) are: the package's device."""
    leaves = pytree.tree_leaves([(m.args, dict(m.kwargs or {})) for _, m in methods])
    for x in (*leaves, *module.parameters(), *module.buffers()):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _fresh(tree: Any) -> Any:
    """The example inputs, copied: a run may not see what another one wrote."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _show(t: torch.Tensor) -> str:
    values = t.detach().cpu().flatten()
    if values.numel() == 1:
        return f"{values.item():g}" if values.dtype.is_floating_point else str(values.item())
    return "[" + ", ".join(f"{v:g}" for v in values[:4].tolist()) + (", ...]" if values.numel() > 4 else "]")


def _difference(compiled: Any, eager: Any) -> str | None:
    """None if the two agree (within TOLERANCES), else how they differ."""
    if not isinstance(compiled, torch.Tensor) or not isinstance(eager, torch.Tensor):
        return None if compiled == eager else f"compiled {compiled!r}, eager {eager!r}"
    if compiled.dtype != eager.dtype or compiled.shape != eager.shape:
        return (f"compiled {str(compiled.dtype).removeprefix('torch.')}{list(compiled.shape)}, "
                f"eager {str(eager.dtype).removeprefix('torch.')}{list(eager.shape)}")
    a, b = compiled.detach().cpu(), eager.detach().cpu()
    rtol, atol = TOLERANCES.get(a.dtype, (0.0, 0.0))
    if torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True) if a.dtype in TOLERANCES else torch.equal(a, b):
        return None
    if a.numel() <= 4:
        return f"compiled {_show(a)}, eager {_show(b)}"
    gap = (a.double() - b.double()).abs().nan_to_num(float("inf"))
    worst = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
    return (f"max abs difference {gap.max().item():g} at {list(worst)} "
            f"(compiled {a[worst].item():g}, eager {b[worst].item():g})")


def verify_package(module: torch.nn.Module, path: str, methods: list[tuple[str, Method]], steps: int) -> None:
    """Runs every method in order, ``steps`` times, on one session of ``path``
    and on ``module`` (the eager reference, changed by the runs), comparing the
    outputs and every mutated buffer after each call. Raises VerifyError at the
    first call where they differ."""
    device = _device_of(module, methods)
    eager_buffers = dict(module.named_buffers(remove_duplicate=False))
    with Engine(path, device=device) as engine, engine.new_session() as session, torch.no_grad():
        for step in range(1, steps + 1):
            for name, method in methods:
                # A single-method package names its model "model".
                engine_name = name if len(methods) > 1 else engine.methods[0]
                kwargs = dict(method.kwargs or {})
                expected = getattr(module, method.entry)(*_fresh(method.args), **_fresh(kwargs))
                got = session.run(engine_name, *_fresh(method.args), **_fresh(kwargs))
                state = session.state()
                buffers = {fqn: _difference(state[fqn], eager_buffers.get(fqn)) for fqn in engine.mutable_fqns}
                outputs = _output_differences(got, expected)
                if any(buffers.values()) or outputs:
                    _fail(name, step, steps, methods, module, {k: v for k, v in buffers.items() if v}, outputs)


def _output_differences(got: Any, expected: Any) -> dict[int, str]:
    got_leaves, got_spec = pytree.tree_flatten(got)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    if got_spec != expected_spec:
        return {-1: f"the compiled outputs are structured as {got_spec}, the module's as {expected_spec}"}
    found = {i: _difference(a, b) for i, (a, b) in enumerate(zip(got_leaves, expected_leaves))}
    return {i: d for i, d in found.items() if d}


def _fail(name: str, step: int, steps: int, methods: list[tuple[str, Method]], module: torch.nn.Module,
          buffers: dict[str, str], outputs: dict[int, str]) -> None:
    order = " then ".join(n for n, _ in methods)
    lines = [f"the compiled package differs from the module at step {step} of {steps}, method '{name}' "
             f"(each step runs {order} on one session):"]
    lines += [f"  buffer '{fqn}': {what}" for fqn, what in buffers.items()]
    lines += [f"  outputs: {what}" if i < 0 else f"  output {i}: {what}" for i, what in outputs.items()]
    one_element = [fqn for fqn in buffers if _numel(module, fqn) == 1]
    if one_element:
        lines.append(f"  {', '.join(repr(f) for f in one_element)} hold one element: AOTInductor's constant "
                     "folding reads a one-element buffer updated from constants as its initial value; compile "
                     f"with inductor_configs={{'{FOLDING_CONFIG}': False}}")
    raise VerifyError("\n".join(lines), name, step, list(buffers), [i for i in outputs if i >= 0])


def _numel(module: torch.nn.Module, fqn: str) -> int:
    try:
        return module.get_buffer(fqn).numel()
    except AttributeError:
        return -1
