"""Weight-only quantization at export (llm/exporting/_quantize.py, torchao): the
package computes what the model quantized the same way computes; its
weights are stored quantized; bad requests are refused before anything is
read. int8wo on the CPU and CUDA, int4wo on CUDA (bfloat16, torch's int4
kernel)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import aoti_sessions as ais
from aoti_sessions.llm import LLM, export
from aoti_sessions.llm.exporting._quantize import quantized_weights
from aoti_sessions.llm._spec import read_llm_package
from conftest import requires_cuda
from llm_models import FAST, SEED, _atomic_dir, _config, _source_key, _train_tokenizer, cached_package
from test_llm_export import _reference

pytest.importorskip("torchao")  # (a test dependency: pyproject's test extra pins it)

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
# The tests' Qwen3, wide enough for int4's groups of 128 inputs (and tinygemm's tiles): every linear layer but
# the head quantized under either scheme.
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            num_hidden_layers=2)


def _wide_dir() -> Path:
    def build(folder: Path) -> None:
        tokenizer = _train_tokenizer()
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
               (("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"), ("pad_token_id", "<|endoftext|>"))}
        config = _config("qwen3", len(tokenizer), ids)
        for key, value in WIDE.items():
            setattr(config, key, value)
        config.layer_types = ["full_attention"] * WIDE["num_hidden_layers"]
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.generation_config = transformers.GenerationConfig(**ids)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return _atomic_dir(_cache_root() / _source_key("qwen3", repr(sorted(WIDE.items()))) / "wide-qwen3", build)


def _cache_root() -> Path:
    from aoti_sessions._package import cache_dir
    return cache_dir() / "hf"


def _package(device: str, dtype: str, scheme: str, decode_one: bool = False) -> Path:
    def build(path: Path) -> None:
        export(_wide_dir(), path, device=device, max_cache_len=128, dtype=dtype, quantize=scheme, inductor_configs=FAST,
               decode_one=decode_one)

    return cached_package(f"wide-qwen3-{device}-{dtype}-{scheme}{'-one' * decode_one}",
                          (device, dtype, scheme, repr(sorted(WIDE.items())), *(["decode_one"] * decode_one)), build)


def _eager(device: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(_wide_dir(), local_files_only=True)
    return model.to(device, dtype).eval()  # type: ignore[no-any-return]


def _quantized_tokens_match(package: Path, device: str, scheme: str, dtype: torch.dtype) -> None:
    """The package's greedy tokens over 16 steps are the eager model's with
    the same quantization (float32 or bfloat16 rounding apart: where the two
    part, the eager quantized model's logits must hold ours within rounding)."""
    with LLM(package, device=device) as llm:
        prompt = llm.encode(PROMPT)
        got = llm.new_session().generate(prompt, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    model = _eager(device, dtype)
    with quantized_weights(model, scheme) as layers:
        assert layers == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down a layer
        want, logits = _reference(model, prompt, 16)
    assert len(got) == 16
    for i, (mine, theirs, last) in enumerate(zip(got, want, logits)):
        if mine != theirs:
            row = last[0]  # (the reference's logits are [1, vocab])
            gap = float(row.max() - row[mine])
            assert gap <= (1e-3 if dtype == torch.float32 else 0.02 * float(row.abs().max())), \
                f"step {i}: {mine} where the quantized model's greedy token is {theirs} (logit gap {gap:.4f})"
            break


def test_int8_weights_package_computes_what_the_quantized_model_computes() -> None:
    package = _package("cpu", "float32", "int8wo")
    assert read_llm_package(package).spec.quantization == "int8wo"
    with ais.Engine(package) as engine:
        weights = {w["fqn"]: w for w in engine.weights()}
    int8 = [name for name, w in weights.items() if w["dtype"] == "int8"]
    # q/k/v and gate/up fused, then quantized: 4 int8 weights a layer (with o and down), the head left as it was.
    assert len(int8) == 4 * WIDE["num_hidden_layers"], sorted(weights)
    assert not any("lm_head" in name for name in int8)
    assert any(name.endswith("lm_head.weight") and w["dtype"] == "float32" for name, w in weights.items())
    info = subprocess.run([sys.executable, "-m", "aoti_sessions", "info", str(package)], capture_output=True,
                          text=True, timeout=300)
    assert "(Qwen3ForCausalLM, float32, weights int8wo)" in info.stdout, info.stdout + info.stderr
    _quantized_tokens_match(package, "cpu", "int8wo", torch.float32)


def test_int8_decode_one_reads_the_weights_every_method_shares() -> None:
    """With decode_one, whose kernels read the int8 rows and their scales
    (llm/exporting/_one_row.py): the package holds the same weights as
    without it (nothing converted or copied for the third method), and its
    lone chat's tokens (decode_one's steps) are the quantized model's."""
    package, plain = _package("cpu", "float32", "int8wo", decode_one=True), _package("cpu", "float32", "int8wo")
    held = []
    for path in (package, plain):
        with ais.Engine(path) as engine:
            held.append({w["fqn"]: (w["dtype"], tuple(w["sizes"])) for w in engine.weights()})
            if path == package:
                assert "decode_one" in engine.methods
    assert held[0] == held[1]
    _quantized_tokens_match(package, "cpu", "int8wo", torch.float32)


def test_quantizing_leaves_the_callers_model_as_it_was(tmp_path: Path) -> None:
    """The caller's weights, and the process's Inductor settings (torchao
    sets its recommended ones globally unless told not to: export passes them
    to its own compile alone)."""
    from torch._inductor import config

    settings = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul")
    inductor = {name: getattr(config, name) for name in settings}
    model = _eager("cpu")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    export(model, tmp_path / "q.pt2", max_cache_len=64, max_prefill=16, max_batch=2, quantize="int8wo",
           inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert type(after[name]) is torch.Tensor and torch.equal(after[name], value), name
    assert {name: getattr(config, name) for name in settings} == inductor


def test_bad_quantization_requests_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantize must be one of int8wo, int4wo"):
        export(_wide_dir(), tmp_path / "q.pt2", quantize="int3")
    with pytest.raises(ValueError, match="int4wo' exports for CUDA in bfloat16.*not for cpu in float32"):
        export(_wide_dir(), tmp_path / "q.pt2", quantize="int4wo", dtype="float32")
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "export", str(_wide_dir()), "-o",
                             str(tmp_path / "q.pt2"), "--quantize", "int4wo", "--dtype", "bfloat16"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "aoti-sessions: error: quantize='int4wo' exports for CUDA in bfloat16" in result.stderr
    assert not (tmp_path / "q.pt2").exists()


@requires_cuda
@pytest.mark.parametrize("decode_one", [False, True])
@pytest.mark.parametrize("scheme", ["int8wo", "int4wo"])
def test_quantized_bfloat16_packages_on_cuda(scheme: str, decode_one: bool) -> None:
    """Decode captured as CUDA graphs; the package's tokens follow the eager
    model quantized the same way, in bfloat16 (with decode_one: the lone
    chat's steps on its one-row method, the int8 weights' conversion and
    scale fused into its reductions)."""
    package = _package("cuda", "bfloat16", scheme, decode_one)
    assert read_llm_package(package).spec.quantization == scheme
    _quantized_tokens_match(package, "cuda", scheme, torch.bfloat16)
