"""Eager models the tests compile (besides the built-in decoder)."""

from __future__ import annotations

import torch
from torch import nn


class Counter(nn.Module):
    """One read-only buffer (`table`, indexed by an input so it is never folded)
    and two mutated ones: `acc` (non-zero initial value) and `hits` (all zero)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.lin = nn.Linear(8, 8)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(8, 8, generator=g))
            self.lin.bias.copy_(torch.randn(8, generator=g))
        self.register_buffer("table", torch.randn(16, 8, generator=g))
        self.register_buffer("acc", torch.full((4, 8), 0.5))
        self.register_buffer("hits", torch.zeros(4, dtype=torch.int64))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + self.table[slot]
        self.acc.index_add_(0, slot, y)
        self.hits.index_add_(0, slot, torch.ones_like(slot))
        return self.acc.sum(0, keepdim=True) * y + self.hits.float().sum()

    @staticmethod
    def example() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(1, 8), torch.tensor([0])


class KwargsModel(nn.Module):
    """Keyword inputs and nested tuple outputs, around a mutated buffer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.w = nn.Parameter(torch.randn(3, 3, generator=g))
        self.register_buffer("state", torch.zeros(2, 3))

    def forward(self, x: torch.Tensor, *, gain: torch.Tensor, shift: torch.Tensor):
        self.state.add_(x @ self.w)
        return self.state * gain, (self.state + shift, x.sum(dim=0))

    @staticmethod
    def example() -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
        return (torch.randn(2, 3),), {"gain": torch.randn(3), "shift": torch.randn(2, 3)}


class CounterTall(Counter):
    """Counter with a taller `acc`: same FQN, different shape."""

    def __init__(self) -> None:
        super().__init__()
        self.acc = torch.full((6, 8), 0.5)


class CounterReseeded(Counter):
    """Counter from another checkpoint: same FQNs and layouts, other weights."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.lin.weight.mul_(-0.5)


class Heads(nn.Module):
    """Three entry points over partly shared weights: `a` reads emb and head_a,
    `b` emb and head_b, `both` all three. Stateless."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Parameter(torch.randn(16, 8, generator=g))
        self.head_a = nn.Parameter(torch.randn(8, 4, generator=g))
        self.head_b = nn.Parameter(torch.randn(8, 6, generator=g))

    def a(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb[idx] @ self.head_a

    def b(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb[idx] @ self.head_b

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(idx), self.b(idx)

    @staticmethod
    def example() -> tuple[torch.Tensor]:
        return (torch.tensor([1, 5, 7]),)


class Wide(nn.Module):
    """A few hundred MB of weights (one 8192 x 8192 float32 matrix), stateless."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8192, 8192, generator=torch.Generator().manual_seed(4)) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class HostSync(nn.Module):
    """A mutated buffer and an output whose size depends on the data
    (nonzero): the run waits for the device on the host, so it cannot be
    captured into a CUDA graph."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(x)
        return torch.nonzero(self.acc > 1.0).flatten()

    @staticmethod
    def example() -> tuple[torch.Tensor]:
        return (torch.rand(8),)


class Batched(nn.Module):
    """A mutated buffer and an input with a dynamic batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(x.sum(0))
        return x * self.acc

    @staticmethod
    def example() -> tuple[torch.Tensor]:
        return (torch.rand(4, 8),)
