"""Built-in models: a small decoder with per-layer KV-cache buffers.

Real causal attention over a fixed-size cache, rotary position embeddings from
read-only buffers, and positions passed as inputs (as LLM exports do), so the
compiled model's only mutable state is the KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DecoderConfig", "TinyDecoder", "SMALL", "LARGE"]


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 256
    dim: int = 128
    layers: int = 4
    heads: int = 4
    max_seq: int = 256  # KV cache length
    batch: int = 1
    dtype: str = "float32"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def state_bytes(self) -> int:
        """Bytes of KV cache per session."""
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.layers * self.batch * self.max_seq * self.dim * element


# The demo's default, and the "small" model of the benchmarks.
SMALL = DecoderConfig()
# 24 layers, 2k context: hundreds of MiB of state and about a GB of weights.
LARGE = DecoderConfig(vocab=32000, dim=1536, layers=24, heads=12, max_seq=2048, dtype="bfloat16")


def _rotary_tables(cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(cfg.max_seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [T, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Block(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)
        shape = (cfg.batch, cfg.heads, cfg.max_seq, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(cfg.dim, dim=-1)
        q, k, v = (y.view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2) for y in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        scores = (q @ self.k_cache.transpose(-1, -2)) / math.sqrt(cfg.head_dim)  # [B, H, T, S]
        visible = torch.arange(cfg.max_seq, device=x.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.softmax(scores.float(), dim=-1).to(x.dtype) @ self.v_cache
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, cfg.dim))
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))
        return out


class TinyDecoder(nn.Module):
    """tokens [B, T] int64, positions [T] int64 -> logits [B, T, vocab] float32."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: DecoderConfig = SMALL) -> None:
        super().__init__()
        self.cfg = cfg
        generator = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
        cos, sin = _rotary_tables(cfg)
        self.register_buffer("rope_cos", cos)  # read-only: shared, not per session
        self.register_buffer("rope_sin", sin)
        self.to(getattr(torch, cfg.dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers:
            x = layer(x, positions, cos, sin)
        logits: torch.Tensor = self.head(self.norm(x)).float()
        return logits

    def example_inputs(self, steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(self.cfg.batch, steps, dtype=torch.int64)
        return tokens, torch.arange(steps, dtype=torch.int64)
