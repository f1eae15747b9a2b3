"""Time to first token of a stateless request repeating a 1,000-token system
prompt, with and without the prefix cache (issue 36, item 5).

    python bench/bench_prefix.py [--device cpu] [--rounds 20] [--system-tokens 1000] [--tiny] [--no-server]

Each round sends the system prompt and a new user message (greedy, 4
tokens) on a session made for it, as a request without a session id gets:

- in process: ``LLM.new_session(prompt, cache=NAME)`` (with: a fork of the
  kept session) or ``LLM.new_session()`` (without), then ``start`` and the
  first piece;
- through the server (``aoti-sessions serve``, its engine process), a
  streamed chat completion without a session id, to its first content
  chunk: a server with the prefix cache (the default) and one with
  ``--prefix-cache 0``, rounds interleaved.

Two warm-up rounds each first (the first fills the cache). One line per
configuration: time to first token in ms, min / median / max over rounds,
and the prompt's cached tokens. The model is bench_serve's (a random-weight
Qwen3, 4 layers, hidden 256, float32 on the CPU; its context of 1024 holds
a system prompt of about 985 tokens with the rest), or with ``--tiny`` the
tests' 2-layer one of 2048 positions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (its model and server; sets the cache folder and tests/ on the path)

from aoti_sessions.llm import LLM  # noqa: E402
from llm_models import TEXT  # noqa: E402

TOKENS = 4
WARMUP = 2


def system_prompt(llm: LLM, tokens: int) -> str:
    """Text of exactly ``tokens`` tokens (or one more), from the tests' text."""
    words, text, i = TEXT.split(), "You are a helpful assistant.", 0
    while (count := len(llm.encode(text))) < tokens:
        step = 16 if count < tokens - 64 else 1
        text += " " + " ".join(words[i % len(words):i % len(words) + step])
        i += step
    return text


def messages(system: str, n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Round {n}: hello?"}]


def in_process(llm: LLM, system: str, rounds: int) -> dict[str, tuple[list[float], list[int]]]:
    out: dict[str, tuple[list[float], list[int]]] = {"with": ([], []), "without": ([], [])}
    for n in range(WARMUP + rounds):
        for mode in ("with", "without"):
            prompt = messages(system, n * 2 + (mode == "with"))
            start = time.perf_counter()
            session = llm.new_session(prompt, cache="bench") if mode == "with" else llm.new_session()
            with session, session.start(prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True) as g:
                g.step()
                took = time.perf_counter() - start
            if n >= WARMUP:
                out[mode][0].append(took * 1e3)
                out[mode][1].append(g.cached_tokens)
    return out


def through_server(package: Path, device: str, system: str, rounds: int,
                   threads: int | None) -> dict[str, tuple[list[float], list[int]]]:
    out: dict[str, tuple[list[float], list[int]]] = {"with": ([], []), "without": ([], [])}
    servers: dict[str, Any] = {}
    clients: dict[str, httpx.Client] = {}
    with tempfile.TemporaryDirectory() as folder:
        try:
            for mode, extra in (("with", []), ("without", ["--prefix-cache", "0"])):
                port = bench_serve.free_port()
                servers[mode] = bench_serve.start_server(package, device, port, Path(folder) / f"{mode}.log",
                                                         threads, extra)
                clients[mode] = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
            model = clients["with"].get("/v1/models").json()["data"][0]["id"]
            for n in range(WARMUP + rounds):
                for mode in ("with", "without"):
                    body = {"model": model, "messages": messages(system, n), "max_tokens": TOKENS,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
                    start, first, cached = time.perf_counter(), None, 0
                    with clients[mode].stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                                first = time.perf_counter() - start
                            if event.get("usage"):
                                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if n >= WARMUP and first is not None:
                        out[mode][0].append(first * 1e3)
                        out[mode][1].append(cached)
        finally:
            for client in clients.values():
                client.close()
            for proc in servers.values():
                proc.terminate()
                proc.wait(60)
    return out


def line(where: str, mode: str, times: list[float], cached: list[int], prompt: int) -> str:
    return (f"{where:10s} {mode:7s} cache: time to first token {min(times):7.2f} / {statistics.median(times):7.2f} / "
            f"{max(times):7.2f} ms (min / median / max, {len(times)} rounds); cached {min(cached)}-{max(cached)} "
            f"of {prompt} prompt tokens")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--tiny", action="store_true", help="the tests' 2-layer Qwen3 of 2048 positions")
    parser.add_argument("--no-server", action="store_true", help="in process only")
    args = parser.parse_args()
    if args.tiny:
        from tool_models import tools_package

        package = tools_package(args.device)
    else:
        package = bench_serve.bench_package(args.device)
    threads = bench_serve.compute_threads(None, args.device)
    with LLM(package, args.device, threads=threads) as llm:
        system = system_prompt(llm, args.system_tokens)
        prompt = len(llm.chat_tokens(messages(system, 0)))
        if (over := prompt + TOKENS + 2 - llm.max_context) > 0:  # (the model's context is short of it: shorter)
            system = system_prompt(llm, args.system_tokens - over)
            prompt = len(llm.chat_tokens(messages(system, 0)))
        print(f"{llm.name}: {llm.spec.architecture}, context {llm.max_context}, {args.device}, {threads} threads; "
              f"system prompt {len(llm.encode(system))} tokens, prompt {prompt}", flush=True)
        results = {"in process": in_process(llm, system, args.rounds)}
    if not args.no_server:
        results["server"] = through_server(package, args.device, system, args.rounds, threads)
    for where, modes in results.items():
        for mode, (times, cached) in modes.items():
            print(line(where, mode, times, cached, prompt))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
