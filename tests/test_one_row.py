"""decode_one's kernels (llm/exporting/_gemv.py, _one_row.py): the one-row
matrix-vector kernel against its reference (triton's interpreter on the
CPU, the real op on a GPU), bad input refused by name, and the swap of a
Llama-form model's layers: which layers it takes, the model's logits
unchanged under it (the reference path on the CPU), and its modules given
back after it. The package's tokens against transformers' greedy ones are
tests/test_decode_one.py's."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
import transformers

from aoti_sessions.llm.exporting import _gemv as gv
from aoti_sessions.llm.exporting import _kv_write as kw
from aoti_sessions.llm.exporting import _one_row, _paged
from aoti_sessions.llm.exporting._fused import fused_projections
from aoti_sessions.llm.exporting._quantize import quantized_weights
from aoti_sessions.llm.exporting._one_row import one_row_kernels, plan_one_row
from conftest import requires_cuda, run_in_triton_interpreter
from llm_models import hf_model_dir

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# (N, K, norm, silu_mul, bias, residual, int8 weights): every epilogue and prologue, K not a multiple of the block.
CASES = [(96, 64, False, False, False, False, False), (96, 200, True, False, True, True, False),
         (64, 256, True, True, False, True, False), (10, 130, False, True, True, False, False),
         (33, 48, True, False, False, False, False), (96, 200, True, False, True, True, True),
         (64, 256, True, True, True, False, True), (40, 130, False, False, False, True, True)]


def _inputs(n: int, k: int, norm: bool, silu: bool, bias: bool, residual: bool, dtype: torch.dtype,
            device: str, rows: int = 2, quant: bool = False) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    out = n // 2 if silu else n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, weight, scale = rand(rows, k), rand(n, k) / k ** 0.5, None
    if quant:  # int8 with a scale a row, as torchao's int8 weight-only tensors hold them
        weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(device)
        # (rows of about the float cases' size: uniform int8 has a standard deviation of ~73)
        # (in float32, as torchao keeps it, or already in the dtype: every other width)
        scale = ((torch.rand(n, generator=gen) * 0.5 + 0.75) / (73 * k ** 0.5)).to(
            device=device, dtype=torch.float32 if n % 3 else dtype)
    return {"x": x, "weight": weight, "bias": rand(n) if bias else None,
            "norm_weight": rand(k).abs() + 0.5 if norm else None, "residual": rand(rows, out) if residual else None,
            "weight_scale": scale}


def _check_cases(launch: Callable[..., torch.Tensor], dtype: torch.dtype, device: str, config: tuple[int, int, int, int] | None,
                 bf16_tol: float = 0.15, cases: Sequence[tuple[int, int, bool, bool, bool, bool, bool]] = CASES,
                 rows: int = 2, f32_tol: float = 1e-5) -> None:
    for n, k, norm, silu, bias, residual, quant in cases:
        a = _inputs(n, k, norm, silu, bias, residual, dtype, device, rows=rows, quant=quant)
        ref = gv.decode_linear_reference(a["x"], a["weight"], a["bias"], a["norm_weight"], 1e-6, silu, a["residual"],
                                         a["weight_scale"])
        got = launch(a["x"], a["weight"], a["bias"], a["norm_weight"], 1e-6, silu, a["residual"],
                     a["weight_scale"], **({} if config is None else {"config": config}))
        assert got.shape == ref.shape and got.dtype == ref.dtype
        # bfloat16: a few units in the last place of outputs up to ~8 (the sum's order differs from torch's).
        tol = f32_tol if dtype == torch.float32 else bf16_tol
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= tol, (n, k, norm, silu, bias, residual, quant, dtype, err)


def test_reference_is_the_model_formula() -> None:
    """The reference: RMSNorm as transformers rounds it, then linear, SiLU-mul and the residual add."""
    a = _inputs(64, 48, True, True, True, True, torch.bfloat16, "cpu")
    x, w, b, nw, r = a["x"], a["weight"], a["bias"], a["norm_weight"], a["residual"]
    assert x is not None and w is not None and b is not None and nw is not None and r is not None
    h = x.float()
    normed = nw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    gate, up = torch.nn.functional.linear(normed, w, b).chunk(2, dim=-1)
    expected = r + torch.nn.functional.silu(gate) * up
    assert torch.equal(gv.decode_linear_reference(x, w, b, nw, 1e-6, True, r), expected)


def test_int8_reference_is_torchaos_linear() -> None:
    """With an int8 weight and its scales: the reference equals torchao's
    int8 weight-only linear (the package's quantized layers) bit for bit."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Linear(48, 64, bias=True).to(torch.bfloat16)
    quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
    weight = linear.weight
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = gv.decode_linear_reference(x, weight.qdata, linear.bias, weight_scale=weight.scale.reshape(-1))  # (float32)
    assert weight.qdata.dtype == torch.int8 and torch.equal(got, linear(x))


@pytest.mark.parametrize("bad, message", [
    ({"x": torch.zeros(1, 8)}, "x \\[M, K\\] and weight \\[N, K\\]"),
    ({"weight": torch.zeros(7, 16), "silu_mul": True}, "two halves"),
    ({"bias": torch.zeros(3)}, "bias must be \\[8\\]"),
    ({"norm_weight": torch.zeros(15)}, "norm_weight must be \\[16\\]"),
    ({"residual": torch.zeros(1, 5)}, "residual must be \\[M, 8\\]"),
    ({"weight": torch.zeros(8, 16, dtype=torch.float64)}, "share a dtype"),
    ({"weight": torch.zeros(8, 16, dtype=torch.int8), "weight_scale": torch.zeros(4)}, "weight_scale .* must be \\[8\\]"),
    ({"weight_scale": torch.zeros(8)}, "beside an int8 weight"),
    ({"x": torch.zeros(1, 16, dtype=torch.bfloat16), "weight": torch.zeros(8, 16, dtype=torch.int8),
      "weight_scale": torch.zeros(8, dtype=torch.float16)}, "in torch.bfloat16 or float32 .*got torch.float16"),
])
def test_bad_input_is_refused_by_name(bad: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"x": torch.zeros(1, 16), "weight": torch.zeros(8, 16), **bad}
    with pytest.raises(ValueError, match=message):
        gv.decode_linear(**args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, transformers.PreTrainedModel]]:
    yield {arch: transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(arch)).eval()
           for arch in ("qwen3", "mistral", "lfm2")}


@pytest.mark.parametrize("arch, layers", [("qwen3", 2), ("mistral", 2), ("lfm2", 0)])
def test_the_swap_takes_llama_form_layers_and_keeps_the_logits(models: dict[str, transformers.PreTrainedModel],
                                                               arch: str, layers: int) -> None:
    model = models[arch]
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
        with fused_projections(model):
            plan = plan_one_row(model)
            assert plan.layers == layers == (model.config.num_hidden_layers if layers else 0)
            assert plan.complete == bool(layers)
            with one_row_kernels(plan):
                swapped = model(input_ids=ids, use_cache=False).logits
                if layers:
                    assert "forward" in model.model.layers[0].__dict__
        after = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(swapped, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, before)
    assert not any("forward" in m.__dict__ or "product" in m.__dict__ and m.__dict__["product"] is not None
                   for m in model.modules())


class _Doubled(torch.nn.Module):
    """A norm with an RMSNorm's weight and epsilon that computes twice what it does."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.weight, self.variance_epsilon = norm, norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * 2  # type: ignore[no-any-return]


def test_a_layer_whose_parts_compute_otherwise_is_left_alone(models: dict[str, transformers.PreTrainedModel]) -> None:
    """Each layer is checked on its own parts: a norm computing another
    formula (here: twice RMSNorm), an MLP of another activation (GELU, its
    weights small, where it is close to SiLU's values but not equal), or a
    forward set on the instance (as a hook sets one, which the swap would
    hide) keeps its layer on the model's own code."""
    model = models["qwen3"]
    layers = model.model.layers
    norm = layers[1].post_attention_layernorm
    layers[1].post_attention_layernorm = _Doubled(norm)
    try:
        with fused_projections(model):
            assert plan_one_row(model).layers == 1
    finally:
        layers[1].post_attention_layernorm = norm
    mlp = layers[0].mlp
    act, weight = mlp.act_fn, mlp.gate_proj.weight.data.clone()
    mlp.act_fn = torch.nn.GELU()
    mlp.gate_proj.weight.data *= 0.05
    try:
        with fused_projections(model):
            assert plan_one_row(model).layers == 1
    finally:
        mlp.act_fn = act
        mlp.gate_proj.weight.data.copy_(weight)
    hooked = layers[0].self_attn.o_proj
    hooked.forward = lambda x: type(hooked).forward(hooked, x)
    try:
        with fused_projections(model):
            assert plan_one_row(model).layers == 1
    finally:
        del hooked.forward
    with fused_projections(model):
        assert plan_one_row(model).complete


@pytest.mark.parametrize("arch, tampered, quantized, dtype, kernel", [
    ("llama", False, False, torch.float32, False), ("qwen2", False, False, torch.float32, False),
    ("qwen3", False, False, torch.float32, False), ("mistral", False, False, torch.float32, False),
    ("qwen3", True, False, torch.float32, False), ("qwen3", False, True, torch.float32, False),
    ("qwen2", False, True, torch.float32, False), ("qwen3", False, False, torch.bfloat16, False),
    ("llama", False, True, torch.bfloat16, False), ("qwen3", False, False, torch.float32, True),
    ("mistral", False, False, torch.bfloat16, True)])
def test_decode_one_on_the_pool_equals_decode(arch: str, tampered: bool, quantized: bool, dtype: torch.dtype,
                                              kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PagedLM run eagerly (the reference paths): decode_one's attention,
    whose one write call a layer puts the keys and values into the pool,
    leaves the pool and the logits decode leaves. ``tampered``: layer 0's
    k norm computes otherwise than its q norm (another epsilon), which the
    kernel cannot: that layer's attention runs the module's own code.
    ``quantized``: int8 weight-only (torchao), which the kernels read as
    int8 rows and scales, every projection on them. In bfloat16 the two are
    equal bit for bit: the references round where the model's code rounds.
    ``kernel``: attention as a CUDA step runs it (the paged kernel's reference
    on the pool's own layers, which the write must reach first)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(arch), local_files_only=True)
    model = model.to(dtype).eval()
    if tampered:
        model.model.layers[0].self_attn.k_norm.variance_epsilon = 0.5
    writes: list[int] = []
    original = _one_row.rotary_kv_write
    monkeypatch.setattr(_one_row, "rotary_kv_write", lambda *a: writes.append(a[6]) or original(*a))
    projections: list[bool] = []  # (whether each kernel call took int8 rows)
    linear = _one_row.decode_linear
    monkeypatch.setattr(_one_row, "decode_linear",
                        lambda x, w, *a, **k: projections.append(w.dtype == torch.int8) or linear(x, w, *a, **k))
    if quantized:
        pytest.importorskip("torchao")
    with torch.no_grad(), fused_projections(model), quantized_weights(model, "int8wo" if quantized else None), \
            _paged.paged_attention_on(model):
        module = _paged.PagedLM(model, page_size=4, max_pages=4, kernel=kernel)
        module.one_row = plan_one_row(model)
        assert module.one_row.complete and module.one_row.layers == model.config.num_hidden_layers
        kv = module.pool_example(5, dtype, torch.device("cpu"))
        table = torch.tensor([[3, 1, 4, 0]], dtype=torch.int32)
        module.prefill(torch.tensor([[5, 6, 7, 8, 9, 10]]), kv, table, torch.tensor([0]))
        pool = kv.clone()
        expected = module.decode(torch.tensor([[7]]), kv, table, torch.tensor([6]))
        assert not writes
        got = module.decode_one(torch.tensor([[7]]), pool, table, torch.tensor([6]))
    assert writes == list(range(int(tampered), model.config.num_hidden_layers))  # (each layer's index in the pool)
    # Four projections a layer (q/k/v, o, gate/up, down), int8 where quantized; the head, never quantized.
    assert projections == [quantized] * 4 * model.config.num_hidden_layers + [False]
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected) and torch.equal(pool, kv)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, kv, rtol=1e-5, atol=1e-5)
    assert not torch.equal(pool[1, :, :, 2], torch.zeros_like(pool[1, :, :, 2]))  # (position 6: page 1, offset 2)


def test_decode_one_without_a_plan_is_refused(models: dict[str, transformers.PreTrainedModel]) -> None:
    module = _paged.PagedLM(models["qwen3"], page_size=4, max_pages=4, kernel=False)
    with pytest.raises(RuntimeError, match="plan_one_row"):
        module.decode_one(torch.tensor([[7]]), module.pool_example(5, torch.float32, torch.device("cpu")),
                          torch.tensor([[3, 1, 4, 0]], dtype=torch.int32), torch.tensor([6]))


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_kernel_in_triton_interpreter() -> None:
    """The kernel on CPU tensors under TRITON_INTERPRET=1, blocks small enough
    that rows span several programs and loop iterations."""
    assert "checked" in run_in_triton_interpreter(__file__)


@requires_cuda
@pytest.mark.skipif(not gv.HAS_TRITON_OP, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda(dtype: torch.dtype) -> None:
    """The op's own launch parameters and small ones (many programs and iterations a row)."""
    _check_cases(gv._launch, dtype, "cuda", None)
    _check_cases(gv._launch, dtype, "cuda", (4, 32, 2, 2))
    # Through the op, one row at q/k/v's shape with the norm and at the 4B down projection's (K over 4096: a
    # tile of its own).
    _check_cases(gv.decode_linear, dtype, "cuda", None, cases=((4096, 1024, True, False, False, True, False),
                                                         (2560, 9728, False, False, False, True, False)),
                 rows=1, f32_tol=1e-4)


if __name__ == "__main__":  # the interpreter case, in a process of its own
    for dt in (torch.float32, torch.bfloat16):
        # (bfloat16: the interpreter truncates float32 to bfloat16, towards zero every time, so a normalized
        # row's errors add up across its sum: a few more units in the last place than a GPU's rounding.)
        _check_cases(gv._launch, dt, "cpu", (4, 32, 4, 1), bf16_tol=0.25)
    print("checked")


# A Qwen3 of a 4B layer's kinds of widths, small: several groups of 128 inputs a row and K not a multiple of
# int4's padding (1,024) anywhere, head_dim 128, grouped kv heads.
_WIDE_ONE = dict(hidden_size=1280, intermediate_size=2560, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=128, num_hidden_layers=2)


@requires_cuda
@pytest.mark.skipif(not gv.HAS_TRITON_OP, reason="needs triton")
@pytest.mark.parametrize("scheme", [None, "int8wo", "int4wo"])
def test_decode_one_on_cuda_follows_decode(scheme: str | None) -> None:
    """Eagerly on CUDA, bfloat16: decode_one on the real kernels (the one-row projections, int8 rows or
    int4 tiles where quantized; the fused rotary write; the paged attention) against decode on the model's
    own linears (cuBLAS, torchao's) over a pool prefilled once: each quantized projection's output alone,
    then the step's logits and the keys and values it wrote, within bfloat16's rounding of a sum's order."""
    if scheme is not None:
        pytest.importorskip("torchao")
    config = transformers.AutoConfig.from_pretrained(hf_model_dir("qwen3"))
    for key, value in _WIDE_ONE.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * _WIDE_ONE["num_hidden_layers"]
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    cuda = torch.device("cuda")
    with torch.no_grad(), fused_projections(model), quantized_weights(model, scheme), \
            _paged.paged_attention_on(model):
        # Each projection on its kernel against the module's own forward, at one row.
        for name, module in model.model.layers.named_modules():
            if _one_row._linear(module) is not None or type(module).__name__ == "FusedLinear":
                x = torch.randn(1, module.weight.shape[1], device=cuda, dtype=torch.bfloat16)
                want = torch.nn.functional.linear(x, module.weight, module.bias).float()
                got = _one_row._project(module, x).float()
                err = (got - want).abs().max().item() / want.abs().max().item()
                assert err <= 0.02, (name, scheme, err)
        module = _paged.PagedLM(model, page_size=16, max_pages=4, kernel=True)
        module.one_row = plan_one_row(model)
        assert module.one_row.complete
        kv = module.pool_example(5, torch.bfloat16, cuda)
        table = torch.tensor([[3, 1, 4, 0]], dtype=torch.int32, device=cuda)
        prompt = torch.randint(0, config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(2)).to(cuda)
        module.prefill(prompt, kv, table, torch.tensor([0], device=cuda))
        pool = kv.clone()
        token, at = torch.tensor([[7]], device=cuda), torch.tensor([21], device=cuda)
        expected = module.decode(token, kv, table, at).float()
        got = module.decode_one(token, pool, table, at).float()
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err <= 0.03, (scheme, err)
    # Position 21: page 1 (the table's second), offset 5; every layer's keys and values.
    new, want_kv = pool[1, :, :, 5].float(), kv[1, :, :, 5].float()
    err = (new - want_kv).abs().max().item() / want_kv.abs().max().item()
    assert err <= 0.03, (scheme, err)
    assert torch.equal(pool[3], kv[3])  # (the prompt's first page: written by prefill alone)
