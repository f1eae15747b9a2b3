"""Sibling projections fused at export (llm/exporting/_fused.py): a layer's q/k/v and
its MLP's gate/up each one matrix multiply, with the same results, and the
model given back as it was. test_llm_export's families are exported this
way, each still equal to transformers' greedy tokens."""

from __future__ import annotations

import torch
import transformers

from aoti_sessions.llm.exporting._fused import FusedLinear, fused_projections
from llm_models import hf_model_dir


def _model(arch: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(arch), local_files_only=True)
    return model.eval()  # type: ignore[no-any-return]


def test_fused_siblings_give_the_models_own_logits_with_one_multiply_each() -> None:
    """Qwen3 (no biases) and GPT-OSS (biased q/k/v): the same logits within
    float32 rounding; one multiply a sibling set (counted); the parts' weights
    out of the module tree while fused, and every module put back after."""
    for arch, sets in (("qwen3", 2), ("gpt_oss", 1)):
        model = _model(arch)
        ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
        names = sorted(n for n, _ in model.named_parameters())
        with torch.no_grad():
            want = model(ids).logits
            with fused_projections(model) as fused:
                layers = model.config.num_hidden_layers
                assert fused == sets * layers
                held = [n for n, _ in model.named_parameters()]
                assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in held)
                assert sum(n.endswith("fused_qkv.weight") for n in held) == layers
                calls = []
                originals = FusedLinear.part

                def counted(self: FusedLinear, index: int, x: torch.Tensor) -> torch.Tensor:
                    calls.append(self._input is not x)
                    return originals(self, index, x)

                FusedLinear.part = counted  # type: ignore[method-assign]
                try:
                    got = model(ids).logits
                finally:
                    FusedLinear.part = originals  # type: ignore[method-assign]
                assert sum(calls) == fused  # one multiply a set; the other siblings take their columns
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert sorted(n for n, _ in model.named_parameters()) == names
        assert not any(isinstance(m, FusedLinear) for m in model.modules())


def test_a_sibling_given_another_input_projects_that_input() -> None:
    """A family whose code hands a sibling some other tensor still gets that
    sibling's own projection of it."""
    torch.manual_seed(0)
    parent = torch.nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = (torch.nn.Linear(8, w, bias=True) for w in (8, 4, 4))
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        want = (parent.q_proj(x), parent.k_proj(other), parent.v_proj(x))
        with fused_projections(parent) as fused:
            assert fused == 1
            got = (parent.q_proj(x), parent.k_proj(other), parent.v_proj(x))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_siblings_of_different_shapes_stay_apart() -> None:
    parent = torch.nn.Module()
    parent.gate_proj, parent.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(6, 16, bias=False)
    with fused_projections(parent) as fused:
        assert fused == 0
        assert isinstance(parent.gate_proj, torch.nn.Linear)


def test_an_exported_package_holds_the_fused_weights_alone() -> None:
    """test_llm_export's Qwen3 package (exported with the default fuse=True):
    one q/k/v weight and one gate/up weight a layer, no parts beside them;
    both methods take a lone session's one row (the parts' views do not bound
    the rows, so no call pads a scratch row)."""
    import aoti_sessions as ais
    from aoti_sessions._package import open_model
    from llm_models import llm_package

    methods = open_model(llm_package("qwen3"))
    assert sorted(f.name for f in methods) == ["decode", "prefill"]
    for f in methods:
        assert f.metadata is not None and f.metadata.pool is not None
        assert f.metadata.pool.min_rows == 1, f.name

    with ais.Engine(llm_package("qwen3")) as engine:
        names = [w["fqn"] for w in engine.weights()]
    layers = transformers.AutoConfig.from_pretrained(hf_model_dir("qwen3"), local_files_only=True).num_hidden_layers
    assert sum(n.endswith("fused_qkv.weight") for n in names) == layers
    assert sum(n.endswith("fused_gate_up.weight") for n in names) == layers
    assert not [n for n in names if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                                "up_proj.weight"))]


def test_tied_siblings_share_one_fused_projection() -> None:
    """Two blocks whose q/k/v weights are tied (Zamba2's shared blocks are):
    one fused projection serves both, so the weights stay tied (held once),
    each block's projections are still its own, and both come back tied."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Module(), torch.nn.Module()
    for block in (model.a, model.b):
        block.q_proj, block.k_proj, block.v_proj = (torch.nn.Linear(8, w, bias=False) for w in (8, 4, 4))
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(model.b, name).weight = getattr(model.a, name).weight
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = [getattr(block, name)(x) for block in (model.a, model.b) for name in ("q_proj", "k_proj", "v_proj")]
        with fused_projections(model) as fused:
            assert fused == 2
            assert model.a.fused_qkv is model.b.fused_qkv
            assert [n for n, _ in model.named_parameters()] == ["a.fused_qkv.weight"]
            got = [getattr(block, name)(x) for block in (model.a, model.b) for name in ("q_proj", "k_proj", "v_proj")]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert all(getattr(model.b, n).weight is getattr(model.a, n).weight for n in ("q_proj", "k_proj", "v_proj"))
