"""The chat server under multi-turn load (issue 12).

    python bench/bench_serve.py [--device cpu|cuda] [--chats 1,4,16] [--turns 8] [--tokens 32]

N concurrent chats, each its own session, run T turns each against a real
`aoti-sessions serve` process (streaming chat completions over HTTP), in three
modes, interleaved per round:

- sessions:   every request names its chat's session: a turn prefills only
              what is new (the user's message, the template around it);
- no-session: the same server, no session id: every request prefills the whole
              history (what a server without sessions does);
- serialised: sessions, but one request at a time (a serialised worker).

Reports aggregate generated tokens/s (min / median / max over rounds), time to
first token p50 / p99 per turn index, and the server's overhead per generated
token against ``ChatSession.stream`` called directly in this process (the
median inter-token time of one chat, after the server is stopped).

The model is a random-weight Qwen3 (the test tokenizer; larger on CUDA),
exported once and cached. Writes bench/RESULTS_serve_<device>.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("AOTI_SESSIONS_CACHE", str(ROOT / "build" / "bench-cache"))

import httpx  # noqa: E402
import transformers  # noqa: E402

from aoti_sessions._package import cache_dir  # noqa: E402
from aoti_sessions.llm import LLM, _export, export  # noqa: E402
from aoti_sessions.serve._cli import compute_threads  # noqa: E402
from llm_models import hf_model_dir  # noqa: E402

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


def bench_package(device: str, **overrides: object) -> Path:
    """The bench model (``overrides``: config fields), exported once per device and size."""
    size = {**SIZES["cuda" if device.startswith("cuda") else "cpu"], **overrides}
    # The exporter's source and attention choices are in the key: a change to what it compiles re-exports.
    key = (f"{torch.__version__}-{transformers.__version__}-{sorted(size.items())}-{CONTEXT}-{PREFILL}-"
           f"{inspect.getsource(_export)}-{_export.PREFILL_ATTENTION}-{_export.DECODE_ATTENTION}")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"bench-qwen3-{device.split(':')[0]}-{digest}.pt2"
    if target.is_file():
        return target
    tiny = hf_model_dir("qwen3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    base = transformers.AutoConfig.from_pretrained(tiny, local_files_only=True).to_dict()
    base.pop("layer_types", None)  # derived from the layer count
    dtype = size["dtype"]
    config = transformers.Qwen3Config(**{**base, **{k: v for k, v in size.items() if k != "dtype"},
                                         "initializer_range": 0.05, "max_position_embeddings": CONTEXT})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = transformers.GenerationConfig.from_pretrained(tiny, local_files_only=True)
    folder = target.parent / f"bench-qwen3-{digest}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name("tmp-" + target.name)
    export(folder, tmp, device=device, max_cache_len=CONTEXT, max_prefill=PREFILL, dtype=dtype)
    os.replace(tmp, target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(package: Path, device: str, port: int, log: Path, threads: int | None) -> subprocess.Popen[bytes]:
    extra = ["--threads", str(threads)] if threads else []
    with log.open("wb") as out:  # the server's own log, read back if it fails
        proc = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--port", str(port),
                                 "--device", device, "--max-sessions", "256", *extra],
                                stdout=out, stderr=subprocess.STDOUT)
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


async def run_mode(port: int, chats: int, turns: int, tokens: int, mode: str, tag: str) -> tuple[float, dict]:
    ttft: dict[int, list[float]] = {}
    lock = asyncio.Lock() if mode == "serialised" else None
    limits = httpx.Limits(max_connections=chats + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(run_chat(client, c, turns, tokens, mode, tag, lock, ttft)
                                        for c in range(chats)))
        wall = time.perf_counter() - start
    return sum(counts) / wall, ttft


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chats", default="1,4,16")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-log", default=str(ROOT / "build" / "bench_serve_server.log"))
    parser.add_argument("--server-threads", type=int, default=None,
                        help="the server's --threads (default: its own default)")
    args = parser.parse_args()
    device = args.device
    chats = [int(x) for x in args.chats.split(",")]
    package = bench_package(device)
    port = free_port()
    log = Path(args.server_log)
    server = start_server(package, device, port, log, args.server_threads)
    MODEL[0] = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    modes = ("sessions", "no-session", "serialised")
    rates: dict[tuple[int, str], list[float]] = {}
    ttfts: dict[tuple[int, str], dict[int, list[float]]] = {}
    try:
        asyncio.run(run_mode(port, 2, 2, 4, "sessions", "warm"))  # warm-up: kernels, graphs
        for r in range(args.rounds):
            for n in chats:
                for mode in modes:
                    rate, ttft = asyncio.run(run_mode(port, n, args.turns, args.tokens, mode, f"r{r}{mode[0]}"))
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
    report(args, device, package, chats, modes, rates, ttfts, server_itl, direct_itl, (threads, default_threads, same_itl))


def report(args: argparse.Namespace, device: str, package: Path, chats: list[int], modes: tuple[str, ...],
           rates: dict, ttfts: dict, server_itl: list[float], direct_itl: list[float],
           same: tuple[int | None, int, list[float]]) -> None:
    card = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    size = SIZES["cuda" if device.startswith("cuda") else "cpu"]
    doc = [f"# Chat server under multi-turn load (bench/bench_serve.py, {device})", "",
           f"{card}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}. Random-weight Qwen3 "
           f"({size['num_hidden_layers']} layers, hidden {size['hidden_size']}, {size['dtype']}), context {CONTEXT}. "
           f"{args.turns} turns per chat, {args.tokens} tokens per turn (greedy, ignore_eos), streaming; "
           f"{args.rounds} rounds, modes interleaved.", "",
           "| chats | mode | generated tokens/s: median (min / max) | vs serialised |", "|---:|---|---:|---:|"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    for n in chats:
        for mode in modes:
            xs = rates[(n, mode)]
            doc.append(f"| {n} | {mode} | {med[(n, mode)]:.1f} ({min(xs):.1f} / {max(xs):.1f}) | "
                       f"{med[(n, mode)] / med[(n, 'serialised')]:.2f}x |")
    doc += ["", "Time to first token, ms: p50 / p99 per turn (all chats and rounds).", "",
            "| chats | mode | " + " | ".join(f"turn {t + 1}" for t in range(args.turns)) + " | turn 8 / turn 1 (p50) |",
            "|---:|---|" + "---:|" * (args.turns + 1)]
    ratio = {}
    for n in chats:
        for mode in modes:
            per = ttfts[(n, mode)]
            cells = [f"{pct(per[t], 0.5) * 1e3:.1f} / {pct(per[t], 0.99) * 1e3:.1f}" for t in range(args.turns)]
            ratio[(n, mode)] = pct(per[args.turns - 1], 0.5) / pct(per[0], 0.5)
            doc.append(f"| {n} | {mode} | " + " | ".join(cells) + f" | {ratio[(n, mode)]:.2f}x |")
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
    targets = [(f"TTFT turn {args.turns} / turn 1 with sessions <= 1.2x (chats {n}): {ratio[(n, 'sessions')]:.2f}x",
                ratio[(n, "sessions")] <= 1.2) for n in chats]
    if 4 in chats:
        gain = med[(4, "sessions")] / med[(4, "serialised")]
        targets.append((f"4 chats: tokens/s >= 2.5x the serialised worker (GPU goal): {gain:.2f}x", gain >= 2.5))
    targets.append((f"server overhead per generated token < 5%: {overhead * 100:+.1f}%", overhead < 0.05))
    doc += ["## Targets", "", "| target | |", "|---|---|"]
    doc += [f"| {t} | {'met' if ok else 'MISSED'} |" for t, ok in targets]
    text = "\n".join(doc) + "\n"
    out = args.out or str(ROOT / "bench" / f"RESULTS_serve_{device.split(':')[0]}.md")
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
