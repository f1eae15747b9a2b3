"""decode_one's kernels (issue 38): a decode step of one row with each
layer's projections on ``_gemv.decode_linear``, the pointwise work around
them inside the same kernels:

- the input norm and the fused q/k/v projection: one kernel;
- the q/k norms (Qwen3's), the rotary embedding and the write of the new
  keys and values into the pool: one kernel (``_kv_write.py``), where the
  layer keeps its keys and values in the pool's pages (its cache says so);
- the output projection: one kernel (cuBLAS splits it in two at these shapes);
- the post-attention norm, the fused gate/up projection and SiLU-mul: one kernel;
- the down projection: one kernel.

Applied, for the export of ``decode_one`` alone, to decoder layers of the
Llama form (Llama, Mistral, Qwen2, Qwen3: each norm's output feeds only the
attention's projections or the MLP), where the export fused their siblings
(``_fused.py``) and the pieces behave as the kernel computes them: each
norm equals transformers' Llama-style RMSNorm and the MLP equals
``down(silu(gate(x)) * up(x))`` on a probe input, and the weights are plain
tensors or torchao's int8 or int4 weight-only ones (int8 rows, a scale a
row: the kernel reads the int8 bytes; int4 in tinygemm's tiles:
``_gemv_int4.py`` reads the tiles). Every other layer runs as it does in
``decode``.

The swap sets ``forward`` on the module instances (and the fused
projection's product) for the block, never the modules themselves: the
weights keep their names, shared with the other methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import inspect
import sys
from dataclasses import dataclass

import torch

from ._fused import FusedLinear
from ._gemv import decode_linear, rms_norm_reference
from ._gemv_int4 import GROUP, decode_linear_int4
from ._int8_mm import int8_rows
from ._kv_write import rotate_reference, rotary_kv_write

__all__ = ["OneRowPlan", "plan_one_row", "one_row_kernels", "LAYERS"]

# Decoder layers whose norms feed only their attention's projections and their MLP (transformers' code).
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
# Their attention modules, whose forward :func:`_attention`'s mirrors (transformers' code), by where each
# reads its sliding window from (the module, the config, none).
_WINDOWS: dict[str, Callable[[Any], Any]] = {
    "LlamaAttention": lambda attn: None, "MistralAttention": lambda attn: getattr(attn.config, "sliding_window", None),
    "Qwen2Attention": lambda attn: attn.sliding_window, "Qwen3Attention": lambda attn: attn.sliding_window}


def _probe(like: torch.Tensor) -> torch.Tensor:
    """A fixed input of ``like``'s width, dtype and device, to check a part's behaviour on."""
    x = torch.randn(2, like.shape[0], generator=torch.Generator().manual_seed(0))
    return x.to(device=like.device, dtype=like.dtype)


def _plain(*weights: torch.Tensor | None) -> bool:
    """Plain floating-point tensors (not a quantized tensor subclass)."""
    return all(w is None or (type(w.data) is torch.Tensor and w.dtype.is_floating_point) for w in weights)


def _int4_tiles(weight: Any) -> bool:
    """torchao's int4 weight-only tensor in tinygemm's tiles (``_quantize.py``'s int4wo), groups of 128, no
    activation scaling, no padded rows: what ``_gemv_int4`` reads."""
    qdata, scale_zero = getattr(weight, "qdata", None), getattr(weight, "scale_and_zero", None)
    return type(weight).__name__ == "Int4TilePackedTo4dTensor" and isinstance(qdata, torch.Tensor) \
        and isinstance(scale_zero, torch.Tensor) and qdata.dtype == torch.int32 and qdata.dim() == 4 \
        and tuple(qdata.shape[2:]) == (32, 4) and weight.dim() == 2 and qdata.shape[0] * 8 == weight.shape[0] \
        and tuple(scale_zero.shape) == (qdata.shape[1], weight.shape[0], 2) and scale_zero.dtype == weight.dtype \
        and list(getattr(weight, "block_size", ())) == [1, GROUP] and getattr(weight, "act_pre_scale", None) is None


def _usable(module: Any) -> bool:
    """A projection whose weight the kernels read: plain floats, int8 rows or int4 tiles; its bias plain."""
    weight = getattr(module, "weight", None)
    return (_plain(weight) or int8_rows(weight) or _int4_tiles(weight)) and _plain(getattr(module, "bias", None))


def _project(module: torch.nn.Module, x: torch.Tensor, **options: Any) -> torch.Tensor:
    """``module``'s projection of ``x`` [M, K] on :func:`decode_linear` with
    ``options``; the weight read now (under export: the traced parameters),
    an int8 one as its rows and their scales (float32, as torchao keeps them:
    the kernel rounds them to the weight's dtype, as torchao's linear does),
    an int4 one on :func:`decode_linear_int4`."""
    weight: Any = module.weight
    bias = module.bias
    assert bias is None or isinstance(bias, torch.Tensor)
    if _int4_tiles(weight):
        return decode_linear_int4(x, weight.qdata, weight.scale_and_zero, bias, **options)
    scale = weight.scale.reshape(-1) if int8_rows(weight) else None  # (float32: the kernel rounds it)
    return decode_linear(x, weight.qdata if scale is not None else weight, bias, weight_scale=scale, **options)


def _eps(norm: torch.nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, float) else None


def _is_rms_norm(norm: object, probe: torch.Tensor) -> float | None:
    """The norm's epsilon where ``norm`` computes what :func:`rms_norm_reference`
    does on ``probe``, bit for bit; None otherwise."""
    if not isinstance(norm, torch.nn.Module):
        return None
    weight, eps = getattr(norm, "weight", None), _eps(norm)
    if not isinstance(weight, torch.Tensor) or eps is None or weight.shape != probe.shape[-1:] or not _plain(weight):
        return None
    return eps if torch.equal(norm(probe), rms_norm_reference(probe, weight, eps)) else None


def _as_rows(x: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``kernel`` over ``x``'s rows ([..., K] as [rows, K]), shaped back."""
    out = kernel(x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear(layer: object) -> torch.nn.Linear | None:
    """A plain ``nn.Linear`` (or one whose weight a quantized package parametrizes) the kernel can read."""
    plain = type(layer) is torch.nn.Linear or type(layer).__bases__ == (torch.nn.Linear,) \
        and type(layer).__name__ == "ParametrizedLinear"
    return layer if isinstance(layer, torch.nn.Linear) and plain and _usable(layer) else None


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight``, read when the kernel is called (under export: the traced parameter)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _layer(layer: torch.nn.Module, probe: torch.Tensor) -> list[tuple[Any, str, Any]] | None:
    """The layer's swaps (object, attribute, value), or None where they do
    not apply: its forward (the residual adds move into the kernels), its
    norms (to identity: the kernels apply them), its fused projections'
    product, its output projection's and its MLP's forward."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    qkv, gate_up = getattr(attn, "fused_qkv", None), getattr(mlp, "fused_gate_up", None)
    o_proj, down = _linear(getattr(attn, "o_proj", None)), _linear(getattr(mlp, "down_proj", None))
    norms = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    if not isinstance(qkv, FusedLinear) or not isinstance(gate_up, FusedLinear) or o_proj is None or down is None \
            or not _usable(qkv) or not _usable(gate_up) or not isinstance(attn, torch.nn.Module) \
            or not isinstance(mlp, torch.nn.Module) or _returns(layer) is not True \
            or any("forward" in vars(m) for m in (layer, attn, mlp, o_proj, *norms) if isinstance(m, torch.nn.Module)):
        return None  # (a forward set on an instance, a hook's say, is one the swap would hide)
    in_norm, post_norm = norms
    in_eps, post_eps = _is_rms_norm(in_norm, probe), _is_rms_norm(post_norm, probe)
    if in_eps is None or post_eps is None:
        return None
    assert isinstance(in_norm, torch.nn.Module) and isinstance(post_norm, torch.nn.Module)
    # The MLP must be down(silu(gate(x)) * up(x)): its own forward against that formula on the probe, the
    # projections through their own linear (torchao's for its weights).
    gate, up = torch.nn.functional.linear(probe, _weight(gate_up), gate_up.bias).chunk(2, dim=-1)
    if not torch.equal(mlp(probe), down(torch.nn.functional.silu(gate) * up)):  # (the same ops, the same bits)
        return None
    residual: list[torch.Tensor] = []  # the layer's input, for the output projection's epilogue

    def layer_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # transformers' forward, residual + attention, then residual + MLP, with the adds in the kernels.
        if args:  # (transformers passes the rest by name; by place they would mean other things to attn)
            raise TypeError(f"decode_one's {type(layer).__name__} takes its arguments after hidden_states by name")
        residual.append(hidden_states)
        try:
            attended = attn(hidden_states, **kwargs)[0]  # (the norm inside the q/k/v kernel)
        finally:
            residual.pop()
        out: torch.Tensor = mlp(attended)  # (the norm inside gate/up's kernel, the residual inside down's)
        return out

    def mlp_forward(x: torch.Tensor) -> torch.Tensor:
        act = _as_rows(x, lambda r: _project(gate_up, r, norm_weight=_weight(post_norm), eps=post_eps,
                                             silu_mul=True))
        return _as_rows(act, lambda r: _project(down, r, residual=x.reshape(r.shape[0], -1)))

    return [(layer, "forward", layer_forward), (in_norm, "forward", lambda x: x), (post_norm, "forward", lambda x: x),
            *(_attention(attn, qkv, o_proj, in_norm, in_eps) or []),
            (qkv, "product", lambda x: _as_rows(x, lambda r: _project(qkv, r, norm_weight=_weight(in_norm),
                                                                      eps=in_eps))),
            (o_proj, "forward", lambda x: _as_rows(x, lambda r: _project(
                o_proj, r, residual=residual[-1].reshape(r.shape[0], -1)))),
            (mlp, "forward", mlp_forward)]


def _attention(attn: torch.nn.Module, qkv: FusedLinear, o_proj: torch.nn.Linear, in_norm: torch.nn.Module,
               in_eps: float) -> list[tuple[Any, str, Any]] | None:
    """The attention's forward on one kernel from the q/k/v projection's
    output to the pool (q/k norms, rotary, the cache write), or None where
    the module is not one whose forward this mirrors, its q/k norms or
    rotary function compute otherwise on a probe, or its heads do not
    match the fused projection's widths."""
    window = _WINDOWS.get(type(attn).__name__) if _known(attn, _WINDOWS) and "forward" not in attn.__dict__ else None
    config: Any = getattr(attn, "config", None)
    head_dim = getattr(attn, "head_dim", None)
    q_heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if window is None or not isinstance(head_dim, int) or not isinstance(q_heads, int) or not isinstance(kv_heads, int) \
            or qkv.widths != [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]:
        return None
    like = _weight(in_norm)
    probe = _probe(torch.empty(head_dim, dtype=like.dtype, device=like.device))  # [2, head_dim]
    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    eps = [_is_rms_norm(norm, probe) for norm in norms]
    if norms != (None, None) and (None in eps or eps[0] != eps[1]):
        return None
    # The rotary function the module's code calls, against the kernel's on the probe.
    rotary = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    cos, sin = probe[:1].cos(), probe[1:].sin()
    if not callable(rotary) or not all(torch.equal(got[0, :, 0], rotate_reference(probe[None], cos, sin)[0])
                                       for got in rotary(probe[None, :, None], probe[None, :, None], cos[None],
                                                         sin[None])):
        return None
    original = type(attn).forward.__get__(attn)

    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        write_in_pool = getattr(cache, "write_in_pool", None)
        shape = hidden_states.shape[:-1]
        cos, sin = (t.reshape(-1, head_dim) for t in position_embeddings)

        def write(kv: torch.Tensor, layer: int, page: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
            projected = _project(qkv, hidden_states.reshape(-1, hidden_states.shape[-1]),
                                 norm_weight=_weight(in_norm), eps=in_eps)
            # (The norms' weights read here: under export, the traced parameters.)
            q_norm, k_norm = (_weight(n) if isinstance(n, torch.nn.Module) else None for n in norms)
            return rotary_kv_write(projected, cos, sin, kv, page, offset, layer, q_heads, kv_heads, q_norm, k_norm,
                                   1e-6 if eps[0] is None else eps[0])

        written = write_in_pool(attn.layer_idx, write) if callable(write_in_pool) and not args else None
        if written is None:  # (a layer kept in a ring, say: the module's own code)
            own: tuple[torch.Tensor, Any] = original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
            return own
        queries, key, value = written
        attend = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
        for name in ("cache", "past_key_values"):
            kwargs.pop(name, None)
        out, weights = attend(attn, queries.reshape(*shape, q_heads, head_dim).transpose(1, 2), key, value,
                              attention_mask, dropout=0.0, scaling=attn.scaling, sliding_window=window(attn), **kwargs)
        result: tuple[torch.Tensor, Any] = (o_proj(out.reshape(*shape, -1).contiguous()), weights)
        return result

    return [(attn, "forward", forward)]


def _returns(layer: torch.nn.Module) -> bool:
    """Whether the layer's forward returns the hidden states alone (transformers 5; earlier releases return a tuple)."""
    annotation = inspect.signature(type(layer).forward).return_annotation
    return annotation is torch.Tensor or annotation == "torch.Tensor"


def _head(model: torch.nn.Module, probe: torch.Tensor) -> list[tuple[Any, str, Any]] | None:
    """The final norm into the output head's kernel, for the causal LMs of
    the layers above (the norm's output feeds only the head)."""
    if type(model).__name__.removesuffix("ForCausalLM") + "DecoderLayer" not in LAYERS:
        return None
    norm, head = getattr(getattr(model, "model", None), "norm", None), _linear(getattr(model, "lm_head", None))
    eps = _is_rms_norm(norm, probe)
    if head is None or eps is None or not isinstance(norm, torch.nn.Module):
        return None
    return [(norm, "forward", lambda x: x),
            (head, "forward", lambda x: _as_rows(x, lambda r: _project(head, r, norm_weight=_weight(norm), eps=eps)))]


@dataclass
class OneRowPlan:
    """What :func:`plan_one_row` found: the swaps :func:`one_row_kernels`
    makes (object, attribute, value), and how many of the model's decoder
    layers they cover."""

    swaps: list[tuple[Any, str, Any]]
    layers: int  # decoder layers on the kernels
    of: int  # decoder layers in the model (modules named *DecoderLayer)

    @property
    def complete(self) -> bool:
        """Every decoder layer on the kernels."""
        return 0 < self.layers == self.of


def plan_one_row(model: torch.nn.Module) -> OneRowPlan:
    """Checks, eagerly (before the trace: the checks run the parts), which
    layers of ``model`` the kernels apply to, for :func:`one_row_kernels`.
    Run with the siblings fused (``_fused.py``). The plan holds the model's
    fused projections: keep it no longer than the export that uses it."""
    swaps: list[tuple[Any, str, Any]] = []
    layers = decoder_layers = 0
    with torch.no_grad():
        for layer in model.modules():
            decoder_layers += type(layer).__name__.endswith("DecoderLayer")
            weight = getattr(getattr(layer, "input_layernorm", None), "weight", None)
            if not _known(layer, LAYERS) or not isinstance(weight, torch.Tensor):
                continue
            found = _layer(layer, _probe(weight))
            if found is not None:
                layers += 1
                swaps += found + ((_head(model, _probe(weight)) or []) if layers == 1 else [])
    return OneRowPlan(swaps, layers, decoder_layers)


def _known(module: object, names: tuple[str, ...] | dict[str, Any]) -> bool:
    """One of transformers' own classes of these names (not a remote-code class that shares a name)."""
    return type(module).__name__ in names and type(module).__module__.startswith("transformers.models.")


@contextmanager
def one_row_kernels(plan: OneRowPlan) -> Iterator[None]:
    """``plan``'s swaps for the block (see the module's doc)."""
    set_on: list[tuple[Any, str, bool, Any]] = []  # (object, attribute, had its own, its own value)
    try:
        for obj, name, value in plan.swaps:
            own = name in obj.__dict__
            set_on.append((obj, name, own, obj.__dict__.get(name)))
            obj.__dict__[name] = value
        yield
    finally:
        for obj, name, own, value in reversed(set_on):
            if own:
                obj.__dict__[name] = value
            else:
                del obj.__dict__[name]
