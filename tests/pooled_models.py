"""A small decoder over pooled state (docs/batching.md), for the engine's
pool tests: per-layer causal attention over a paged KV pool, plus a
recurrent per-session vector in a slot pool (a decayed running sum of the
hidden states, mixed into every step's output), so both kinds of pooled state
are exercised. Rows of one call are independent sessions.

``PagedDecoder`` is also its own eager reference: ``Reference`` runs it on
plain tensors with a tiny allocator, one session at a time.
"""

from __future__ import annotations

import torch
from torch import nn

import aoti_sessions as ais

VOCAB = 61
DIM = 32
HEADS = 2
HEAD_DIM = 16
LAYERS = 2
PAGE = 4
MAX_PAGES = 10  # a session holds at most 40 positions
MAX_ROWS = 8
PREFILL = 6


class PagedDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = nn.Parameter(torch.randn(VOCAB, DIM, generator=g) * 0.5)
        self.qkv = nn.Parameter(torch.randn(LAYERS, DIM, 3 * HEADS * HEAD_DIM, generator=g) / DIM ** 0.5)
        self.out = nn.Parameter(torch.randn(LAYERS, HEADS * HEAD_DIM, DIM, generator=g) / DIM ** 0.5)
        self.head = nn.Parameter(torch.randn(DIM, VOCAB, generator=g) / DIM ** 0.5)
        self.register_buffer("freq", 1.0 / (100.0 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angles = pos[..., None].float() * self.freq  # [B, T, D/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        a, b = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, input_ids: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor,
                positions: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        rows, count = input_ids.shape
        pos = positions[:, None] + torch.arange(count, device=input_ids.device)  # [B, T]
        page = torch.gather(page_table, 1, pos // PAGE).long()  # [B, T]
        offset = pos % PAGE
        keys = page_table.shape[1] * PAGE
        key_pos = torch.arange(keys, device=input_ids.device)
        visible = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, K]
        h = self.embed[input_ids]  # [B, T, DIM]
        for layer in range(LAYERS):
            # Three products, each contiguous: reshaping a strided view guards
            # the row count against 1 at export.
            q, k, v = (h @ w for w in self.qkv[layer].split(HEADS * HEAD_DIM, dim=1))
            q, k, v = (x.view(rows, count, HEADS, HEAD_DIM) for x in (q, k, v))
            q, k = self._rope(q, pos), self._rope(k, pos)
            # index_put_ on the pool with one index tensor per dimension: the
            # compiled model writes that in place (a write through a view of
            # the pool copies all of it).
            at = (page.reshape(-1), torch.full_like(page.reshape(-1), layer), offset.reshape(-1))
            kv.index_put_((at[0], at[1], torch.zeros_like(at[0]), at[2]), k.view(-1, HEADS, HEAD_DIM))
            kv.index_put_((at[0], at[1], torch.ones_like(at[0]), at[2]), v.view(-1, HEADS, HEAD_DIM))
            gathered = kv[page_table.long(), layer]  # [B, P, 2, PAGE, H, D]
            ks = gathered[:, :, 0].reshape(rows, keys, HEADS, HEAD_DIM).transpose(1, 2)
            vs = gathered[:, :, 1].reshape(rows, keys, HEADS, HEAD_DIM).transpose(1, 2)
            scores = (q.transpose(1, 2) @ ks.transpose(-1, -2)) / HEAD_DIM ** 0.5  # [B, H, T, K]
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ vs  # [B, H, T, D]
            h = h + attn.transpose(1, 2).reshape(rows, count, HEADS * HEAD_DIM) @ self.out[layer]
        # The recurrent state, a linear recurrence over positions (s <- 0.9 s +
        # h_t / 8 at every new position), so feeding in chunks gives the same state.
        slot = slot_ids.long()
        decay = 0.9 ** (count - 1 - torch.arange(count, device=input_ids.device, dtype=h.dtype))
        new_state = 0.9 ** count * state[slot] + (decay[None, :, None] * h).sum(dim=1) / 8
        state.index_put_((slot,), new_state)
        last = h[:, -1] + 0.5 * torch.tanh(new_state)
        return last @ self.head  # [B, VOCAB]

    @staticmethod
    def pool() -> ais.Pool:
        return ais.Pool(tokens="input_ids", pages=("kv",), page_size=PAGE, page_table="page_table",
                        positions="positions", slots=("state",), slot_ids="slot_ids")

    @staticmethod
    def example(rows: int, count: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
        kv = torch.zeros(5, LAYERS, 2, PAGE, HEADS, HEAD_DIM)
        table = torch.zeros(rows, MAX_PAGES, dtype=torch.int32)
        table[:, 0] = torch.arange(2, 2 + rows)
        return tuple(t.to(device) for t in (torch.zeros(rows, count, dtype=torch.long), kv, table,
                                            torch.zeros(rows, dtype=torch.long), torch.zeros(3 + rows, DIM),
                                            torch.arange(1, 1 + rows, dtype=torch.int32)))

    @classmethod
    def methods(cls, device: str = "cpu") -> dict[str, ais.Method]:
        units = torch.export.Dim.DYNAMIC
        rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
        count = torch.export.Dim("count", min=2, max=PREFILL)
        return {
            "prefill": ais.Method(cls.example(1, 3, device), pool=cls.pool(),
                                  dynamic_shapes=({1: count}, {0: units}, None, None, {0: units}, None)),
            "decode": ais.Method(cls.example(2, 1, device), pool=cls.pool(),
                                 dynamic_shapes=({0: rows}, {0: units}, {0: rows}, {0: rows}, {0: units},
                                                 {0: rows})),
        }


class Reference:
    """One session run eagerly through the module, on its own small pool."""

    def __init__(self, module: PagedDecoder, device: str = "cpu") -> None:
        self.module = module
        self.device = device
        self.kv = torch.zeros(2 + MAX_PAGES, LAYERS, 2, PAGE, HEADS, HEAD_DIM, device=device)
        self.state = torch.zeros(2, DIM, device=device)
        self.table = torch.arange(2, 2 + MAX_PAGES, dtype=torch.int32, device=device)[None]
        self.length = 0

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        d = self.device
        out = self.module(torch.tensor([tokens], device=d), self.kv, self.table, torch.tensor([self.length], device=d),
                          self.state, torch.tensor([1], dtype=torch.int32, device=d))
        self.length += len(tokens)
        return out[0]

    def copy(self) -> Reference:
        twin = Reference(self.module, self.device)
        twin.kv, twin.state, twin.length = self.kv.clone(), self.state.clone(), self.length
        return twin


def build(device: str) -> tuple[PagedDecoder, dict[str, ais.Method], None]:
    """What the tests compile (tests/conftest.py)."""
    return PagedDecoder().to(device).eval(), PagedDecoder.methods(device), None
