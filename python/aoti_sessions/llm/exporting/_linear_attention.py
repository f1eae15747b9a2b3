"""Three of transformers' reference functions for linear-attention and
state-space layers in a form AOTInductor compiles for every row count and
length: the chunked gated delta rule (Qwen3-Next's linear attention), the
chunked scan of Mamba2's state-space duality (SSD), and the cached step of a
causal depthwise convolution (Qwen3-Next, LFM2, Mamba2).
:func:`layers_traceable` puts them in place of transformers' while a package
is exported.

The chunked gated delta rule:

transformers' reference (``torch_chunk_gated_delta_rule``) computes the same
thing, but its traced form serves only the example's shape: its export path
inverts each chunk's triangular system by forward substitution, writing rows
in place (the trace then guards the row count against 1), and its scan over
chunks is a Python loop over a count that depends on the length. Here:

- the sequence is padded to a static length (``length``: the package's
  max_prefill, rounded up to whole chunks), so the scan's loop is fixed; a
  padded position has a zero key, value, beta and log-decay, which leaves
  the state as it was, so real positions' outputs and the state are exact;
- a chunk's unit lower-triangular system ``I + A`` (``A`` strictly lower,
  so nilpotent) is inverted as ``(I - A)(I + A^2)(I + A^4)...``: log2(chunk)
  matrix products, no writes in place;
- the chunks' outputs are concatenated, not written into a preallocated
  tensor, and each chunk is a slice of its operands, not a select.

Everything else follows the reference step by step (float32 inside, query
and key L2-normalised when asked, query scaled by the key dimension).

The SSD chunk scan (transformers' ``mamba2_chunk_scan``) pads the sequence to
a whole number of chunks of the example's length, and its trace then guards
on that length; here it is padded to the same static length as the delta
rule's. A padded position has a zero input and a zero log-decay (its
``dt`` times ``A``), which leaves the state as it was.

Mamba (1)'s selective scan (Jamba's ``mamba_selective_scan``) is a Python
loop over the positions, from a zero state whatever the cache holds (so a
second prompt chunk would forget the first). Here it is a log-depth scan
(``h_t = a_t h_{t-1} + b_t`` combined over shifts of 1, 2, 4, ... positions)
over the same static length, from the layer's state: the mixer's call is
wrapped to hand the scan its cached state (:func:`layers_traceable`).

MiniMax's lightning attention (linear attention with a fixed decay a head)
loops over blocks of the prompt, then over positions once a state is
cached, and accepts no cache but MiniMax's own. Here its layer's forward is
one quadratic form over the call's positions (decay ``exp(-slope (t - j))``
for ``j <= t``) plus the cached state's share, through transformers' linear
attention cache API, and MiniMax's model takes any cache while a package is
exported.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule", "ssd_chunk_scan", "selective_scan", "lightning_attention", "causal_conv1d_update",
           "layers_traceable"]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + a)^-1`` for strictly lower-triangular ``a`` [..., C, C]."""
    size = a.shape[-1]
    eye = torch.eye(size, dtype=a.dtype, device=a.device)
    power = -a
    inverse = eye + power  # sum of (-a)^k for k < 2
    covered = 2
    while covered < size:  # multiply by (I + (-a)^covered): the sum for k < 2 * covered
        power = power @ power
        inverse = inverse + inverse @ power
        covered *= 2
    return inverse


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, *,
                           length: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query, key [B, T, Hk, Dk], value [B, T, Hv, Dv], g (log decay) and
    beta [B, T, Hv], initial_state [B, Hv, Dk, Dv]: the output [B, T, Hv, Dv]
    and the state after the last position; T <= ``length``."""
    dtype = query.dtype
    count = query.shape[1]
    heads_k, heads_v = key.shape[2], value.shape[2]
    if heads_k != heads_v:  # each query/key head serves heads_v // heads_k value heads
        query = query.repeat_interleave(heads_v // heads_k, dim=2)
        key = key.repeat_interleave(heads_v // heads_k, dim=2)
    padded = -(-length // chunk_size) * chunk_size

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, padded, ...], float32
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, padded - count))
        return x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)

    query, key, value, beta, decay = (heads_first(x) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    rows, heads, _, dim_v = value.shape
    chunks = padded // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, H, padded, D] -> [B, H, chunks, C, D]
        return x.reshape(rows, heads, chunks, chunk_size, x.shape[-1])

    v_beta = chunked(value * beta.unsqueeze(-1))
    k_beta = chunked(key * beta.unsqueeze(-1))
    query, key = chunked(query), chunked(key)
    decay = decay.reshape(rows, heads, chunks, chunk_size).cumsum(dim=-1)  # within each chunk
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    inverse = _unit_lower_inverse(system.tril(-1))
    new_values = inverse @ v_beta
    k_cumdecay = inverse @ (k_beta * decay.exp().unsqueeze(-1))

    # The scan keeps the chunk dimension (size 1) on every operand, state
    # included: chunk i is a slice, never a select (whose squeeze makes
    # Inductor guard the row count against 1).
    state = torch.zeros(rows, heads, 1, key.shape[-1], dim_v, dtype=torch.float32, device=query.device) \
        if initial_state is None else initial_state.to(torch.float32).unsqueeze(2)
    query = query * decay.exp().unsqueeze(-1)
    last = decay[..., -1:]  # a chunk's whole decay
    key = key * (last - decay).exp().unsqueeze(-1)
    chunk_decay = last.exp().unsqueeze(-1)  # [B, H, chunks, 1, 1]
    outputs = []
    for i in range(chunks):
        at = slice(i, i + 1)
        v_new = new_values[:, :, at] - k_cumdecay[:, :, at] @ state
        outputs.append(query[:, :, at] @ state + intra[:, :, at] @ v_new)
        state = state * chunk_decay[:, :, at] + key[:, :, at].transpose(-1, -2) @ v_new
    # narrow, not a slice: torch 2.11 sizes [:count] as an unbacked Min(count, padded).
    out = torch.cat(outputs, dim=2).reshape(rows, heads, padded, dim_v).narrow(2, 0, count)
    state = state.squeeze(2)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), \
        (state if output_final_state else None)


def causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """The depthwise causal convolution of ``hidden_states`` [B, C, T] after
    the ``conv_state`` [B, C, K] before it (weight [C, K]), which it then
    holds the last K inputs; as transformers' reference, without ``conv1d``
    (whose lowering makes Inductor guard the row count against 1). The
    [B, C, T] result is a slice of a wider tensor: a layer's later reshape of
    a piece of it then copies whatever the row count, where on a contiguous
    result the trace guards it (Qwen3-Next's q/k/v split)."""
    from transformers.activations import ACT2FN

    count, width = hidden_states.shape[-1], conv_state.shape[-1]
    inputs = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)  # [B, C, K + T]
    conv_state.copy_(inputs[:, :, -width:])
    windows = inputs.unfold(-1, width, 1)[:, :, -count:]  # [B, C, T, K]: each output's inputs
    out = (windows * weight[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    out = out.to(hidden_states.dtype)
    return torch.cat([out, out], dim=-1)[..., :count]


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [..., C, C]: entry (i, j) the sum of x[j+1..i] for j <= i,
    -inf above the diagonal (the reference's segment sum)."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    strict = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(-1)
    sums = x.masked_fill(~strict, 0).cumsum(dim=-2)
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(0)
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunk_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                   dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False, *,
                   length: int, **kwargs: Any) -> Any:
    """hidden_states [B, T, H, P], dt [B, T, H], A [H], B and C [B, T, G, N],
    initial_states [B, H, P, N]: the output [B, T, H, P] (and the state after
    the last position when ``return_final_states``); T <= ``length``."""
    rows, count, heads, head_dim = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    groups = B.shape[2]
    B = B.float().repeat_interleave(heads // groups, dim=2)
    C = C.float().repeat_interleave(heads // groups, dim=2)
    padded = -(-length // chunk_size) * chunk_size
    chunks = padded // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, chunks, C, H, ...], zero padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, padded - count))
        return t.reshape(rows, chunks, chunk_size, *t.shape[2:])

    xs, a, b, c = chunked(x * dt[..., None]), chunked(A.float() * dt), chunked(B), chunked(C)
    a = a.permute(0, 3, 1, 2)  # [B, H, chunks, C]
    a_cumsum = a.cumsum(dim=-1)
    # Within each chunk: attention-like scores of C against B, decayed.
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * torch.exp(_segment_sum(a)).permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xs)
    # Each chunk's own state, then the states at the chunks' starts.
    decay_states = torch.exp(a_cumsum[..., -1:] - a_cumsum)
    states = torch.einsum("bclhn,bclhp->bchpn", b * decay_states.permute(0, 2, 3, 1)[..., None], xs)
    start = torch.zeros_like(states[:, :1]) if initial_states is None else initial_states[:, None].float()
    states = torch.cat([start, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[..., -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", c, states) * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
    # narrow, not a slice: torch 2.11 sizes [:count] as an unbacked Min(count, padded).
    out = (y_diag + y_off).reshape(rows, padded, heads, head_dim).narrow(1, 0, count)
    if D is not None:
        out = out + D[..., None] * x
    return (out, final) if return_final_states else out


_initial_states: list[torch.Tensor | None] = []  # the state of the Mamba mixer being traced (its call's)


def selective_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                   return_last_state: bool = False, *, length: int, **kwargs: Any) -> Any:
    """hidden_states, dt and z [B, I, T], A [I, N], B and C [B, N, T]: the
    output [B, I, T] (and the state [B, I, N] after the last position when
    ``return_last_state``), from the state the mixer's cache holds (zero
    where it holds none); T <= ``length``."""
    rows, channels, count = hidden_states.shape
    dt = dt.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    # Padded positions: dt 0, so a decay of 1 and no input (the state goes through unchanged).
    dt, u = (F.pad(x, (0, length - count)) for x in (dt, hidden_states.float()))
    B, C = (F.pad(x.float(), (0, length - count)).transpose(1, 2) for x in (B, C))  # [B, length, N]
    decay = torch.exp(A.float()[None, :, None, :] * dt[..., None])  # [B, I, length, N]
    state = (dt * u)[..., None] * B[:, None]
    initial = _initial_states[-1] if _initial_states else None
    if initial is not None:  # h_0 = a_0 h_init + b_0
        state = torch.cat([state[:, :, :1] + decay[:, :, :1] * initial.float()[:, :, None], state[:, :, 1:]], dim=2)
    shift = 1
    while shift < length:  # each position combines with the one `shift` before it (the first ones with nothing)
        state = state + decay * F.pad(state, (0, 0, shift, 0)).narrow(2, 0, length)
        decay = decay * F.pad(decay, (0, 0, shift, 0), value=1.0).narrow(2, 0, length)
        shift *= 2
    out = (state * C[:, None]).sum(-1).narrow(2, 0, count)  # [B, I, T]
    if D is not None:
        out = out + hidden_states.float() * D.float()[None, :, None]
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(hidden_states.dtype)
    return (out, state.narrow(2, count - 1, 1).squeeze(2)) if return_last_state else out


def lightning_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slope: torch.Tensor,
                        state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key, value [B, H, T, D], slope [H, ...] (each position decays
    the state by exp(-slope)), state [B, H, D, D] (None: zero): the output
    [B, H, T, D] (``o_t = q_t S_t``, ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``)
    and the state after the last position, in float32."""
    count = query.shape[2]
    query, key, value = query.float(), key.float(), value.float()
    rate = slope.float().reshape(1, -1, 1, 1)
    at = torch.arange(count, device=query.device, dtype=torch.float32)
    gaps = at[:, None] - at[None, :]  # [T, T]: t - j
    decay = torch.exp(-rate * gaps.clamp(min=0)) * (gaps >= 0)  # [1, H, T, T]
    out = ((query @ key.transpose(-1, -2)) * decay) @ value
    after = torch.exp(-rate * (count - 1 - at)[:, None])  # [1, H, T, 1]: each position's share of the last state
    last = (key * after).transpose(-1, -2) @ value
    if state is not None:
        state = state.float()
        out = out + (query * torch.exp(-rate * (at + 1)[:, None])) @ state
        last = last + torch.exp(-rate * count) * state
    return out, last


def _lightning_forward(layer: Any) -> Any:
    """A MiniMax lightning attention layer's forward over :func:`lightning_attention`."""
    def forward(hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, count, _ = hidden_states.shape
        heads, dim = layer.num_attention_heads, layer.head_dim
        qkv = layer.act_fn(layer.qkv_proj(hidden_states)).reshape(rows, count, heads, 3 * dim)
        query, key, value = (x.transpose(1, 2) for x in torch.split(qkv, dim, dim=3))
        state = None if cache is None else cache.get_recurrent_state(layer.layer_idx)
        out, state = lightning_attention(query, key, value, layer.slope_rate, state)
        if cache is not None:
            cache.update_recurrent_state(state.to(value.dtype), layer.layer_idx)
        out = out.to(value.dtype).transpose(1, 2).reshape(rows, count, heads * dim)
        out = torch.sigmoid(layer.output_gate(hidden_states)) * layer.norm(out)
        return layer.out_proj(out), state

    return forward


def _lightning_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("LightningAttention")
            and hasattr(m, "slope_rate") and hasattr(m, "qkv_proj")]


def _mamba_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Mamba (1) mixers whose scan is ``mamba_selective_scan``."""
    return [m for m in model.modules() if hasattr(m, "x_proj") and hasattr(m, "A_log")
            and callable(getattr(sys.modules[type(m).__module__], "mamba_selective_scan", None))]


def _with_initial_state(mixer: torch.nn.Module) -> Any:
    """``mixer``'s forward, handing :func:`selective_scan` the state its cache holds."""
    forward = mixer.forward

    def wrapped(hidden_states: torch.Tensor, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(mixer, "layer_idx")
        _initial_states.append(None if cache is None else cache.get_recurrent_state(layer))
        try:
            return forward(hidden_states, cache, *args, **kwargs)
        finally:
            _initial_states.pop()

    return wrapped


def _patched(model: torch.nn.Module, name: str, replacement: Any) -> list[tuple[Any, str, Any]]:
    """Replaces the function ``name`` of every module defining one of the
    model's layers with ``replacement``; returns what to put back."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    patched = [(module, name, getattr(module, name)) for module in modules
               if callable(getattr(module, name, None))]
    for module, _, _ in patched:
        setattr(module, name, replacement)
    return patched


@contextmanager
def layers_traceable(model: torch.nn.Module, max_prefill: int) -> Iterator[None]:
    """transformers' reference functions for the model's linear-attention and
    state-space layers replaced by ours for the block, so that the traced
    graph serves every row count and length: the cached conv step
    (``causal_conv1d_update``), the chunked gated delta rule
    (``torch_chunk_gated_delta_rule``), the SSD chunk scan
    (``mamba2_chunk_scan``) and Mamba's selective scan
    (``mamba_selective_scan``, its mixers handing it their state); MiniMax's
    lightning attention layers (their forward: :func:`lightning_attention`).
    State-space and linear layers need it from the first forward on (export's
    look at their state's shapes too)."""
    from transformers.cache_utils import Cache

    forwards = [(m, _with_initial_state(m)) for m in _mamba_mixers(model)] + \
        [(m, _lightning_forward(m)) for m in _lightning_layers(model)]
    replacements = {"causal_conv1d_update": causal_conv1d_update,
                    "torch_chunk_gated_delta_rule": functools.partial(chunk_gated_delta_rule, length=max_prefill),
                    "mamba2_chunk_scan": functools.partial(ssd_chunk_scan, length=max_prefill),
                    "mamba_selective_scan": functools.partial(selective_scan, length=max_prefill),
                    "MiniMaxCache": Cache}  # (MiniMax's model refuses any cache but one of this class)
    patched = [entry for name, replacement in replacements.items() for entry in _patched(model, name, replacement)]
    # On the layers themselves (a forward set on a module, a hook's, is kept to put back).
    own = [(layer, layer.__dict__.get("forward")) for layer, _ in forwards]
    for layer, forward in forwards:
        layer.forward = forward
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
        for layer, forward in own:
            if forward is None:
                del layer.forward  # the class's again
            else:
                layer.forward = forward
