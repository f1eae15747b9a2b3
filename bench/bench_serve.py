"""The chat server under multi-turn load (issue 12).

    python bench/bench_serve.py [--device cpu|cuda] [--chats 1,4,16[,64]] [--turns 8] [--tokens 32]
                                [--anchor | --no-anchor] [--anchor-batches 1,4,16,64]

N concurrent chats, each its own session, run T turns each against a real
`aoti-sessions serve` process (streaming chat completions over HTTP), in three
modes, interleaved per round:

- sessions:   every request names its chat's session: a turn prefills only
              what is new (the user's message, the template around it);
- no-session: the same server, no session id: every request prefills the whole
              history (what a server without sessions does);
- serialised: sessions, but one request at a time (a serialised worker).

Reports aggregate generated tokens/s (min / median / max over rounds, and
against one chat), time to first token p50 / p99 per turn index, and the
server's overhead per generated token against ``ChatSession.stream`` called
directly in this process (the median inter-token time of one chat, after the
server is stopped).

The anchor (``--anchor``; on by default on CUDA, off on the CPU, where
compiling is slow): plain transformers ``generate`` on the same model (the
folder the package was exported from: same config, weights and dtype, same
device) with a static cache and ``torch.compile`` (``CompileConfig``,
reduce-overhead, fullgraph), B rows of a 64-token prompt, 64 new tokens each
(greedy), for each B in ``--anchor-batches`` (default: the chat counts),
aggregate generated tokens/s after warm-up calls that compile for that B. Each
B runs in its own process, after the server is stopped, so its memory and
compile state touch neither the server's figures nor the other B's. The
summary puts the server's N chats against transformers at B = N.

The model is a random-weight Qwen3 (the test tokenizer; larger on CUDA),
exported once and cached. Writes bench/results/serve_<device>.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("AOTI_SESSIONS_CACHE", str(ROOT / "build" / "bench-cache"))

import httpx  # noqa: E402
import transformers  # noqa: E402

from aoti_sessions._package import cache_dir  # noqa: E402
from aoti_sessions.llm import LLM, export  # noqa: E402
from aoti_sessions.llm.exporting import _export_methods  # noqa: E402
from aoti_sessions.serve._cli import compute_threads  # noqa: E402
from llm_models import exporter_sources, hf_model_dir  # noqa: E402

# Model sizes: a step of a few ms on the CPU; on the GPU a model whose step is
# launch-bound at batch 1, as chat models' decode steps are.
SIZES = {
    "cpu": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, dtype="float32"),
    "cuda": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, dtype="bfloat16"),
}
CONTEXT = 1024
PREFILL = 256
MODEL = [""]  # the served model's id, read from /v1/models
# The default chat counts: 64 on the GPU (batched decode's scale); on a
# 2-core CPU 64 chats x 3 modes x rounds would take most of an hour.
CHATS = {"cpu": "1,4,16", "cuda": "1,4,16,64"}
# The transformers anchor: B rows of ANCHOR_PROMPT tokens, each generating
# ANCHOR_NEW; ANCHOR_WARMUP untimed calls first (the first compiles, the
# next ones warm and record CUDA graphs).
ANCHOR_PROMPT = 64
ANCHOR_NEW = 64
ANCHOR_WARMUP = 2
ANCHOR_TAG = "ANCHOR "  # prefixes the worker's one line of results on stdout


def model_folder(package: Path) -> Path:
    """The transformers folder ``package`` was exported from (its config and weights, saved in float32)."""
    _, family, _, digest = package.stem.split("-")  # bench-<family>-<device>-<digest>
    return package.parent / f"bench-{family}-{digest}"


# Families bench_package builds besides the dense Qwen3 (bench_pool --family):
# MoE (8 experts, 2 a token), GPT-OSS's attention sinks and window layers,
# and recurrent state (hybrid models, Mamba2), at SIZES' widths and with
# FAMILY_LAYERS layers (fewer than the dense model's on CUDA: their exports
# compile more ops a layer).
FAMILIES = ("qwen3", "qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe", "lfm2", "mamba2")
FAMILY_LAYERS = {"cpu": 4, "cuda": 8}


def family_config(family: str, size: dict[str, Any], base: dict[str, Any]) -> transformers.PretrainedConfig:
    """``family``'s config at ``size`` (SIZES' fields, less the dtype) over
    ``base`` (the test tokenizer's Qwen3 config: the dense model keeps all of
    it, the others its vocabulary and special ids)."""
    if family == "qwen3":
        return transformers.Qwen3Config(**{**base, **size, "initializer_range": 0.05,
                                           "max_position_embeddings": CONTEXT})
    hidden, inter, heads = size["hidden_size"], size["intermediate_size"], size["num_attention_heads"]
    layers, head_dim = size["num_hidden_layers"], size["head_dim"]
    ids = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    common = {**ids, **size, "initializer_range": 0.05, "max_position_embeddings": CONTEXT,
              "tie_word_embeddings": True}
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=inter // 4)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **moe, num_experts=8)
    if family == "gpt_oss":  # gpt-oss's pattern: a window layer of 128 positions, then a global one
        return transformers.GptOssConfig(**{**common, "intermediate_size": inter // 4}, num_local_experts=8,
                                         num_experts_per_tok=2, sliding_window=128,
                                         layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if family in ("qwen3_next", "qwen3_5_moe"):  # Qwen3-Next's pattern: 3 delta-net layers, then full attention
        config = transformers.Qwen3NextConfig if family == "qwen3_next" else transformers.Qwen3_5MoeTextConfig
        return config(**common, **moe, num_experts=8, shared_expert_intermediate_size=inter // 4,
                      linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
                      linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                      layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    if family == "lfm2":  # LFM2's mix: about two conv layers to one attention layer
        common.pop("head_dim")
        return transformers.Lfm2Config(**common, layer_types=["full_attention" if i % 3 == 2 else "conv"
                                                              for i in range(layers)])
    if family == "mamba2":  # every layer an SSM: 2 x hidden inner, heads of head_dim, state 64, chunks of 64
        return transformers.Mamba2Config(**ids, hidden_size=hidden, num_hidden_layers=layers, expand=2,
                                         num_heads=2 * hidden // head_dim, head_dim=head_dim, state_size=64,
                                         n_groups=1, conv_kernel=4, chunk_size=64, initializer_range=0.05,
                                         tie_word_embeddings=True)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def bench_model(family: str, size: dict[str, Any]) -> tuple[Any, Any]:
    """``family``'s model at ``size`` (config fields, no dtype) with the random weights every
    bench package of it has (seed 0, float32), and the test tokenizer."""
    tiny = hf_model_dir("qwen3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    base = transformers.AutoConfig.from_pretrained(tiny, local_files_only=True).to_dict()
    base.pop("layer_types", None)  # derived from the layer count
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, size, base)).eval()
    model.generation_config = transformers.GenerationConfig.from_pretrained(tiny, local_files_only=True)
    return model, tokenizer


def bench_package(device: str, family: str = "qwen3", build: bool = True, **overrides: object) -> Path:
    """The bench model of ``family`` (``overrides``: config fields, or ``dtype``, ``fuse``, ``quantize``,
    ``decode_one`` or ``inductor_configs``: export's), exported once per device and size (``build`` False: FileNotFoundError
    where it is not yet)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    layers = {} if family == "qwen3" else {"num_hidden_layers": FAMILY_LAYERS[kind]}
    size = {**SIZES[kind], **layers, **overrides}
    # The exporter's sources and attention choices are in the key: a change to what it compiles re-exports.
    fuse = bool(size.pop("fuse", True))
    quantize = size.pop("quantize", None)
    configs = size.pop("inductor_configs", None)
    one = bool(size.pop("decode_one", False))
    key = (f"{torch.__version__}-{transformers.__version__}-{sorted(size.items())}-{CONTEXT}-{PREFILL}-"
           f"{'-'.join(exporter_sources())}-{'decode_one-' if one else ''}{'fused' if fuse else 'unfused'}-"
           f"{'' if quantize is None else quantize}-{'' if configs is None else sorted(dict(configs).items())}-"
           f"{_export_methods.PREFILL_ATTENTION}-{_export_methods.DECODE_ATTENTION}")
    if family != "qwen3":  # (the dense model's key as before)
        key += f"-{family}-{inspect.getsource(family_config)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"bench-{family}-{device.split(':')[0]}-{digest}.pt2"
    if target.is_file():
        return target
    if not build:
        raise FileNotFoundError(f"no {family} bench package for {sorted(size.items())} yet ({target.name})")
    dtype = str(size["dtype"])
    model, tokenizer = bench_model(family, {k: v for k, v in size.items() if k != "dtype"})
    folder = model_folder(target)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name("tmp-" + target.name)
    export(folder, tmp, device=device, max_cache_len=CONTEXT, max_prefill=PREFILL, dtype=dtype, fuse=fuse,
           quantize=None if quantize is None else str(quantize), inductor_configs=configs, decode_one=one)
    os.replace(tmp, target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(package: Path, device: str, port: int, log: Path, threads: int | None,
                 args: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    extra = (["--threads", str(threads)] if threads else []) + list(args or [])
    with log.open("wb") as out:  # the server's own log, read back if it fails
        proc = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port),
                                 "--device", device, "--max-sessions", "256", *extra],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start in 300 s")


# --response-format json: every turn held to a JSON schema whose one string is longer than any turn, so a
# turn still generates --tokens tokens (the grammar's masks cost, against the same bench without them).
RESPONSE_FORMAT_ENV = "BENCH_SERVE_RESPONSE_FORMAT"
LONG_JSON = {"type": "json_schema", "json_schema": {"name": "long", "schema": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}}}


def user_message(chat: int, turn: int) -> str:
    return f"Chat {chat}, turn {turn}: tell me more about the river and the old mill by the bridge."


async def run_chat(client: httpx.AsyncClient, chat: int, turns: int, tokens: int, mode: str, tag: str,
                   lock: asyncio.Lock | None, ttft: dict[int, list[float]]) -> int:
    """One multi-turn chat; returns the tokens generated."""
    messages: list[dict[str, str]] = []
    generated = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(chat, turn)})
        body = {"model": MODEL[0], "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if os.environ.get(RESPONSE_FORMAT_ENV) == "json":  # (--response-format: set for the client processes)
            body["response_format"] = LONG_JSON
        if mode != "no-session":
            body["session_id"] = f"{tag}-{chat}"
        async with (lock if lock is not None else _null()):
            start = time.perf_counter()
            first = None
            text = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        generated += int(event["usage"]["completion_tokens"])
                    for choice in event.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter() - start
                            text.append(piece)
        ttft.setdefault(turn, []).append(first if first is not None else time.perf_counter() - start)
        messages.append({"role": "assistant", "content": "".join(text)})
    if mode != "no-session":
        await client.delete(f"/v1/sessions/{tag}-{chat}")
    return generated


class _null:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


# Chats one client process drives at most: an asyncio client parsing every
# streamed chunk costs ~100 us of its CPU a token, so one process would cap
# the aggregate rate it measures (at 64 chats it would measure itself).
CHATS_PER_CLIENT = 8


async def run_chats(port: int, chat_ids: list[int], turns: int, tokens: int, mode: str,
                    tag: str) -> tuple[int, dict[int, list[float]], float, float]:
    """``chat_ids``' chats at once from this process: tokens generated, TTFTs per turn, start and end."""
    ttft: dict[int, list[float]] = {}
    lock = asyncio.Lock() if mode == "serialised" else None
    limits = httpx.Limits(max_connections=len(chat_ids) + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(run_chat(client, c, turns, tokens, mode, tag, lock, ttft)
                                        for c in chat_ids))
        end = time.perf_counter()
    return sum(counts), ttft, start, end


def _client(port: int, chat_ids: list[int], turns: int, tokens: int, mode: str,
            tag: str) -> tuple[int, dict[int, list[float]], float, float]:
    return asyncio.run(run_chats(port, chat_ids, turns, tokens, mode, tag))


def run_mode(port: int, chats: int, turns: int, tokens: int, mode: str, tag: str) -> tuple[float, dict]:
    """Aggregate generated tokens/s of ``chats`` chats and their TTFTs per turn.

    Over CHATS_PER_CLIENT chats, the chats are spread over client processes
    (serialised mode excepted: one lock orders them), and the rate is every
    process's tokens over the span from the first start to the last end
    (perf_counter is the system's monotonic clock: one time line for all)."""
    procs = 1 if mode == "serialised" else -(-chats // CHATS_PER_CLIENT)
    groups = [list(range(chats))[i::procs] for i in range(procs)]
    if procs == 1:
        results = [_client(port, groups[0], turns, tokens, mode, tag)]
    else:
        # fork: the children run only httpx and asyncio (no torch).
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            results = pool.starmap(_client, [(port, g, turns, tokens, mode, tag) for g in groups])
    ttft: dict[int, list[float]] = {}
    for _, part, _, _ in results:
        for turn, values in part.items():
            ttft.setdefault(turn, []).extend(values)
    wall = max(r[3] for r in results) - min(r[2] for r in results)
    return sum(r[0] for r in results) / wall, ttft


# The server's counters read before and after each run (/metrics).
COUNTERS = ("time_to_start_seconds_sum", "time_to_start_seconds_count", "start_to_first_token_seconds_sum",
            "start_to_first_token_seconds_count", "steps_total", "decode_rows_total", "prefill_calls_total",
            'step_seconds_total{phase="wait"}', 'step_seconds_total{phase="queue"}',
            'step_seconds_total{phase="text"}', "step_engine_seconds_total", "step_queue_cpu_seconds_total",
            "batch_seconds_total", "graph_captures_total", "prefill_calls_total")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def server_figures(port: int, pid: int) -> dict[str, float]:
    """The server's COUNTERS, wall time, and the CPU seconds of the server
    process and of its engine process (its child, if it has one)."""
    values = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            values[name.removeprefix("aoti_sessions_")] = float(value)
    figures = {name: values.get(name, 0.0) for name in COUNTERS}
    figures["wall"] = time.perf_counter()
    engine = [c for c in children(pid) if _is_engine(c)]
    # (With --api-workers N the server's process is the hub; its front ends count as the server's.)
    figures["cpu_server"] = cpu_seconds(pid) + sum(cpu_seconds(c) for c in children(pid) if c not in engine)
    figures["cpu_engine"] = sum(cpu_seconds(c) for c in engine)
    return figures


def _is_engine(pid: int) -> bool:
    try:
        return b"aoti_sessions.llm.process._engine_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def spread(xs: list[float], digits: int = 1) -> str:
    """``median (min / max)`` of ``xs``."""
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f} / {max(xs):.{digits}f})"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def direct_token_time(package: Path, device: str, tokens: int, rounds: int) -> list[float]:
    """Median time per generated token of ChatSession.stream in this process, per round."""
    out = []
    with LLM(package, device=device) as llm:
        for r in range(rounds + 1):
            with llm.new_session() as s:
                times = []
                last = None
                for _ in s.stream([{"role": "user", "content": user_message(0, 0)}], max_tokens=tokens,
                                  temperature=0, ignore_eos=True):
                    now = time.perf_counter()
                    if last is not None:
                        times.append(now - last)
                    last = now
                if r > 0:
                    out.append(statistics.median(times))
    return out


async def server_token_time(port: int, tokens: int) -> float:
    """Median inter-token time of one streamed chat on the server."""
    body = {"model": MODEL[0], "messages": [{"role": "user", "content": user_message(0, 0)}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    times, last = [], None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                        now = time.perf_counter()
                        if last is not None:
                            times.append(now - last)
                        last = now
    return statistics.median(times)


@dataclass
class Anchor:
    """transformers ``generate`` at one batch size B, from its own process."""
    batch: int
    rates: list[float] = field(default_factory=list)  # generated tokens/s per timed call
    first_s: float = 0.0  # the first call (compiling for this B), s
    wall_s: float = 0.0  # the whole worker process, s
    recompiled: bool = False  # a timed call compiled or recorded a graph: its rates are not steady state
    attention: str = ""
    error: str = ""


def anchor_prompt(tokenizer: transformers.PreTrainedTokenizerBase, batch: int) -> torch.Tensor:
    """``batch`` rows of exactly ANCHOR_PROMPT tokens (chat ``r``'s messages, repeated): no padding to mask."""
    rows = []
    for r in range(batch):
        text = " ".join(user_message(r, t) for t in range(ANCHOR_PROMPT))
        ids = tokenizer(text, add_special_tokens=False).input_ids[:ANCHOR_PROMPT]
        assert len(ids) == ANCHOR_PROMPT, f"prompt of {len(ids)} tokens"
        rows.append(ids)
    return torch.tensor(rows)


def anchor_worker(folder: Path, device: str, batch: int, rounds: int) -> Anchor:
    """Time transformers ``generate`` with a static cache and ``torch.compile`` at batch ``batch``."""
    from torch._dynamo.utils import counters

    dtype = getattr(torch, SIZES["cuda" if device.startswith("cuda") else "cpu"]["dtype"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    # transformers 5's own path: with a static cache, generate compiles the
    # decode step (model.__call__, through CompileConfig) and runs the prefill
    # eagerly. dynamic=False: one static graph for this B, as the server's
    # graphs are per padded batch size.
    model.generation_config.cache_implementation = "static"
    compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead", dynamic=False)
    if not device.startswith("cuda"):
        # generate compiles only on accelerators unless told (reduce-overhead's CUDA graphs don't apply here).
        compile_config._compile_all_devices = True
    ids = anchor_prompt(tokenizer, batch).to(device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=ANCHOR_NEW,
                  max_new_tokens=ANCHOR_NEW, compile_config=compile_config)

    def call() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**kwargs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        # min_new_tokens = max_new_tokens: every row generates all of them (none stops at EOS).
        assert out.shape == (batch, ANCHOR_PROMPT + ANCHOR_NEW), out.shape
        return wall

    result = Anchor(batch, attention=str(model.config._attn_implementation))
    result.first_s = call()
    for _ in range(ANCHOR_WARMUP - 1):
        call()
    if not hasattr(model, "_compiled_call"):
        raise RuntimeError("generate did not compile the model (transformers' auto-compile criteria not met)")

    def graphs() -> tuple[int, int]:
        # Dynamo graphs compiled, and inputs of CUDA graphs recorded (cudagraph trees count them per recording).
        return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_recorded_non_static_inputs"]

    before = graphs()
    result.rates = [batch * ANCHOR_NEW / call() for _ in range(rounds)]
    result.recompiled = graphs() != before
    return result


def run_anchor(folder: Path, device: str, batch: int, rounds: int) -> Anchor:
    """``anchor_worker`` in a fresh process: its device memory and compiled graphs go when it exits."""
    start = time.perf_counter()
    # The worker's own log (transformers' and inductor's warnings) goes to stderr as it comes.
    proc = subprocess.run([sys.executable, __file__, "--device", device, "--rounds", str(rounds),
                           "--anchor-worker", str(batch), "--anchor-folder", str(folder)],
                          stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(ANCHOR_TAG)]
    if proc.returncode != 0 or not lines:
        return Anchor(batch, wall_s=time.perf_counter() - start,
                      error=f"worker exited {proc.returncode} (its log is in the output above)")
    result = Anchor(**json.loads(lines[-1][len(ANCHOR_TAG):]))
    result.wall_s = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chats", default=None, help=f"chat counts (default: {CHATS['cpu']} on the CPU, "
                                                       f"{CHATS['cuda']} on CUDA)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="sessions,no-session,serialised",
                        help="which of sessions, no-session, serialised to run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-log", default=str(ROOT / "build" / "bench_serve_server.log"))
    parser.add_argument("--server-threads", type=int, default=None,
                        help="the server's --threads (default: its own default)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `aoti-sessions serve` (repeat it: --server-arg=--no-engine-process)")
    parser.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=None,
                        help="time transformers generate (static cache, torch.compile) at B = each chat count "
                             "(default: on for CUDA, off for the CPU)")
    parser.add_argument("--response-format", choices=("text", "json"), default="text",
                        help="json: every turn held to a JSON schema (structured output's masks) that outlasts it")
    parser.add_argument("--anchor-batches", default=None, help="the anchor's batch sizes (default: --chats)")
    # The anchor's worker process (run_anchor): one B, its results on one line of stdout.
    parser.add_argument("--anchor-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--anchor-folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ[RESPONSE_FORMAT_ENV] = args.response_format
    device = args.device
    if args.anchor_worker is not None:
        result = anchor_worker(Path(args.anchor_folder), device, args.anchor_worker, args.rounds)
        print(ANCHOR_TAG + json.dumps(result.__dict__), flush=True)
        return
    kind = "cuda" if device.startswith("cuda") else "cpu"
    chats = [int(x) for x in (args.chats or CHATS[kind]).split(",")]
    anchor_on = args.anchor if args.anchor is not None else kind == "cuda"
    batches = [int(x) for x in args.anchor_batches.split(",")] if args.anchor_batches else chats
    package = bench_package(device)
    folder = model_folder(package)
    if anchor_on and not (folder / "config.json").is_file():
        raise SystemExit(f"the anchor needs the model folder {folder}, saved beside the package when it was "
                         f"exported: remove {package} to export again")
    port = free_port()
    log = Path(args.server_log)
    server = start_server(package, device, port, log, args.server_threads, args.server_arg)
    MODEL[0] = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    modes = tuple(m for m in ("sessions", "no-session", "serialised") if m in args.modes.split(","))
    rates: dict[tuple[int, str], list[float]] = {}
    ttfts: dict[tuple[int, str], dict[int, list[float]]] = {}
    parts: dict[tuple[int, str], list[dict[str, float]]] = {}  # server_figures' change over each run
    try:
        # Warm-up: kernels, graphs; at every chat count and over as many
        # turns as a round, since a batched decode captures a graph per padded
        # batch size and a prefill one per rows, chunk length and history
        # width bucket, each at its second run (as the anchor's warm-up calls
        # compile for each B): twice on CUDA, so that the timed rounds replay
        # what their shapes captured rather than capture it.
        for n in sorted({2, *chats}):
            for warm in range(2 if device.startswith("cuda") else 1):
                run_mode(port, n, args.turns, args.tokens, "sessions", f"warm{warm}-{n}")
        for r in range(args.rounds):
            for n in chats:
                for mode in modes:
                    before = server_figures(port, server.pid)
                    rate, ttft = run_mode(port, n, args.turns, args.tokens, mode, f"r{r}{mode[0]}")
                    after = server_figures(port, server.pid)
                    parts.setdefault((n, mode), []).append({k: after[k] - before[k] for k in after})
                    rates.setdefault((n, mode), []).append(rate)
                    merged = ttfts.setdefault((n, mode), {})
                    for turn, xs in ttft.items():
                        merged.setdefault(turn, []).extend(xs)
                    print(f"round {r} chats {n} {mode}: {rate:.1f} tokens/s", flush=True)
        server_itl = [asyncio.run(server_token_time(port, 64)) for _ in range(args.rounds)]
    except BaseException:
        print(f"server (exit status {server.poll()}), the end of its log {log}:\n{log.read_text()[-3000:]}",
              flush=True)
        raise
    finally:
        server.terminate()
        server.wait(timeout=60)
    direct_itl = direct_token_time(package, device, 64, args.rounds)
    # The server may give the model fewer CPU threads than torch's default
    # (serve --threads): the same call with the server's count tells the
    # server's own overhead from the CPUs it leaves to its HTTP work.
    threads = compute_threads(args.server_threads, device)
    default_threads = torch.get_num_threads()
    same_itl: list[float] = []
    if threads is not None and threads != default_threads:
        torch.set_num_threads(threads)
        same_itl = direct_token_time(package, device, 64, args.rounds)
        torch.set_num_threads(default_threads)
    anchors: list[Anchor] = []
    for b in batches if anchor_on else []:
        a = run_anchor(folder, device, b, args.rounds)
        anchors.append(a)
        if a.error:
            print(f"anchor B {b}: FAILED ({a.error})", flush=True)
            continue
        for r, rate in enumerate(a.rates):
            print(f"round {r} anchor B {b}: {rate:.1f} tokens/s", flush=True)
        print(f"anchor B {b}: first call (compiling) {a.first_s:.1f} s, worker {a.wall_s:.1f} s in all"
              + ("; a timed call compiled or recorded a graph" if a.recompiled else ""), flush=True)
    report(args, device, package, chats, modes, rates, ttfts, parts, server_itl, direct_itl,
           (threads, default_threads, same_itl), anchors)
    if any(a.error for a in anchors):
        sys.exit(1)


def report(args: argparse.Namespace, device: str, package: Path, chats: list[int], modes: tuple[str, ...],
           rates: dict, ttfts: dict, parts: dict, server_itl: list[float], direct_itl: list[float],
           same: tuple[int | None, int, list[float]], anchors: list[Anchor]) -> None:
    card = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    size = SIZES["cuda" if device.startswith("cuda") else "cpu"]
    doc = [f"# Chat server under multi-turn load (bench/bench_serve.py, {device})", "",
           f"{card}; torch {torch.__version__}; transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}. "
           f"Random-weight Qwen3 ({size['num_hidden_layers']} layers, hidden {size['hidden_size']}, {size['dtype']}), "
           f"context {CONTEXT}. {args.turns} turns per chat, {args.tokens} tokens per turn (greedy, ignore_eos), "
           f"streaming; {args.rounds} rounds, modes interleaved."
           + (f" Server arguments: `{' '.join(args.server_arg)}`." if args.server_arg else "")
           + (" Every turn held to a JSON schema (`--response-format json`)." if args.response_format == "json"
              else ""), "",
           "| chats | mode | generated tokens/s: median (min / max) | vs serialised | vs 1 chat |",
           "|---:|---|---:|---:|---:|"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    for n in chats:
        for mode in modes:
            xs = rates[(n, mode)]
            one = f"{med[(n, mode)] / med[(1, mode)]:.2f}x" if 1 in chats else "-"
            serial = f"{med[(n, mode)] / med[(n, 'serialised')]:.2f}x" if (n, "serialised") in med else "-"
            doc.append(f"| {n} | {mode} | {spread(xs)} | {serial} | {one} |")
    last = args.turns  # the last turn, 1-based
    doc += ["", "Time to first token, ms: p50 / p99 per turn (all chats and rounds).", "",
            "| chats | mode | " + " | ".join(f"turn {t + 1}" for t in range(args.turns))
            + f" | turn {last} / turn 1 (p50) |",
            "|---:|---|" + "---:|" * (args.turns + 1)]
    ratio = {}
    for n in chats:
        for mode in modes:
            per = ttfts[(n, mode)]
            cells = [f"{pct(per[t], 0.5) * 1e3:.1f} / {pct(per[t], 0.99) * 1e3:.1f}" for t in range(args.turns)]
            ratio[(n, mode)] = pct(per[last - 1], 0.5) / pct(per[0], 0.5)
            doc.append(f"| {n} | {mode} | " + " | ".join(cells) + f" | {ratio[(n, mode)]:.2f}x |")
    doc += ["", "Where the time to first token goes (the server's metrics; mean ms over each run: median (min / max) "
                "over rounds): before the generation joins the step loop (parsing, chat template, tokenizing, "
                "the session, starting), and in it (waiting for a step, prefill, sampling).", "",
            "| chats | mode | before the step loop | in the step loop |", "|---:|---|---:|---:|"]
    def cell(n: int, mode: str, value: Callable[[dict[str, float]], float], digits: int = 1) -> str:
        return spread([value(p) for p in parts[(n, mode)]], digits)

    for n in chats:
        for mode in modes:
            cells = [cell(n, mode, lambda p, part=part: p[f"{part}_sum"] / max(p[f"{part}_count"], 1) * 1e3)
                     for part in ("time_to_start_seconds", "start_to_first_token_seconds")]
            doc.append(f"| {n} | {mode} | " + " | ".join(cells) + " |")
    doc += ["", "Where the server's time goes (its metrics and /proc; median (min / max) over rounds): the step "
                "loop's steps a second, decode rows a step, and its time a step queueing a step (host work, while "
                "the device computes the step before), waiting for the step before, reading its tokens and making "
                "their text; of the queueing, the step loop thread's CPU (the rest it waited, mostly for the "
                "GIL its process's other threads hold), the engine's calls as Python saw them and the C++ core's "
                "time in them (without the GIL); the CPU cores busy in the server's processes (HTTP, templates, "
                "tokenizing, streaming: its front ends) and in its engine process (the step loop and its calls).", "",
            "| chats | mode | steps/s | decode rows / step | wait, ms / step | queue, ms / step | text, ms / step "
            "| queue CPU, ms / step | engine calls, ms / step | in C++, ms / step | prefill calls / step "
            "| graphs captured | server process, cores | engine process, cores |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in chats:
        for mode in modes:
            cells = [cell(n, mode, lambda p: p["steps_total"] / p["wall"], 0),
                     cell(n, mode, lambda p: p["decode_rows_total"] / max(p["steps_total"], 1))]
            cells += [cell(n, mode, lambda p, ph=ph: p[f'step_seconds_total{{phase="{ph}"}}']
                           / max(p["steps_total"], 1) * 1e3, 3) for ph in ("wait", "queue", "text")]
            cells += [cell(n, mode, lambda p, key=key: p[key] / max(p["steps_total"], 1) * 1e3, 3)
                      for key in ("step_queue_cpu_seconds_total", "step_engine_seconds_total", "batch_seconds_total")]
            cells += [cell(n, mode, lambda p: p["prefill_calls_total"] / max(p["steps_total"], 1), 3),
                      cell(n, mode, lambda p: p["graph_captures_total"], 0)]
            cells += [cell(n, mode, lambda p, who=who: p[f"cpu_{who}"] / p["wall"], 2) for who in ("server", "engine")]
            doc.append(f"| {n} | {mode} | " + " | ".join(cells) + " |")
    s_med, d_med = statistics.median(server_itl), statistics.median(direct_itl)
    overhead = s_med / d_med - 1
    doc += ["", f"Per generated token, one chat: server (streamed, inter-token) {s_med * 1e3:.3f} ms "
                f"(min {min(server_itl) * 1e3:.3f} / max {max(server_itl) * 1e3:.3f}); `ChatSession.stream` "
                f"directly {d_med * 1e3:.3f} ms (min {min(direct_itl) * 1e3:.3f} / max {max(direct_itl) * 1e3:.3f}): "
                f"server overhead {overhead * 100:+.1f}%.", ""]
    threads, default_threads, same_itl = same
    if same_itl:
        own = s_med / statistics.median(same_itl) - 1
        doc += [f"The server ran the model's kernels on {threads} CPU thread(s) (`serve --threads`; this process: "
                f"{default_threads}), leaving the rest to its HTTP work and, here, the benchmark's client. "
                f"`ChatSession.stream` on {threads} thread(s): {statistics.median(same_itl) * 1e3:.3f} ms "
                f"(min {min(same_itl) * 1e3:.3f} / max {max(same_itl) * 1e3:.3f}): the server's own overhead at "
                f"equal compute threads {own * 100:+.1f}%.", ""]
    anchor_med = {a.batch: statistics.median(a.rates) for a in anchors if not a.error}
    if anchors:
        attention = next((a.attention for a in anchors if a.attention), "?")
        doc += ["## transformers `generate` (the anchor)", "",
                f"The same model (config, random weights, {size['dtype']}, {device}) in transformers: "
                f"`generate` with `cache_implementation=\"static\"` and `CompileConfig(mode=\"reduce-overhead\", "
                f"fullgraph=True, dynamic=False)` (transformers compiles the decode step; prefill eager), "
                f"{attention} attention, B rows of a {ANCHOR_PROMPT}-token prompt, {ANCHOR_NEW} new tokens each "
                f"(greedy, min_new_tokens = max_new_tokens). Generated tokens/s = B x {ANCHOR_NEW} / the call's "
                f"wall time (prefill included), {args.rounds} timed calls after {ANCHOR_WARMUP} untimed ones; "
                f"each B in its own process, after the server runs.", "",
                "| B | generated tokens/s: median (min / max) | first call (compiling), s | worker, s "
                "| server, B chats (sessions) | server / transformers |",
                "|---:|---:|---:|---:|---:|---:|"]
        for a in anchors:
            if a.error:
                doc.append(f"| {a.batch} | FAILED: {a.error.splitlines()[0][:120]} | | {a.wall_s:.0f} | | |")
                continue
            note = " (a timed call compiled or recorded a graph)" if a.recompiled else ""
            server = med.get((a.batch, "sessions"))
            cells = (f"{server:.1f} | {server / anchor_med[a.batch]:.2f}x" if server is not None else "- | -")
            doc.append(f"| {a.batch} | {spread(a.rates)}{note} | "
                       f"{a.first_s:.1f} | {a.wall_s:.0f} | {cells} |")
        doc.append("")
    # The ratios (sessions mode), in one place.
    summary = [f"one chat's inter-token time on the server: {s_med * 1e3:.3f} ms (`ChatSession.stream`: "
               f"{d_med * 1e3:.3f} ms)"]
    if 1 in chats:
        summary += [f"aggregate tokens/s, {n} chats / 1 chat: {med[(n, 'sessions')] / med[(1, 'sessions')]:.2f}x"
                    for n in chats if n > 1]
        many = 16 if 16 in chats else max(chats)
        if many > 1:
            ttft = {n: pct(ttfts[(n, "sessions")][last - 1], 0.5) for n in (1, many)}
            summary.append(f"TTFT p50 at turn {last}, {many} chats / 1 chat: {ttft[many] / ttft[1]:.2f}x "
                           f"({ttft[many] * 1e3:.1f} / {ttft[1] * 1e3:.1f} ms)")
    summary += [f"server at {b} chats / transformers at B = {b}: {med[(b, 'sessions')] / anchor_med[b]:.2f}x "
                f"({med[(b, 'sessions')]:.1f} / {anchor_med[b]:.1f} tokens/s)" + (" (the headline)" if b == 16 else "")
                for b in sorted(anchor_med) if (b, "sessions") in med]
    doc += ["## Summary (sessions mode)", ""] + [f"- {line}" for line in summary] + [""]
    targets = [(f"TTFT turn {last} / turn 1 with sessions <= 1.2x (chats {n}): {ratio[(n, 'sessions')]:.2f}x",
                ratio[(n, "sessions")] <= 1.2) for n in chats]
    if (4, "serialised") in med:
        gain = med[(4, "sessions")] / med[(4, "serialised")]
        targets.append((f"4 chats: tokens/s >= 2.5x the serialised worker (GPU goal): {gain:.2f}x", gain >= 2.5))
    targets.append((f"server overhead per generated token < 5%: {overhead * 100:+.1f}%", overhead < 0.05))
    doc += ["## Targets", "", "| target | |", "|---|---|"]
    doc += [f"| {t} | {'met' if ok else 'MISSED'} |" for t, ok in targets]
    text = "\n".join(doc) + "\n"
    out = args.out or str(ROOT / "bench" / "results" / f"serve_{device.split(':')[0]}.md")
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
