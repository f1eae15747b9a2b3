"""Multi-head latent attention's absorbed decode (aoti_sessions.llm.exporting._latent):
the same function as the layer's own expansion of every cached position
into keys and values, and what a PagedLM decode call of DeepSeek runs
(its prefill keeps the expansion). Greedy equality of whole packages:
test_llm_export's deepseek_v2 and deepseek_v3 families."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from aoti_sessions.llm.exporting import _latent, _paged
from llm_models import hf_model_dir


def _layer(version: int) -> Any:
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=24, num_hidden_layers=1, vocab_size=16, intermediate_size=32)
    if version == 2:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention as Attention
        config: Any = transformers.DeepseekV2Config(**shape, q_lora_rank=None)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as Attention
        config = transformers.DeepseekV3Config(**shape, q_lora_rank=24)
    layer = Attention(config, 0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


@pytest.mark.parametrize("version", [2, 3])
def test_absorbed_attention_is_the_expanded_one(version: int) -> None:
    """Random queries, latents, rotary keys and masks of several rows and
    lengths: the layer's own expansion attended (float64) and the absorbed
    form agree to float32 rounding (its softmax is float32's)."""
    layer = _layer(version)
    generator = torch.Generator().manual_seed(version)
    for rows, length in ((1, 1), (3, 21), (2, 64)):
        latent = torch.randn(rows, 1, length, 32, dtype=torch.float64, generator=generator)
        rotary = torch.randn(rows, 1, length, 8, dtype=torch.float64, generator=generator)
        query = torch.randn(rows, 4, 1, 24, dtype=torch.float64, generator=generator)
        mask = torch.rand(rows, 1, 1, length, generator=generator) > 0.3
        mask[..., 0] = True
        keys, values = layer.expand_kv(latent, rotary)
        scores = (query @ keys.transpose(-1, -2) * layer.scaling).masked_fill(~mask, float("-inf"))
        expected = (torch.softmax(scores, dim=-1) @ values).transpose(1, 2)
        got = _latent.absorbed_attention(layer, query, latent, rotary, mask, layer.scaling)
        assert got.shape == expected.shape == (rows, 1, 4, 24)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_absorbs_and_prefill_expands(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's PagedLM, run eagerly: each decode call takes the
    absorbed form once a layer, and never expands a cached position
    (kv_b_proj unused); prefill expands as the model does."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir("deepseek_v3"), local_files_only=True).eval()
    layers = model.config.num_hidden_layers
    absorbed: list[int] = []
    original = _paged.absorbed_attention
    monkeypatch.setattr(_paged, "absorbed_attention", lambda *a: absorbed.append(1) or original(*a))
    projected: list[int] = []
    for m in model.modules():
        if hasattr(m, "kv_b_proj"):
            m.kv_b_proj.register_forward_hook(lambda *a: projected.append(1))
    with _paged.paged_attention_on(model), torch.no_grad():
        module = _paged.PagedLM(model, page_size=4, max_pages=8, kernel=False)
        kv = module.pool_example(6, torch.float32, torch.device("cpu"))
        table = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]], dtype=torch.int32)
        module.prefill(torch.tensor([[5, 6, 7, 8, 9], [3, 4, 5, -1, -1]]), kv, table, torch.tensor([0, 0]))
        assert (len(absorbed), len(projected)) == (0, layers)
        module.decode(torch.tensor([[7], [2]]), kv, table, torch.tensor([5, 3]))
        assert (len(absorbed), len(projected)) == (layers, layers)
    assert not any(hasattr(m, "_aoti_sessions_unexpanded") or "expand_kv" in m.__dict__ for m in model.modules())
