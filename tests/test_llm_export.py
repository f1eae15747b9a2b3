"""aoti_sessions.llm.export: LLM packages of real transformers decoder families
(tiny random-weight models, tests/llm_models.py) against the eager model's own
greedy ``generate``; the package's tokenizer, spec and generation config; the
command line."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import aoti_sessions as ais
import aoti_sessions.__main__
from aoti_sessions.__main__ import main
from aoti_sessions._package import cache_dir
from aoti_sessions.llm import LLM, export
from aoti_sessions.llm.exporting import _export_cli
from aoti_sessions.llm.exporting._export import DEFAULT_MAX_BATCH
from aoti_sessions.llm._spec import LLM_DIR, SPEC_FILE, read_llm_package
from conftest import requires_cuda
from llm_models import FAST, cached_package, family_params, hf_model_dir, llm_package

STEPS = 32  # greedy tokens compared per prompt
# How far our logits may be from transformers' (float32 rounding, on logits
# up to about 10): 1e-4, but for the delta-net layers and MoE experts of
# Qwen3-Next and Qwen3.5-MoE in their own layer patterns, where transformers'
# own float32 logits part from a float64 run of the same weights by up to
# 2e-4 (ours by 3e-5: measured over both prompts, 32 steps, chunks of 5 and 64),
# and for Zamba2's Mamba2 layers, where both part from float64 by up to 2e-3
# (transformers' 6.6e-4 and 1.9e-3, ours 1.1e-3 and 1.6e-3, on the two prompts).
ROUNDING = {"qwen3_next": 2e-3, "qwen3_5_moe": 2e-3, "zamba2": 2e-3}
PROMPTS = ["Tell me a story about the sea.", "How are you today?"]


@pytest.fixture(scope="module", params=family_params())
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(arch: str, device: str) -> Iterator[ais.Engine]:
    with ais.Engine(llm_package(arch, device), device=device) as eng:
        yield eng


def _eager(arch: str, device: str = "cpu") -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(arch), local_files_only=True)
    return model.to(device).eval()


def _tokenizer(arch: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(hf_model_dir(arch), local_files_only=True)


def _chat(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]
    return ids


def _recurrent(arch: str, device: str = "cpu") -> bool:
    """Whether the arch's package keeps recurrent state (hybrid models)."""
    return read_llm_package(llm_package(arch, device)).spec.recurrent


def _reference(model: Any, prompt: list[int], steps: int = STEPS) -> tuple[list[int], list[torch.Tensor]]:
    """The eager model's greedy tokens (argmax every step, end-of-sequence
    tokens included: generate's min_new_tokens would mask them) and the
    logits each was chosen from."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        # transformers 5.2x names the cache argument and output ``cache`` in
        # some families (Mamba2), ``past_key_values`` in others.
        parameters = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in parameters else "past_key_values"

        # Each call's positions given, as generate gives them (MiniMax counts the positions its cache holds
        # at its first layer, which holds none where that layer is a linear attention one).
        def positions(start: int, count: int) -> dict[str, torch.Tensor]:
            at = torch.arange(start, start + count, device=model.device)[None]
            return {"position_ids": at} if "position_ids" in parameters else {}

        out = model(ids, use_cache=True, **positions(0, len(prompt)))
        for _ in range(steps):
            last = out.logits[:, -1].float()
            logits.append(last)
            tokens.append(int(last.argmax(-1)))
            cache = out.get("past_key_values")
            cache = out.get("cache") if cache is None else cache
            assert cache is not None, f"{type(model).__name__} returned no cache"
            out = model(torch.tensor([[tokens[-1]]], device=model.device), **{name: cache}, use_cache=True,
                        **positions(len(prompt) + len(tokens) - 1, 1))
    return tokens, logits


def _feed(session: ais.Session, ids: list[int], chunk: int, device: str) -> torch.Tensor:
    """``ids`` into the cache after what it holds, ``chunk`` tokens per prefill
    call (a lone last token goes through decode); the last position's logits."""
    logits = torch.empty(0)
    pos = 0
    while pos < len(ids):
        piece = torch.tensor([ids[pos:pos + chunk]], device=device)
        logits = session.run("decode" if piece.shape[1] == 1 else "prefill", piece)
        pos += piece.shape[1]
    return logits


def _feed_rows(engine: ais.Engine, sessions: list[ais.Session], prompts: list[list[int]],
               device: str) -> list[torch.Tensor]:
    """Every prompt in one prefill call, its rows right-padded with -1 to the
    longest, each session then truncated to its prompt; each row's logits."""
    width = max(map(len, prompts))
    assert width > min(map(len, prompts)), "prompts of one length: no row is padded"
    ids = torch.tensor([p + [-1] * (width - len(p)) for p in prompts], device=device)
    out = engine.run_batch("prefill", sessions, ids)
    assert [s.length for s in sessions] == [width] * len(sessions)  # the padding's positions too, until truncated
    for s, p in zip(sessions, prompts):
        s.truncate(len(p))
    return list(out)


class _Greedy:
    """Greedy decoding of several sessions of a package at once: each step
    is one batched decode over every session still going. ``chunk``: prompt
    tokens per prefill call of one session, or "rows": every prompt in one
    call (_feed_rows)."""

    def __init__(self, engine: ais.Engine, sessions: list[ais.Session], prompts: list[list[int]], chunk: int | str,
                 device: str = "cpu", steps: int = STEPS) -> None:
        self.engine, self.sessions, self.device, self.steps = engine, sessions, device, steps
        if chunk == "rows":
            self.logits = [[row] for row in _feed_rows(engine, sessions, prompts, device)]
        else:
            self.logits = [[_feed(s, p, int(chunk), device)[0]] for s, p in zip(sessions, prompts)]
        self.tokens: list[list[int]] = [[] for _ in sessions]

    def step(self) -> bool:
        """Picks every row's next token and, unless done, feeds it in one
        batched decode; whether there are more steps."""
        for row, logits in zip(self.tokens, self.logits):
            row.append(int(logits[-1].argmax(-1)))
        if len(self.tokens[0]) == self.steps:
            return False
        ids = torch.tensor([[row[-1]] for row in self.tokens], device=self.device)
        out = self.engine.run_batch("decode", self.sessions, ids)
        for logits, row in zip(self.logits, out):
            logits.append(row)
        return True

    def run(self) -> None:
        while self.step():
            pass


@pytest.mark.parametrize("chunk", [64, 5, "rows"])
def test_greedy_tokens_match_eager_generate(arch: str, device: str, engine: ais.Engine, chunk: int | str) -> None:
    """Two prompts, each whole in one prefill, in chunks of 5 (the last
    token alone through decode), or both in one prefill call (the shorter
    row padded), then batched decode steps over both sessions: each row's
    greedy tokens are transformers' generate's for that prompt alone, over
    32 steps, from logits within float rounding (ROUNDING)."""
    model, tokenizer = _eager(arch, device), _tokenizer(arch)
    prompts = [_chat(tokenizer, text) for text in PROMPTS]
    if chunk == "rows" and _recurrent(arch, device):
        # A padded row's recurrent state took in its padding: the rewind after it is refused.
        with engine.new_session() as a, engine.new_session() as b, \
                pytest.raises(ValueError, match="recurrent.* cannot rewind"):
            _feed_rows(engine, [a, b], prompts, device)
        return
    references = [_reference(model, p) for p in prompts]
    sessions = [engine.new_session() for _ in prompts]
    greedy = _Greedy(engine, sessions, prompts, chunk, device)
    greedy.run()
    for s in sessions:
        s.close()
    for tokens, logits, (expected, theirs) in zip(greedy.tokens, greedy.logits, references):
        assert tokens == expected
        for mine, ref in zip(logits, theirs):
            assert mine.shape == (len(tokenizer),)
            torch.testing.assert_close(mine, ref[0], atol=ROUNDING.get(arch, 1e-4), rtol=1e-4)


@pytest.mark.parametrize("family, window_cache", family_params([("mistral", "ring"), ("gemma3", "ring"),
                                                                ("gpt_oss", "ring"), ("mistral", "full")]))
def test_a_sliding_window_model_serves_its_whole_context(device: str, family: str, window_cache: str) -> None:
    """Mistral (every layer windowed), Gemma 3 and GPT-OSS (window layers
    beside global ones; GPT-OSS's with attention sinks and MoE experts) with
    a window of 16 in a context of 128: the package keeps
    max_position_embeddings' bound (not the window's), and a reply running
    far past the window equals transformers' greedy tokens (its window
    layers attend to their last 16 positions only). Window layers keep a
    ring of 16 positions a session (a slot the same at any length), or with
    window_cache="full" every position in pages."""
    package = llm_package(family, device, window_cache=window_cache)
    model = _eager(family, device)
    window = model.config.sliding_window
    with LLM(package, device=device) as llm:
        assert llm.max_context == 128 >= 6 * window
        ring = [t for t in llm.engine.pool["tensors"] if t["name"] == "ring"]
        if window_cache == "ring":
            types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(model.model.layers)
            windowed = types.count("sliding_attention")  # (Mistral's config names none: all are windowed)
            assert [t["unit_sizes"][:3] for t in ring] == [[windowed, 2, window]]
            assert llm.spec.window_ring == window and llm.spec.recurrent
        else:
            assert ring == [] and llm.spec.window_ring == 0 and not llm.spec.recurrent
        prompt = llm.encode("Once upon a time the river and the old mill by the bridge " * 2)
        assert len(prompt) > window
        steps = 96 - len(prompt)
        got = llm.new_session().generate(prompt, max_tokens=steps, temperature=0, ignore_eos=True).token_ids
        assert got == _reference(model, prompt, steps)[0]
        assert len(prompt) + steps > 5 * window


def test_a_two_turn_chat_with_a_fork_matches_transformers(arch: str, device: str) -> None:
    """Through LLM: a chat's second turn reuses the first's cache, a fork
    goes on from it, and every reply equals transformers' greedy tokens for
    the same history."""
    model = _eager(arch, device)
    with LLM(llm_package(arch, device), device=device) as llm:
        s = llm.new_session()
        first = llm.encode("The quick brown fox")
        one = s.generate(first, max_tokens=STEPS, temperature=0, ignore_eos=True)
        assert one.token_ids == _reference(model, first)[0]
        second = first + one.token_ids + llm.encode(" and the old mill")
        fork = s.fork()
        two = s.generate(second, max_tokens=STEPS, temperature=0, ignore_eos=True)
        assert two.cached_tokens == len(first) + len(one.token_ids) - 1
        assert two.token_ids == _reference(model, second)[0]
        # Every family's decode steps run as CUDA graphs (MoE experts too:
        # batched, without the grouped-mm fallback's trip to the host).
        assert llm.engine.captures("decode") == (device == "cuda")
        if not llm.spec.recurrent:
            branch = second[:len(first) + 4] + llm.encode(" by the bridge")
            other = fork.generate(branch, max_tokens=STEPS, temperature=0, ignore_eos=True)
            assert other.cached_tokens == len(first) + 4
            assert other.token_ids == _reference(model, branch)[0]
            return
        # Recurrent state rewinds only to a checkpoint: the fork goes on from
        # where it was taken (its own copy of the state); a second turn
        # changed after its start rewinds to the state kept there; a history
        # edited before it is fed again from its start.
        branch = second[:two.cached_tokens] + llm.encode(" by the bridge")
        other = fork.generate(branch, max_tokens=STEPS, temperature=0, ignore_eos=True)
        assert other.cached_tokens == two.cached_tokens
        assert other.token_ids == _reference(model, branch)[0]
        assert s._session.checkpoints == (two.cached_tokens, len(second))  # its start, its prompt's end
        regenerated = second[:two.cached_tokens + 2] + llm.encode(" by the sea")
        three = s.generate(regenerated, max_tokens=STEPS, temperature=0, ignore_eos=True)
        assert three.cached_tokens == two.cached_tokens and llm.stats()["checkpoint_rewinds"] == 1
        assert three.token_ids == _reference(model, regenerated)[0]
        edited = first + llm.encode(" and the new mill")
        again = s.generate(edited, max_tokens=STEPS, temperature=0, ignore_eos=True)
        assert again.cached_tokens == 0 and s.token_count == len(edited) + STEPS - 1
        assert again.token_ids == _reference(model, edited)[0]


def test_a_batch_of_one_session_runs(arch: str, device: str, engine: ais.Engine) -> None:
    """Both methods take one row as they take several (the compiled model
    must not assume two or more: Phi-3 slices its fused qkv projection, whose
    view Inductor would otherwise compile for two rows at least)."""
    prompt = _chat(_tokenizer(arch), PROMPTS[0])
    with engine.new_session() as one, engine.new_session() as a, engine.new_session() as b:
        alone = engine.run_batch("prefill", [one], torch.tensor([prompt], device=device))
        pair = engine.run_batch("prefill", [a, b], torch.tensor([prompt, prompt], device=device))
        torch.testing.assert_close(alone[0], pair[1], atol=1e-4, rtol=1e-4)
        token = torch.tensor([[int(alone[0].argmax())]], device=device)
        alone = engine.run_batch("decode", [one], token)
        pair = engine.run_batch("decode", [a, b], token.repeat(2, 1))
        torch.testing.assert_close(alone[0], pair[0], atol=1e-4, rtol=1e-4)


def test_interleaved_sessions_stay_isolated() -> None:
    """Two sessions stepped in turn, one at a time, each with its own prompt,
    each get the tokens of their prompt alone: the KV cache is per session
    (one family shows it)."""
    model, tokenizer = _eager("qwen3"), _tokenizer("qwen3")
    prompts = [_chat(tokenizer, text) for text in PROMPTS]
    expected = [_reference(model, p, 12)[0] for p in prompts]
    assert expected[0] != expected[1]
    with ais.Engine(llm_package("qwen3")) as engine, engine.new_session() as a, engine.new_session() as b:
        runs = [_Greedy(engine, [s], [p], 64, steps=12) for s, p in zip((a, b), prompts)]
        for _ in range(12):
            for g in runs:  # one step of each in turn
                g.step()
    assert [g.tokens[0][:12] for g in runs] == expected


def test_kv_cache_is_pooled_state(engine: ais.Engine, arch: str) -> None:
    """The KV cache of every layer is one pooled page tensor the engine owns
    (docs/batching.md); no buffer is per-session state."""
    config = transformers.AutoConfig.from_pretrained(hf_model_dir(arch), local_files_only=True)
    pool = engine.pool
    assert pool is not None and engine.mutable_fqns == ()
    # Hybrid models: pages for the attention layers, a slot a session for the
    # others' state; window and chunked layers: a slot a session holding
    # their window's ring. Latent attention (DeepSeek): one latent and one
    # rotary key a position, for every head.
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    attention = sum(t in ("full_attention", "hybrid") for t in types)  # (hybrid: attention beside Mamba2)
    windowed = sum(t in ("sliding_attention", "chunked_attention") for t in types)
    stateful = sum(t in ("linear_attention", "hybrid", "conv") for t in types)
    latent = getattr(config, "kv_lora_rank", None)
    if latent:
        kv_shape = (1, latent + config.qk_rope_head_dim)
    elif attention or windowed:
        kv_shape = (config.num_key_value_heads,
                    getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    heads = kv_shape if attention else (1, 1)  # (Mamba2: empty pages)
    tensors = [(t["name"], t["kind"], t["unit_sizes"]) for t in pool["tensors"]]
    assert tensors[0] == ("kv", "pages", [attention, 1 if latent else 2, pool["page_size"], *heads])
    assert (pool["page_bytes"] > 0) == (attention > 0)  # a model with no attention layer: pages of nothing
    slots = [(name, sizes[0]) for name, kind, sizes in tensors[1:] if kind == "slots"]
    assert len(slots) == len(tensors) - 1
    if windowed:
        window = getattr(config, "sliding_window", None) or config.attention_chunk_size
        assert tensors[1:] == [("ring", "slots", [windowed, 2, window, *kv_shape])]
    elif not stateful:
        assert slots == []
    else:
        # LFM2's layers are convolutions, MiniMax's lightning attention keeps one state; delta-net and Mamba
        # layers keep both.
        names = {"lfm2": ["conv"], "minimax": ["recurrent"]}.get(arch, ["conv", "recurrent"])
        assert slots == [(name, stateful) for name in names]
    assert pool["max_positions"] >= 128 and pool["max_rows"] == 64
    assert sorted(engine.methods) == ["decode", "prefill"]


@requires_cuda
def test_cuda_prefill_attention_is_not_cudnn() -> None:
    """cuDNN's attention plans every new input shape anew, per thread (tens of
    ms on an H100): prefill, whose length changes every turn, is compiled to
    another backend. Read from the generated code of the package's methods."""
    with zipfile.ZipFile(llm_package("qwen3", "cuda")) as z:
        code = {n.split("/")[-2]: z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")}
    assert sorted(code) == ["decode", "prefill"]
    assert "scaled_dot_product" in code["prefill"], "attention not found in prefill's generated code"
    assert "cudnn_attention" not in code["prefill"]


def test_bfloat16_moe_experts_where_grouped_mm_does_not_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where AOTInductor cannot compile torch's grouped mm (torch 2.11's CUDA
    shim; here the check says so on the CPU), bfloat16 MoE experts export
    through transformers' fallback op in prefill and batched matmuls in
    decode, and the package's greedy tokens equal transformers' in
    bfloat16 (whose experts run torch's grouped mm)."""
    from aoti_sessions.llm.exporting import _export

    monkeypatch.setattr(_export, "_grouped_mm_compiles", lambda device: False)
    package = cached_package("llm-qwen3_moe-cpu-bf16-fallback", ("qwen3_moe", "cpu", "bfloat16", "fallback"),
                             lambda path: export(hf_model_dir("qwen3_moe"), path, dtype="bfloat16", max_cache_len=128,
                                                 inductor_configs=FAST))
    with zipfile.ZipFile(package) as z:  # the ops each method calls through the proxy executor
        externs = {n.split("/")[-2]: z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.json")}
    assert "grouped_mm_fallback" in externs["prefill"] and "grouped_mm" not in externs.get("decode", "")
    model = _eager("qwen3_moe").to(torch.bfloat16)
    with LLM(package) as llm:
        prompt = llm.encode("The quick brown fox")
        got = llm.new_session().generate(prompt, max_tokens=12, temperature=0, ignore_eos=True).token_ids
        assert got == _reference(model, prompt, 12)[0]


@requires_cuda
def test_bfloat16_moe_experts_compile_and_decode_as_graphs() -> None:
    """bfloat16 MoE experts on CUDA (transformers calls torch's grouped mm
    for them, which torch 2.11's AOTInductor cannot compile; there export
    takes transformers' fallback op in prefill and batched matmuls in decode):
    a two-turn chat's greedy tokens equal transformers' in bfloat16, its
    second turn reusing the first's cache, decode captured."""
    package = cached_package("llm-qwen3_moe-cuda-bf16", ("qwen3_moe", "cuda", "bfloat16"), lambda path: export(
        hf_model_dir("qwen3_moe"), path, device="cuda", dtype="bfloat16", max_cache_len=128, inductor_configs=FAST))
    model = _eager("qwen3_moe", "cuda").to(torch.bfloat16)
    with LLM(package, device="cuda") as llm:
        assert llm.spec.dtype == "bfloat16"
        s = llm.new_session()
        first = llm.encode("The quick brown fox")
        one = s.generate(first, max_tokens=12, temperature=0, ignore_eos=True)
        assert one.token_ids == _reference(model, first, 12)[0]
        second = first + one.token_ids + llm.encode(" and the old mill")
        two = s.generate(second, max_tokens=12, temperature=0, ignore_eos=True)
        assert two.cached_tokens == len(first) + 11
        assert two.token_ids == _reference(model, second, 12)[0]
        assert llm.engine.captures("decode")


def _follows(got: list[int], model: Any, exact: Any, prompt: list[int], turn: str = "") -> int:
    """How many of ``got``'s tokens are ``model``'s (transformers in
    bfloat16) greedy choices, stopping at the first that is not. There the
    histories part, and ``exact`` (the same model in float32, on the same
    tokens) judges: ours must be its choice, or within what bfloat16 can
    tell apart on this model: 2% of the logits' largest magnitude, or
    transformers' own bfloat16 error (its bfloat16 logits against its float32
    ones) at that position or at any position of its own greedy turn,
    whichever is largest. A different kernel order rounds differently, and
    where a model's logits jump (an MoE router's choice flipping between
    experts, a lightning attention layer's state) bfloat16's error at one
    position says little of the next: MiniMax's rewrite, run eagerly in
    bfloat16 on the CPU, is off float32 by 9.8 at one step of a turn where it
    is within 1.4 elsewhere and transformers' own bfloat16 is off by up to
    7.5 (bench/results/families_cuda.md). Ours is held to float32, not to
    transformers' rounding."""
    tokens, logits = _reference(model, prompt, len(got))
    for i, (mine, theirs, row) in enumerate(zip(got, tokens, logits)):
        if mine != theirs:
            with torch.no_grad():
                def truth_after(history: list[int]) -> torch.Tensor:
                    return exact(torch.tensor([prompt + history], device=exact.device)).logits[0, -1].float()

                truth = truth_after(got[:i])
                noise = float((row[0] - truth).abs().max())
                turn_noise = max(float((r[0] - truth_after(tokens[:j])).abs().max()) for j, r in enumerate(logits))
            gap = float(truth.max() - truth[mine])
            allowed = max(0.02 * float(truth.abs().max()), noise, turn_noise)
            assert gap <= allowed, (f"{turn} token {i}: {mine} where transformers' greedy token is {theirs} in "
                                    f"bfloat16, {int(truth.argmax())} in float32 (float32 logit gap {gap:.4f}, "
                                    f"allowed {allowed:.4f}: transformers' own bfloat16 error there {noise:.4f}, "
                                    f"over its turn up to {turn_noise:.4f})")
            return i
    return len(got)


@requires_cuda
@pytest.mark.parametrize("family", family_params())
def test_bfloat16_two_turn_chat_on_cuda(family: str) -> None:
    """Every family in bfloat16 on CUDA, decode captured as CUDA graphs: a
    two-turn chat (the second turn reusing the first's cache) and a fork's
    turn follow transformers' greedy tokens in bfloat16 (24 a turn; where
    they part, ours is float32's choice or within bfloat16's reach of it,
    _follows)."""
    _bfloat16_chat(family, "cuda")


def _bfloat16_chat(family: str, device: str, decode_one: bool = False) -> None:
    package = llm_package(family, device, dtype="bfloat16", decode_one=decode_one)
    exact = _eager(family, device)
    model = _eager(family, device).to(torch.bfloat16)
    with LLM(package, device=device) as llm:
        assert llm.spec.dtype == "bfloat16"
        methods: list[str] = []  # the methods the step loop ran
        run = llm.engine.run_batch

        def counted(method: str, *args: Any, **kwargs: Any) -> Any:
            methods.append(method)
            return run(method, *args, **kwargs)

        llm.engine.run_batch = counted  # type: ignore[method-assign]
        s = llm.new_session()
        first = llm.encode("The quick brown fox")
        one = s.generate(first, max_tokens=24, temperature=0, ignore_eos=True)
        followed = [_follows(one.token_ids, model, exact, first, "turn 1")]
        fork = s.fork()
        second = first + one.token_ids + llm.encode(" and the old mill")
        two = s.generate(second, max_tokens=24, temperature=0, ignore_eos=True)
        assert two.cached_tokens == len(first) + 23
        followed.append(_follows(two.token_ids, model, exact, second, "turn 2"))
        branch = first + one.token_ids[:23] + llm.encode(" by the bridge")
        other = fork.generate(branch, max_tokens=24, temperature=0, ignore_eos=True)
        assert other.cached_tokens == len(first) + 23
        followed.append(_follows(other.token_ids, model, exact, branch, "the fork's turn"))
        assert llm.engine.captures("decode_one" if decode_one else "decode") == (device == "cuda")
        assert ("decode_one" in methods) == decode_one, sorted(set(methods))  # (a lone chat's steps)
    print(f"{family}: tokens equal to transformers' bf16 ones before the two part, per turn: {followed}")


@requires_cuda
def test_cuda_decode_graph_is_captured_on_a_thread_other_than_the_warm_ups() -> None:
    """Warm-up runs on one thread, the next runs on another (as a server's
    requests do): torch makes cuDNN and cuBLAS state per thread, which a
    capture cannot contain, so the new thread runs eagerly once before it
    captures. The graph is captured and replayed, not given up for eager runs."""
    with ais.Engine(llm_package("qwen3", "cuda"), device="cuda") as engine, engine.new_session() as session:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        outputs: list[torch.Tensor] = []
        session.run("prefill", torch.tensor([[1, 2, 3, 4, 5]], device="cuda"))

        def decode() -> None:
            with torch.cuda.stream(stream):
                for _ in range(3):
                    session.truncate(5)  # every run feeds position 5 again
                    outputs.append(session.run("decode", torch.tensor([[3]], device="cuda")))
            stream.synchronize()
        for _ in range(2):
            worker = threading.Thread(target=decode)
            worker.start()
            worker.join()
        stats = engine.stats()
        assert (stats["graph_captures"], stats["graphs"], stats["graph_replays"]) == (1, 1, 2)
        assert len(outputs) == 6
        for out in outputs[1:]:
            torch.testing.assert_close(out, outputs[0], rtol=0, atol=0)


def test_package_carries_tokenizer_spec_and_generation_config(arch: str) -> None:
    package = read_llm_package(llm_package(arch))
    original = _tokenizer(arch)
    tokenizer = package.load_tokenizer()
    text = "Hello, how are you? The robot painted the sea."
    assert tokenizer.encode(text) == original.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    im_end, endoftext = (original.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    spec = package.spec
    model_class = type(_eager(arch)).__name__
    model_type = transformers.AutoConfig.from_pretrained(hf_model_dir(arch), local_files_only=True).model_type
    assert (spec.model_type, spec.architecture, spec.name) == (model_type, model_class, f"tiny-{arch}")
    assert (spec.max_cache_len, spec.max_prefill, spec.vocab_size, spec.dtype) == (128, 128, len(original), "float32")
    assert (spec.eos_token_ids, spec.bos_token_id, spec.pad_token_id) == ([im_end], endoftext, endoftext)
    # Sessions one prefill call feeds: one where recurrent state would take in a padded row's padding.
    # (Window layers' rings rewind as recurrent state does.)
    windowed = arch in ("gemma3", "gpt_oss", "llama4")  # (Llama 4's chunks: a ring of one chunk)
    assert spec.recurrent == (arch in ("qwen3_next", "qwen3_5_moe", "lfm2", "mamba2", "jamba", "falcon_h1", "zamba2",
                                       "minimax") or windowed)
    assert spec.window_ring == (16 if windowed else 0)
    assert spec.prefill_rows == (1 if spec.recurrent else DEFAULT_MAX_BATCH)
    assert package.generation_config["eos_token_id"] == im_end
    assert package.tokenizer_dir.is_dir() and package.tokenizer_dir.is_relative_to(cache_dir())


def test_info_shows_what_an_llm_package_says(arch: str) -> None:
    """`aoti-sessions info` adds the LLM's own figures to the methods."""
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "info", str(llm_package(arch))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    spec = read_llm_package(llm_package(arch)).spec
    lines = result.stdout.splitlines()
    assert f"LLM: tiny-{arch} ({spec.architecture}, float32)" in lines
    assert (f"  context: 128 positions a session; prefill: up to {spec.max_prefill} tokens of up to "
            f"{spec.prefill_rows} sessions a call; vocabulary: {spec.vocab_size}") in lines
    assert f"  end of sequence: {', '.join(map(str, spec.eos_token_ids))}; bos: {spec.bos_token_id}; " \
           f"pad: {spec.pad_token_id}" in lines
    assert "  chat template: yes" in lines  # every tested family's tokenizer has one
    rewinds = "rewinds only to a checkpoint kept at a turn's start or its prompt's end: a history changed before " \
              "it is fed again"
    if spec.window_ring:
        state = f"  state: window layers' ring of 16 positions ({rewinds}), and the global layers' KV cache if it has any"
    elif spec.recurrent:
        state = f"  state: recurrent state (conv, SSM or delta-net; {rewinds}), and its attention layers' KV cache if " \
                "it has any"
    else:
        state = "  state: KV cache"
    assert state in lines


def _hub_cache(root: Path, repo_id: str, folder: Path) -> None:
    """``folder``'s files in a hub cache at ``root``, laid out as the hub lays
    it out: blobs by hash, a snapshot of links to them, refs/main."""
    import hashlib

    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_hub_ids_resolve_from_the_hub_cache_offline(tmp_path: Path) -> None:
    """A hub id (no such folder) is read from the hub's cache, offline, as
    transformers' from_pretrained would find it; an id in neither the cache
    nor (offline) the hub is one clear error."""
    _hub_cache(tmp_path, "tiny/qwen3", hf_model_dir("qwen3"))
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    probe = ("from aoti_sessions.llm.exporting._export_source import hub_folder, check_folder; "
             "f = hub_folder('tiny/qwen3'); print(f); print(check_folder(f).model_type)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    folder, model_type = result.stdout.split()
    assert Path(folder).is_relative_to(tmp_path / "hub" / "models--tiny--qwen3" / "snapshots")
    assert model_type == "qwen3"
    assert sorted(p.name for p in Path(folder).iterdir()) == sorted(p.name for p in hf_model_dir("qwen3").iterdir())
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "export", "nobody/none", "-o",
                             str(tmp_path / "x.pt2")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    assert "nobody/none: no such folder, and no such model in the hub's cache or on the hub" in result.stderr
    assert not (tmp_path / "x.pt2").exists()


def _with_spec(package: Path, target: Path, edit: Any) -> Path:
    """A copy of ``package`` whose llm.json went through ``edit``."""
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(f"{LLM_DIR}/{SPEC_FILE}"):
                data = json.dumps(edit(json.loads(data))).encode()
            dst.writestr(info, data)
    return target


def test_reading_a_package_that_is_not_an_llm_package_fails_clearly(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    with pytest.raises(ais.PackageError, match="not an LLM package"):
        read_llm_package(counter_cpu_pkg)
    with pytest.raises(ais.PackageError, match="does not exist"):
        read_llm_package(tmp_path / "missing.pt2")
    qwen3 = llm_package("qwen3")
    for edit, message in [
        (lambda d: {**d, "max_cache_len": "128"}, r"field 'max_cache_len' must be an integer"),
        (lambda d: {k: v for k, v in d.items() if k != "vocab_size"}, r"field 'vocab_size' is missing"),
        (lambda d: {**d, "eos_token_ids": [2, -1]}, r"field 'eos_token_ids\[1\]' must be an integer >= 0"),
        (lambda d: {**d, "max_prefill": 129}, r"max_prefill.*exceeds max_cache_len"),
        (lambda d: {**d, "version": 2}, r"unknown version"),
        (lambda d: {**d, "prefill_rows": 0}, r"field 'prefill_rows' must be an integer >= 1"),
    ]:
        with pytest.raises(ais.PackageError, match=message):
            read_llm_package(_with_spec(qwen3, tmp_path / "edited.pt2", edit))
    # A package made before batched prefill says nothing: one session a call.
    old = _with_spec(qwen3, tmp_path / "old.pt2", lambda d: {k: v for k, v in d.items() if k != "prefill_rows"})
    assert read_llm_package(old).spec.prefill_rows == 1
    # Read well, but past the compiled model's own shapes: refused at load,
    # or ids and positions past them would reach its kernels.
    vocab = read_llm_package(qwen3).spec.vocab_size
    for edit, message in [
        (lambda d: {**d, "vocab_size": 10**9}, rf"says vocab_size 1000000000, but the compiled 'prefill' returns "
                                               rf"logits over {vocab} tokens"),
        (lambda d: {**d, "max_cache_len": 100000}, r"says max_cache_len 100000, but the compiled model's cache holds "
                                                   r"128 positions a session"),
    ]:
        with pytest.raises(ais.PackageError, match=message):
            LLM(_with_spec(qwen3, tmp_path / "edited.pt2", edit), threads=1)


def test_cli_exports_a_saved_folder(capsys: pytest.CaptureFixture[str]) -> None:
    """Compiled once, as the packages of llm_package are (keyed by the CLI's source too)."""
    def build(path: Path) -> None:
        assert main(["export", str(hf_model_dir("qwen3")), "-o", str(path), "--max-cache-len", "64",
                     "--max-prefill", "16"]) == 0
        assert capsys.readouterr().out.strip() == str(path)

    out = cached_package("cli-qwen3", [inspect.getsource(m) for m in (aoti_sessions.__main__, _export_cli)], build)
    spec = read_llm_package(out).spec
    assert (spec.max_cache_len, spec.max_prefill, spec.model_type) == (64, 16, "qwen3")
    prompt = _chat(_tokenizer("qwen3"), PROMPTS[1])
    expected, logits = _reference(_eager("qwen3"), prompt, 12)
    with ais.Engine(out) as eng, eng.new_session() as s:
        greedy = _Greedy(eng, [s], [prompt], 16, steps=12)
        greedy.run()
    assert greedy.tokens[0] == expected
    torch.testing.assert_close(greedy.logits[0][0], logits[0][0], atol=1e-4, rtol=1e-4)


def test_cli_refuses_bad_input_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = hf_model_dir("qwen3")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((model_dir / name).read_bytes())
    seq2seq = tmp_path / "t5"
    transformers.T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=16, d_kv=8).save_pretrained(seq2seq)
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "x.pt2")
    for argv, message in [
        ([str(tmp_path / "missing"), "-o", out], "does not exist"),
        ([str(tmp_path / "empty"), "-o", out], "holds no transformers model (no config.json)"),
        ([str(seq2seq), "-o", out], "holds a 't5' model, which is not a causal language model"),
        ([str(no_tokenizer), "-o", out], "no tokenizer in"),
        ([str(model_dir), "-o", str(tmp_path / "x.zip")], "must end in .pt2"),
        ([str(model_dir), "-o", out, "--max-cache-len", "100000"], "exceeds what the model supports"),
        ([str(model_dir), "-o", out, "--max-cache-len", "64", "--max-prefill", "65"], "max_prefill must be in"),
        ([str(hf_model_dir("mistral")), "-o", out, "--max-cache-len", "513"], "exceeds what the model supports (512"),
    ]:
        assert main(["export", *argv]) == 2, argv
        last = capsys.readouterr().err.splitlines()[-1]  # after any progress bar of transformers'
        assert last.startswith("aoti-sessions: error: ") and message in last, (argv, last)
    assert not list(tmp_path.glob("*.pt2"))


def test_export_takes_a_model_object_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    """A model object (with its tokenizer object) exports in another dtype; the
    caller's model keeps its dtype, device, mode and generation config."""
    model, tokenizer = _eager("llama"), _tokenizer("llama")
    generation = model.generation_config.to_dict()
    path = export(model, tmp_path / "llama-bf16.pt2", max_cache_len=32, max_prefill=8, dtype="bfloat16",
                  tokenizer=tokenizer, inductor_configs=FAST)
    assert (model.dtype, model.device.type, model.training) == (torch.float32, "cpu", False)
    assert model.generation_config.to_dict() == generation
    package = read_llm_package(path)
    assert (package.spec.dtype, package.spec.max_cache_len, package.spec.max_prefill) == ("bfloat16", 32, 8)
    with ais.Engine(path) as eng, eng.new_session() as s:
        assert eng.pool is not None and {t["dtype"] for t in eng.pool["tensors"]} == {"bfloat16"}
        prompt = _chat(tokenizer, PROMPTS[0])[:8]
        logits = s.run("prefill", torch.tensor([prompt]))
    with torch.no_grad():
        eager = model.to(torch.bfloat16)(torch.tensor([prompt])).logits[:, -1].float()
    assert logits.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa: within a few of its steps at the logits' scale.
    assert float((logits.float() - eager).abs().max()) <= 0.03 * float(eager.abs().max())
    assert int(logits.argmax()) == int(eager.argmax())


def test_picking_rows_restores_the_output_head_as_it_was() -> None:
    """Export applies the head to each row's last real position through a
    swapped forward, then leaves the head as it found it: the class's
    forward, or one set on the module itself (a hook's)."""
    from aoti_sessions.llm.exporting._paged import _pick_rows

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 3)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    model = Model()
    hidden = torch.randn(2, 5, 4)
    last = torch.tensor([4, 1])
    with _pick_rows(model, last):  # type: ignore[arg-type]
        picked = model.head(hidden)
    torch.testing.assert_close(picked[:, 0], torch.stack([model.head(hidden[0, 4]), model.head(hidden[1, 1])]))
    assert "forward" not in model.head.__dict__
    hooked = model.head.forward
    model.head.forward = hooked  # an instance forward, as accelerate's hooks set
    with _pick_rows(model, last):  # type: ignore[arg-type]
        assert model.head.forward is not hooked
    assert model.head.__dict__["forward"] is hooked
