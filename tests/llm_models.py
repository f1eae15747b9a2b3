"""Tiny transformers causal LMs for the LLM tests, built offline.

``hf_model_dir(arch)`` writes a random-weight model of a real decoder family
(2 layers, hidden 64) and a byte-level BPE tokenizer trained here on a fixed
text (ChatML special tokens and chat template) with ``save_pretrained``, the
way a downloaded checkpoint looks. ``llm_package(arch)`` exports it with
``aoti_sessions.llm.export``. Both are built once and cached under
``$AOTI_SESSIONS_CACHE`` (tests/conftest.py sets it), written atomically.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("AOTI_SESSIONS_CACHE", str(ROOT / "build" / "test-cache"))

import torch  # noqa: E402
import transformers  # noqa: E402

from aoti_sessions import _compile, _pool, _program  # noqa: E402
from aoti_sessions._package import cache_dir  # noqa: E402
from aoti_sessions.llm import _spec, exporting  # noqa: E402
from aoti_sessions.llm.exporting import _export  # noqa: E402

# The families the tests export; qwen3_moe's experts call transformers'
# grouped_mm_fallback custom op, run through the proxy executor.
# qwen3_next, qwen3_5_moe (gated delta-net linear attention, full attention
# and MoE) and lfm2 (short convolutions) keep recurrent state in slots;
# mamba2 (a pure state-space model: no attention layer) keeps only that.
# gemma3 and gpt_oss (MoE experts, attention sinks) have window layers of 16
# beside global ones, in a context of 128 (8x the window): each session keeps
# a ring of 16 positions for each window layer (llm/exporting/_ring.py).
# Where a family's own layer pattern or head ratios can matter, its test
# model has them, or a layer after a global one (a layer's slot or ring
# index then differs from its own, as in every real checkpoint; a 1:1
# pattern of two layers never has that).
# deepseek_v2 and deepseek_v3 cache one latent and one rotary key a position (multi-head latent
# attention); llama4 attends within chunks of 16 in three layers of four, over a context of 8 chunks
# (rings of 16 positions, as for window layers); ernie4_5_moe routes MoE experts with a correction bias;
# jamba (Mamba 1 layers, MoE), falcon_h1 (Mamba2 beside attention in every layer), zamba2 (Mamba2 layers,
# a shared attention block) and minimax (lightning attention: linear, with a decay a head) keep that
# state in slots.
ARCHS = ("llama", "qwen2", "qwen3", "gemma", "phi3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "lfm2", "gemma3",
         "gpt_oss", "mamba2", "deepseek_v2", "deepseek_v3", "llama4", "ernie4_5_moe", "jamba", "falcon_h1", "zamba2",
         "minimax")
KNOWN = (*ARCHS, "mistral")  # mistral: llama with a sliding window of 16 on every layer (the context is 8x that)
# The families every run tests, one of each kind of layer and state: dense attention (qwen3), MoE experts with
# attention sinks and window layers (gpt_oss), short convolutions (lfm2), a state-space model (mamba2), gated
# delta-net linear attention (qwen3_next), multi-head latent attention (deepseek_v2), windows alone (mistral).
# The others are the exhaustive variants (each a few minutes of compiling and checking on 2 cores):
# AOTI_SESSIONS_ALL_FAMILIES=1 tests them too (the GPU scripts set it).
EVERY_RUN = ("qwen3", "gpt_oss", "lfm2", "mamba2", "qwen3_next", "deepseek_v2", "mistral")
ALL_FAMILIES = os.environ.get("AOTI_SESSIONS_ALL_FAMILIES") == "1"


def tested(families: Sequence[str] = KNOWN) -> list[str]:
    """The families of ``families`` this run tests (EVERY_RUN's, or all of them with ALL_FAMILIES)."""
    return [f for f in families if ALL_FAMILIES or f in EVERY_RUN]


def family_params(cases: Sequence[Any] = ARCHS) -> list[Any]:
    """Parameters over families (a family, or a tuple whose first item is one), those not in EVERY_RUN marked
    ``all_families`` (conftest.py deselects them unless ALL_FAMILIES)."""
    import pytest

    def family(case: Any) -> str:
        return str(case[0] if isinstance(case, tuple) else case)

    return [case if family(case) in EVERY_RUN else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                                                   marks=pytest.mark.all_families)
            for case in cases]
SEED = 0
# Faster compiles for test-only models: the wrapper's C++ at -O0 (kernels are unaffected).
FAST = {"aot_inductor.compile_wrapper_opt_level": "O0"}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The tokenizer's training text: plain English, enough for a few hundred merges.
TEXT = """\
The quick brown fox jumps over the lazy dog. A session keeps its own cache, and the
weights are shared by every session of the engine. When the user asks a question, the
assistant answers it with a short and helpful reply. Hello, how are you today? I am fine,
thank you, and you? The weather is nice, the sun is shining and the birds are singing in
the trees. We compile the model once and serve many conversations from one process.
Each token is read, the model looks back at what it has seen, and writes the next one.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten appear often.
Please tell me a story about a small robot who learned to paint pictures of the sea.
Once upon a time there was a little robot named Bolt who lived by the harbour. Every
morning Bolt watched the boats and the waves, and every evening Bolt painted them.
"""


def _train_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT] * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None, chat_template=CHAT_TEMPLATE,
        additional_special_tokens=["<|im_start|>"])


def _config(arch: str, vocab: int, special: dict[str, int]) -> transformers.PretrainedConfig:
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        # Well separated logits: greedy choices of a random model must not hinge
        # on rounding (the default 0.02 makes them near ties).
        initializer_range=0.3, **special)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64, tie_word_embeddings=True)
    if arch in ("qwen3_next", "qwen3_5_moe"):  # untied embeddings, as both configs' default
        # Qwen3.5-MoE in its config's own pattern (three delta-net layers to a full one) with a key head to a
        # value head; Qwen3-Next with its config's two value heads to a key head, and a delta-net layer after
        # the full one.
        config = transformers.Qwen3NextConfig if arch == "qwen3_next" else transformers.Qwen3_5MoeTextConfig
        shape = dict(num_hidden_layers=4, linear_num_value_heads=2) if arch == "qwen3_5_moe" else \
            dict(layer_types=["linear_attention", "full_attention", "linear_attention"], num_hidden_layers=3,
                 linear_num_value_heads=4)
        return config(**{**common, **shape}, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_num_key_heads=2,
                      linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
    if arch == "mamba2":  # 8 SSM heads of 16 (2 x 64 inner), chunks of 16 (prefill spans several)
        return transformers.Mamba2Config(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
            n_groups=1, expand=2, conv_kernel=4, chunk_size=16, initializer_range=0.3, tie_word_embeddings=True,
            **special)
    if arch == "lfm2":
        return transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"])
    if arch == "gemma":
        return transformers.GemmaConfig(**common, head_dim=16)
    if arch == "mistral":
        return transformers.MistralConfig(**common, head_dim=16, sliding_window=16)
    if arch == "gpt_oss":  # MoE experts, attention sinks, window layers of 16 beside global ones
        return transformers.GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    if arch == "gemma3":  # Gemma 3's own pattern: five window layers to a global one (7 layers: one after it)
        return transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 7}, head_dim=16, sliding_window=16)
    if arch == "phi3":
        return transformers.Phi3Config(**common)
    # Multi-head latent attention (a latent of 32 and a rotary key of 8 cached, not per-head keys and
    # values), a dense layer before MoE ones with a shared expert; V2's group-limited greedy routing, V3's
    # grouped top-k over sigmoid scores with the correction bias, interleaved rotary, query low rank.
    mla: dict[str, Any] = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                               n_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1,
                               num_key_value_heads=4)
    if arch == "deepseek_v2":
        return transformers.DeepseekV2Config(**{**common, **mla}, q_lora_rank=None, n_routed_experts=4,
                                             num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2,
                                             topk_group=1)
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**common, **mla, "num_hidden_layers": 3}, q_lora_rank=24,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                             rope_interleave=True, tie_word_embeddings=False)
    if arch == "llama4":  # chunks of 16 in three layers of four (the fourth global, without rotary)
        return transformers.Llama4TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=16,
                                             attention_chunk_size=16, intermediate_size_mlp=128, num_local_experts=4,
                                             num_experts_per_tok=1, interleave_moe_layer_step=2,
                                             no_rope_layer_interval=4, floor_scale=8)
    if arch == "ernie4_5_moe":
        return transformers.Ernie4_5_MoeConfig(**common, moe_intermediate_size=64, moe_k=2, moe_num_experts=4,
                                               moe_num_shared_experts=1, moe_layer_start_index=1,
                                               moe_layer_end_index=1)
    if arch == "jamba":  # Mamba (1) layers, an attention layer, MoE every other layer
        return transformers.JambaConfig(
            **{**common, "num_hidden_layers": 4}, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=8)
    if arch == "falcon_h1":  # attention and Mamba2 side by side in every layer
        return transformers.FalconH1Config(
            **common, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)
    if arch == "zamba2":
        # Mamba2 layers, a shared attention block joining two of them. transformers' Zamba2 clamps a step's
        # dt to time_step_min where it reads a prompt but not where it decodes, so its reply to a history it
        # decoded part of differs from its reply to the same history read whole (which the second turn's
        # reference is); a minimum no dt of this model reaches keeps its two ways one.
        return transformers.Zamba2Config(
            **{**common, "num_hidden_layers": 4, "num_key_value_heads": 4},
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_ngroups=1, n_mamba_heads=8, chunk_size=16, num_mem_blocks=1,
            use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, time_step_min=1e-9,
            time_step_floor=1e-4)
    if arch == "minimax":  # lightning (linear) attention layers beside softmax ones, blocks of 16
        return transformers.MiniMaxConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, num_local_experts=4,
                                          num_experts_per_tok=2, block_size=16,
                                          layer_types=["linear_attention", "full_attention", "linear_attention"])
    raise ValueError(f"unknown arch {arch!r}; known: {', '.join(KNOWN)}")


def _atomic_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """``build(folder)`` into a staging folder beside ``target``, then renamed into place."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():  # not a concurrent build of the same folder
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _source_key(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in (torch.__version__, transformers.__version__, inspect.getsource(sys.modules[__name__]), *parts):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def hf_model_dir(arch: str) -> Path:
    """A saved random-weight ``arch`` causal LM and its tokenizer (``save_pretrained``)."""
    def build(folder: Path) -> None:
        tokenizer = _train_tokenizer()
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
               (("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"),
                ("pad_token_id", "<|endoftext|>"))}
        config = _config(arch, len(tokenizer), ids)
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.generation_config = transformers.GenerationConfig(**ids)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    # The folder's name is the model's name in its package.
    return _atomic_dir(cache_dir() / "hf" / _source_key(arch) / f"tiny-{arch}", build)


def exporter_sources() -> list[str]:
    """What a package compiled by export is made of, as source text: every
    module of aoti_sessions.llm.exporting (its kernels' included), the spec
    and the compiler's: a change to any of them compiles cached packages
    again (the tests' and bench_serve's)."""
    folder = Path(exporting.__file__).parent
    return [path.read_text() for path in sorted(folder.glob("*.py"))] + \
        [inspect.getsource(module) for module in (_spec, _compile, _pool, _program)]


def cached_package(name: str, key: Sequence[str], build: Callable[[Path], object]) -> Path:
    """The package ``build(path)`` writes, built once: cached under the models
    folder by ``key``, this file, the exporter's and the compiler's sources."""
    target = cache_dir() / "models" / f"{name}-{_source_key(*exporter_sources(), *key)}.pt2"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The package's top folder is named after its file: build it under the final name.
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        tmp = Path(staging) / target.name
        build(tmp)
        os.replace(tmp, target)
    return target


def llm_package(arch: str, device: str = "cpu", max_cache_len: int = 128, window_cache: str = "ring",
                dtype: str = "float32", quantize: str | None = None, decode_one: bool = False) -> Path:
    """``hf_model_dir(arch)`` exported with ``aoti_sessions.llm.export``, once."""
    def build(path: Path) -> None:
        _export.export(hf_model_dir(arch), path, device=device, max_cache_len=max_cache_len, inductor_configs=FAST,
                       window_cache=window_cache, dtype=dtype, quantize=quantize, decode_one=decode_one)

    suffix = ("" if window_cache == "ring" else f"-{window_cache}") + ("" if dtype == "float32" else f"-{dtype}") \
        + ("" if quantize is None else f"-{quantize}") + ("-one" if decode_one else "")
    return cached_package(f"llm-{arch}-{device}{suffix}",
                          (arch, device, str(max_cache_len), window_cache, dtype, *([quantize] if quantize else []),
                           *(["decode_one"] if decode_one else [])), build)
