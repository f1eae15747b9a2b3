"""export(decode_one=True) (llm/exporting/_export_methods.py): a third method,
decode compiled for one row alone, which the step loop calls when one chat
decodes and never for a batch. A lone chat's tokens stay transformers'
greedy tokens; chats stepping together, and one going on alone after the
others ended, each get what they get alone; a model that keeps state in
slots, or a flag that is not a bool, is refused before anything compiles."""

from __future__ import annotations

import random
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import transformers
from aoti_sessions._package import open_model
from aoti_sessions.errors import ExportError
from aoti_sessions.llm import LLM, export
from aoti_sessions.llm.exporting._export_methods import STEP_VALUES_ONCE
from conftest import requires_cuda
from llm_models import hf_model_dir, llm_package
from test_llm_export import PROMPTS, _bfloat16_chat, _chat, _eager, _reference, _tokenizer


def _counted(llm: LLM) -> list[tuple[str, int]]:
    """The (method, rows) of every batch the LLM's engine runs from now on."""
    calls: list[tuple[str, int]] = []
    engine = llm.engine
    run = engine.run_batch

    def counting(method: str, sessions: list[Any], *args: Any, **kwargs: Any) -> Any:
        calls.append((method, len(sessions)))
        return run(method, sessions, *args, **kwargs)

    engine.run_batch = counting  # type: ignore[method-assign]
    return calls


def test_the_package_holds_a_one_row_decode_beside_the_batched_one() -> None:
    methods = {f.name: f for f in open_model(llm_package("qwen3", decode_one=True))}
    assert sorted(methods) == ["decode", "decode_one", "prefill"]
    one, batched = methods["decode_one"].metadata, methods["decode"].metadata
    assert one is not None and one.pool is not None and batched is not None and batched.pool is not None
    assert (one.pool.min_rows, one.pool.max_rows) == (1, 1)
    assert batched.pool.max_rows > 1


def test_chats_alone_and_together_get_transformers_greedy_tokens() -> None:
    """CPU, float32. Each prompt alone: every decode step is decode_one's,
    and the tokens are transformers' greedy ones. Then the prompts together,
    each turn a random length (seeded), started together: steps of two rows
    run the batched decode, the longer turn's lone tail runs decode_one, and
    each chat's tokens are its solo run's."""
    package = llm_package("qwen3", decode_one=True)
    model, tokenizer = _eager("qwen3"), _tokenizer("qwen3")
    prompts = [_chat(tokenizer, text) for text in PROMPTS]
    rng = random.Random(20261202)
    with LLM(package) as llm:
        calls = _counted(llm)
        solo = []
        for prompt in prompts:
            calls.clear()
            got = llm.new_session().generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).token_ids
            assert got == _reference(model, prompt, 24)[0]
            decodes = [c for c in calls if c[0].startswith("decode")]
            assert decodes and set(decodes) == {("decode_one", 1)}, decodes
            solo.append(got)
        for _ in range(3):
            lengths = [rng.randint(4, 24) for _ in prompts]
            calls.clear()
            # Both started before either is read: the step loop has both from its first step.
            sessions = [llm.new_session() for _ in prompts]
            generations = [s.start(p, max_tokens=n, temperature=0, ignore_eos=True)
                           for s, p, n in zip(sessions, prompts, lengths)]
            for g in generations:
                while g.step() is not None:
                    pass
            for i, g in enumerate(generations):
                assert g.token_ids == solo[i][:lengths[i]], (lengths, i)
            decodes = [c for c in calls if c[0].startswith("decode")]
            assert all(rows == 1 for method, rows in decodes if method == "decode_one"), decodes
            assert all(method == "decode" for method, rows in decodes if rows > 1), decodes
            assert ("decode", 2) in decodes, decodes  # (the turns' steps were shared)
            if lengths[0] != lengths[1]:  # the longer turn's tail, alone
                assert ("decode_one", 1) in decodes, (lengths, decodes)
            for s in sessions:
                s.close()


def test_an_llm_told_not_to_runs_a_lone_chat_on_the_batched_decode() -> None:
    """LLM(..., decode_one=False) on a package with decode_one: a lone chat's
    steps run decode at one row, its tokens still transformers' greedy ones
    (bench_decode measures both paths on one package this way); a flag that
    is not a bool is refused before the package is read."""
    package = llm_package("qwen3", decode_one=True)
    model, tokenizer = _eager("qwen3"), _tokenizer("qwen3")
    prompt = _chat(tokenizer, PROMPTS[0])
    with LLM(package, decode_one=False) as llm:
        assert "decode_one" in llm.engine.methods
        calls = _counted(llm)
        got = llm.new_session().generate(prompt, max_tokens=12, temperature=0, ignore_eos=True).token_ids
        assert got == _reference(model, prompt, 12)[0]
        decodes = [c for c in calls if c[0].startswith("decode")]
        assert decodes and set(decodes) == {("decode", 1)}, decodes
    with pytest.raises(ValueError, match="decode_one must be True or False, got 'no'"):
        LLM(package, decode_one="no")  # type: ignore[arg-type]


def test_decode_one_is_refused_where_it_cannot_serve(tmp_path: Path) -> None:
    target = tmp_path / "m.pt2"
    with pytest.raises(ValueError, match="decode_one must be True or False"):
        export(hf_model_dir("qwen3"), target, decode_one="yes")  # type: ignore[arg-type]
    # Mamba2 keeps recurrent state in slots: its decode is compiled for batches alone.
    with pytest.raises(ExportError, match=r"decode_one=True: .* slots"):
        export(hf_model_dir("mamba2"), target, max_cache_len=64, decode_one=True)
    assert not target.exists() and not list(tmp_path.iterdir())


@requires_cuda
def test_bfloat16_chat_on_cuda_with_decode_one() -> None:
    """bfloat16 on CUDA, as test_llm_export's families (two turns and a
    fork, following transformers' greedy tokens as _follows holds them),
    with the lone chat's steps on decode_one's tuned one-row kernels (its
    matrix-vector products reductions of their own, summed in another order
    than cuBLAS's), captured as CUDA graphs."""
    _bfloat16_chat("qwen3", "cuda", decode_one=True)


@requires_cuda
@pytest.mark.parametrize("scheme", [None, "int8wo", "int4wo"])
def test_a_decode_one_step_on_cuda_computes_what_its_layers_share_once(scheme: str | None) -> None:
    """The CUDA package's decode_one as AOTInductor wrote it (its host code, the kernels a step in order):
    each layer runs its four projections (int8 rows on the same kernel, int4 tiles on their own), its rotary
    write and its attention, and nothing of Inductor's own runs once a layer (no kernel called twice a step:
    the rotary angles, the new position's page and the rows' lengths are computed once and read by every
    layer; an int8 weight's float32 scales are read as they are, not converted a projection at a time)."""
    if scheme is None:
        package = llm_package("qwen3", "cuda", dtype="bfloat16", decode_one=True)
        layers = transformers.AutoConfig.from_pretrained(hf_model_dir("qwen3")).num_hidden_layers
    else:
        pytest.importorskip("torchao")
        from test_quantize import WIDE, _package
        package, layers = _package("cuda", "bfloat16", scheme, True), WIDE["num_hidden_layers"]
    with zipfile.ZipFile(package) as z:
        [name] = [n for n in z.namelist() if "/decode_one/" in n and n.endswith(".wrapper.cpp")]
        source = z.read(name).decode()
    calls = re.findall(r"^\s*call_(\w+?)(?:_\d+)?\(", source[source.index("::run_impl("):], re.M)
    projections = {"_int4_kernel": 4 * layers, "_linear_kernel": 1} if scheme == "int4wo" else \
        {"_linear_kernel": 4 * layers + 1}  # (the head: never quantized)
    ours = Counter(c for c in calls if not c.startswith("triton_"))
    assert ours == {**projections, "_rotary_kv_kernel": layers, "_split_kernel": layers}, calls
    inductors = Counter(c for c in calls if c.startswith("triton_"))
    assert inductors and max(inductors.values()) == 1 and len(inductors) <= 6, calls


def test_the_callers_inductor_settings_go_over_each_methods_own(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """A quantized package's settings are decode's own (decode_one's layers
    on the one-row kernels need them not); what the caller passes to export goes over them (the
    methods as export hands them to compile, which is stopped there)."""
    from aoti_sessions.llm.exporting import _export

    pytest.importorskip("torchao")
    handed: dict[str, Any] = {}
    every: dict[str, Any] = {}

    def stop(module: Any, methods: dict[str, Any], **kwargs: Any) -> None:
        handed.update(methods)
        every.update(kwargs["inductor_configs"])
        raise KeyboardInterrupt  # (not an Exception: export passes it on as it is)

    monkeypatch.setattr(_export, "compile", stop)
    with pytest.raises(KeyboardInterrupt):
        export(hf_model_dir("qwen3"), tmp_path / "m.pt2", quantize="int8wo", decode_one=True,
               inductor_configs={"coordinate_descent_tuning": False, "max_autotune": False})
    assert sorted(handed) == ["decode", "decode_one", "prefill"]
    own = {name: dict(m.inductor_configs or {}) for name, m in handed.items()}
    assert every == {"coordinate_descent_tuning": False, "max_autotune": False}  # (every method's)
    assert own["prefill"] == {}
    assert own["decode"]["coordinate_descent_tuning"] is False and own["decode"]["max_autotune"] is False, own
    assert own["decode"]["force_fuse_int_mm_with_mul"] is True, own  # (the quantized settings' other parts)
    # decode_one's layers run on the one-row kernels, int8 rows and all (_one_row.py): neither the tuning
    # nor torchao's settings; the step's values computed once (STEP_VALUES_ONCE), then the caller's.
    assert own["decode_one"] == {**STEP_VALUES_ONCE, "coordinate_descent_tuning": False, "max_autotune": False}, own
