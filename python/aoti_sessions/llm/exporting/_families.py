"""What export knows of model families by transformers' ``model_type``: the
families the tests run exact against transformers, and those export keeps
the state of itself although transformers marks them uncompilable (any
other family so marked is refused). The adaptations themselves live with
what they adapt: ``_paged.py`` and ``_paged_layout.py`` the caches and
attention, ``_latent.py`` latent attention, ``_linear_attention.py`` the
recurrent layers."""

from __future__ import annotations

__all__ = ["OWN_STATE", "TESTED"]

# Greedy tokens equal to transformers' over two chat turns and a fork (tests/test_llm_export.py, CPU float32).
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "qwen3_moe", "qwen3_next",
          "qwen3_5_moe_text", "lfm2", "gpt_oss", "mamba2", "deepseek_v2", "deepseek_v3", "llama4_text",
          "ernie4_5_moe", "jamba", "falcon_h1", "zamba2", "minimax")

# transformers marks these ``_can_compile_fullgraph = False`` for reasons of its
# own caches, which export replaces with its pool and slots.
OWN_STATE = {
    "falcon_h1": "transformers' static cache once had no hybrid (attention + Mamba2) layer",
    "zamba2": "never marked compilable (its Mamba2 layers and shared attention blocks are)",
    "minimax": "its own cache class, of a Python list of lightning attention states",
}
