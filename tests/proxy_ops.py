"""A custom op (torch.library.custom_op), which AOTInductor runs through its
proxy executor, and a module with per-session state that calls it. Importing
this module registers the op; a process that does not import it has none."""

from __future__ import annotations

import torch

OP = "aoti_sessions_test::scale_shift"
LIMIT = 1e6  # inputs beyond it make the op raise


@torch.library.custom_op(OP, mutates_args=())
def scale_shift(x: torch.Tensor, bias: torch.Tensor | None, scale: float, dims: list[int],
                fail_above: float = LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * scale + bias, x summed over ``dims``); raises past ``fail_above``."""
    if bool(x.abs().max() > fail_above):
        raise ValueError(f"scale_shift: an input is beyond {fail_above:g}")
    y = x * scale + (bias if bias is not None else 0)
    return y, x.sum(dims)


@scale_shift.register_fake
def _(x: torch.Tensor, bias: torch.Tensor | None, scale: float, dims: list[int],
      fail_above: float = LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    kept = [d for d in range(x.dim()) if d not in dims]
    return torch.empty_like(x), x.new_empty([x.shape[d] for d in kept])


class ProxyModel(torch.nn.Module):
    """y = scale_shift(x @ w, b) + total, where total (per-session state)
    accumulates the op's row sums."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.b = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("total", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, sums = torch.ops.aoti_sessions_test.scale_shift(x @ self.w, self.b, 0.5, [1])
        self.total.add_(sums.sum())
        return y + self.total


MIX = "aoti_sessions_test::mix"


@torch.library.custom_op(MIX, mutates_args=())
def mix(xs: list[torch.Tensor], maybe: torch.Tensor | None, n: int, *, dtype: torch.dtype,
        flag: bool = True) -> list[torch.Tensor]:
    """Argument kinds a plan must lay out: a tensor list, an absent optional
    tensor, an int (symbolic under export), keyword-only dtype and bool; a
    tensor list back."""
    assert maybe is None and flag
    return [(x * n).to(dtype) for x in xs]


@mix.register_fake
def _(xs: list[torch.Tensor], maybe: torch.Tensor | None, n: int, *, dtype: torch.dtype,
      flag: bool = True) -> list[torch.Tensor]:
    return [torch.empty_like(x, dtype=dtype) for x in xs]


class MixModel(torch.nn.Module):
    """Calls ``mix`` with the row count as its int (dynamic with a dynamic batch)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        outs = torch.ops.aoti_sessions_test.mix([a, b + 1], None, a.shape[0], dtype=torch.float64)
        return outs[0].sum(1) + outs[1].sum(1)
