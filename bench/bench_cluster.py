"""The server on a Ray Serve cluster against one server (issue 21).

    python bench/bench_cluster.py [--device cpu|cuda] [--rounds 3] [--chats 32] [--turns 3] [--tokens 32]
                                  [--replicas 1,2] [--affinity-replicas 2,4] [--requests 100]

Serves bench_serve's model (exported once, cached) on 127.0.0.1:
``aoti-sessions serve`` alone (one process, ``--no-engine-process``: the
engine beside HTTP, as a replica runs it) and ``aoti-sessions serve
--replicas N`` for each ``--replicas`` count, one cluster at a time (each
its own local Ray cluster; CPU replicas take the threads the single server
gets, CUDA replicas one GPU each). Per round:

- overhead (the first count's rounds): one chat on the cluster and one on
  the server alone, turn by turn in lockstep, ``--turns`` turns of
  ``--tokens`` tokens (not streamed): seconds per generated token against
  the server alone, and each turn's added milliseconds (routing:
  the front, the router, the replica's call, the checkpoint after each turn);
  first on a cluster of Serve's default settings, then of ours
  (``cluster/_env.py``: Serve's throughput-optimized mode); and a request's
  fixed cost: ``--requests`` one-token replies on each, in turn;
- throughput: ``--chats`` chats at once, each ``--turns`` turns: generated
  tokens/s of each cluster, and the largest count against the first;
- checkpoint cost on the request path: the seconds requests waited for a
  checkpoint write (the replicas' ``checkpoint_wait_seconds_total``) against
  the turns' own seconds; and the writes' time, off the path.

Then affinity: 40 chats of 3 turns on clusters of ``--affinity-replicas``
replicas; the share of follow-up turns that reused their session's cache
(``cached_tokens > 0``). Writes bench/RESULTS_cluster_<device>.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_serve  # noqa: E402  (its model, server start and helpers)

import httpx  # noqa: E402

from serving import descendants, metrics  # noqa: E402


def message(chat: int, turn: int) -> str:
    return f"Chat {chat}, turn {turn}: tell me more about the river and the old mill by the bridge."


async def one_turn(client: httpx.AsyncClient, messages: list[dict[str, str]], chat_id: int, turn: int, tokens: int,
                   session: str, log: list[tuple[float, int, int, int]]) -> None:
    """One turn of a chat (non-streamed); its (seconds, generated, cached,
    turn) goes to ``log``, the reply to ``messages``."""
    messages.append({"role": "user", "content": message(chat_id, turn)})
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "session_id": session})
    if response.status_code != 200:
        raise RuntimeError(f"{session}: {response.status_code} {response.text[:300]}")
    body = response.json()
    usage = body["usage"]
    log.append((time.perf_counter() - started, usage["completion_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"], turn))
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})


async def chat(client: httpx.AsyncClient, chat_id: int, turns: int, tokens: int, tag: str,
               log: list[tuple[float, int, int, int]]) -> None:
    """One chat's turns; each turn's record goes to ``log``."""
    messages: list[dict[str, str]] = []
    for turn in range(turns):
        await one_turn(client, messages, chat_id, turn, tokens, f"{tag}-{chat_id}", log)


def run(base: str, chats: int, turns: int, tokens: int, tag: str) -> tuple[float, list[tuple[float, int, int, int]]]:
    """``chats`` chats at once; wall seconds and every turn's record."""
    log: list[tuple[float, int, int, int]] = []

    async def main() -> float:
        limits = httpx.Limits(max_connections=chats + 4)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
            started = time.perf_counter()
            await asyncio.gather(*[chat(client, i, turns, tokens, tag, log) for i in range(chats)])
            wall = time.perf_counter() - started
            await asyncio.gather(*[client.delete(f"/v1/sessions/{tag}-{i}") for i in range(chats)])  # (room)
            return wall

    return asyncio.run(main()), log


@contextlib.asynccontextmanager
async def clients(bases: dict[str, str]) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    """One client per server, by the servers' names."""
    opened = {name: httpx.AsyncClient(base_url=url, timeout=600) for name, url in bases.items()}
    try:
        yield opened
    finally:
        for client in opened.values():
            await client.aclose()


def lockstep(bases: dict[str, str], turns: int, tokens: int, tag: str) -> dict[str, list[float]]:
    """One chat on each server, turn by turn in turn (server A's turn 1, B's
    turn 1, A's turn 2, ...): each server's seconds per turn, so that the
    machine's drift between the two is shared."""
    logs: dict[str, list[tuple[float, int, int, int]]] = {name: [] for name in bases}
    messages: dict[str, list[dict[str, str]]] = {name: [] for name in bases}

    async def main() -> None:
        async with clients(bases) as opened:
            for turn in range(turns):
                for name, client in opened.items():
                    await one_turn(client, messages[name], 0, turn, tokens, f"{tag}-{name}", logs[name])

    asyncio.run(main())
    for name, log in logs.items():
        if any(t[1] != tokens for t in log):
            raise RuntimeError(f"{name}: a turn generated other than {tokens} tokens")
    return {name: [t[0] for t in log] for name, log in logs.items()}


def request_cost(bases: dict[str, str], requests: int, tag: str) -> dict[str, list[float]]:
    """What a request costs beyond its generation: ``requests`` one-token
    replies, each in a new session, sent to each server in turn (A, B, A,
    ...); each server's seconds per request."""
    seconds: dict[str, list[float]] = {name: [] for name in bases}

    async def main() -> None:
        async with clients(bases) as opened:
            for i in range(requests):
                for name, client in opened.items():
                    log: list[tuple[float, int, int, int]] = []
                    await one_turn(client, [], i, 0, 1, f"{tag}-{name}-{i}", log)
                    seconds[name].append(log[0][0])
                    await client.delete(f"/v1/sessions/{tag}-{name}-{i}")

    asyncio.run(main())
    return seconds


def spread(xs: list[float], digits: int = 3) -> str:
    return f"{min(xs):.{digits}f} / {statistics.median(xs):.{digits}f} / {max(xs):.{digits}f}"


def cluster_counters(base: str) -> dict[str, float]:
    with httpx.Client(base_url=base, timeout=60) as http:
        seen = metrics(http)
    return {k: seen.get(k, 0.0) for k in ("aoti_sessions_checkpoint_wait_seconds_total",
                                          "aoti_sessions_checkpoint_seconds_total",
                                          "aoti_sessions_checkpoints_total")}


GROUPS = (("engine processes", b"aoti_sessions.llm._engine_main"), ("replicas", b"ServeReplica"),
          ("front (command)", None), ("Ray and Serve (other)", b""))


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root`` and every process under
    it, by GROUPS (``root`` itself: the command's front)."""
    out = dict.fromkeys((name for name, _ in GROUPS), 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        for name, mark in GROUPS:
            if (pid == root) if mark is None else (mark in command):
                out[name] += seconds
                break
    return out


@contextlib.contextmanager
def cluster(package: Path, args: argparse.Namespace, replicas: int, work: Path,
            env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """``aoti-sessions serve --replicas N`` (its own local Ray cluster) on a
    free port until the block ends, ``env`` added to its environment; yields
    its base URL and the command's process id."""
    port = bench_serve.free_port()
    log = work / f"cluster-{replicas}{'-env' if env else ''}.log"
    threads = ["--threads", str(args.threads)] if args.device.startswith("cpu") else []
    engine = [] if args.engine_process else ["--no-engine-process"]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--replicas",
                                 str(replicas), "--port", str(port), "--device", args.device, "--max-sessions", "512",
                                 "--session-dir", str(work / f"sessions-{replicas}"), *threads, *engine],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=5).json().get("replicas") == replicas:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        run(base, 2, 2, 4, "warm")
        yield base, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--affinity-replicas", default="2,4")
    parser.add_argument("--requests", type=int, default=100, help="one-token requests measuring a request's cost")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each engine (CPU device)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the server alone and every replica run their engine in an engine process (as "
                             "aoti-sessions serve does by default)")
    parser.add_argument("--serve-defaults", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the overhead of a cluster of Serve's default settings")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cpu = args.device.startswith("cpu")
    counts = [int(n) for n in args.replicas.split(",")]
    affinity_counts = [int(n) for n in args.affinity_replicas.split(",") if n]
    package = bench_serve.bench_package(args.device)
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    lines = [f"# Cluster against one server ({args.device})", "",
             f"`python bench/bench_cluster.py --device {args.device} --rounds {args.rounds} --chats {args.chats} "
             f"--turns {args.turns} --tokens {args.tokens} --replicas {args.replicas} "
             f"--affinity-replicas {args.affinity_replicas} --requests {args.requests}`", "",
             f"Model: bench_serve's ({package.name}); {os.cpu_count()} CPUs; every server on 127.0.0.1.", ""]
    if not cpu:
        import torch

        lines += [f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}", ""]

    port = bench_serve.free_port()
    single = bench_serve.start_server(package, args.device, port, work / "single.log",
                                      args.threads if cpu else None, [] if args.engine_process else
                                      ["--no-engine-process"])
    single_base = f"http://127.0.0.1:{port}"
    # Overhead, by the cluster's Serve settings: ours (cluster/_env.py) and
    # Serve's defaults (its throughput-optimized mode off), measured alike.
    overhead: dict[str, list[float]] = {"ours": [], "defaults": []}
    added_ms: dict[str, list[float]] = {"ours": [], "defaults": []}  # a cluster turn less the server alone's
    sequential_waits: list[float] = []  # checkpoint wait, % of the cluster's turn time, one chat at a time
    per_token: dict[str, list[float]] = {"single": [], "ours": [], "defaults": []}
    rates: dict[int, list[float]] = {n: [] for n in counts}
    waits: dict[int, list[float]] = {n: [] for n in counts}
    writes: dict[int, list[float]] = {n: [] for n in counts}
    alone_rates: list[float] = []  # the server alone's tokens/s under the same load, in the same rounds
    cores: dict[int, list[dict[str, float]]] = {n: [] for n in counts}  # CPU cores busy by process group

    request_ms: dict[str, list[float]] = {"single": [], "ours": [], "defaults": []}  # one-token requests

    def request_round(base: str, settings: str) -> None:
        """A request's fixed cost: one-token replies, alternating servers."""
        seconds = request_cost({"single": single_base, "cluster": base}, args.requests, f"q-{settings}")
        request_ms["single"] += [1e3 * t for t in seconds["single"]]
        request_ms[settings] += [1e3 * (c - s) for s, c in zip(seconds["single"], seconds["cluster"])]

    def overhead_round(base: str, settings: str, r: int) -> None:
        """One chat on the cluster and one on the server alone, in lockstep."""
        before = cluster_counters(base)
        turns = lockstep({"single": single_base, "cluster": base}, args.turns, args.tokens, f"o{r}-{settings}")
        after = cluster_counters(base)
        for name, key in (("single", "single"), ("cluster", settings)):
            per_token[key].append(1e3 * sum(turns[name]) / (args.turns * args.tokens))
        added_ms[settings] += [1e3 * (c - s) for s, c in zip(turns["single"], turns["cluster"])]
        if settings == "ours":
            sequential_waits.append(100 * (after["aoti_sessions_checkpoint_wait_seconds_total"] -
                                           before["aoti_sessions_checkpoint_wait_seconds_total"])
                                    / sum(turns["cluster"]))
        overhead[settings].append(sum(turns["cluster"]) / sum(turns["single"]))

    try:
        run(single_base, 2, 2, 4, "warm")
        if args.serve_defaults:
            with cluster(package, args, counts[0], work, env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}) as (base, _):
                request_round(base, "defaults")
                for r in range(args.rounds):
                    overhead_round(base, "defaults", r)
                    print(f"Serve's defaults, round {r}: overhead {overhead['defaults'][-1]:.3f}x", flush=True)
        # One cluster at a time (on GPUs, each replica holds one), its rounds;
        # the first one's rounds interleaved with the server alone's.
        for n in counts:
            with cluster(package, args, n, work) as (base, pid):
                if n == counts[0]:
                    request_round(base, "ours")
                for r in range(args.rounds):
                    if n == counts[0]:  # overhead: one chat at a time
                        overhead_round(base, "ours", r)
                        wall, log = run(single_base, args.chats, args.turns, args.tokens, f"a{r}")
                        alone_rates.append(sum(t[1] for t in log) / wall)
                    before, busy = cluster_counters(base), cpu_seconds(pid)
                    wall, log = run(base, args.chats, args.turns, args.tokens, f"t{r}")
                    after, used = cluster_counters(base), cpu_seconds(pid)
                    cores[n].append({k: (used[k] - busy.get(k, 0.0)) / wall for k in used})
                    rates[n].append(sum(t[1] for t in log) / wall)
                    waited = after["aoti_sessions_checkpoint_wait_seconds_total"] - \
                        before["aoti_sessions_checkpoint_wait_seconds_total"]
                    waits[n].append(100 * waited / sum(t[0] for t in log))
                    written = after["aoti_sessions_checkpoints_total"] - before["aoti_sessions_checkpoints_total"]
                    writes[n].append(1e3 * (after["aoti_sessions_checkpoint_seconds_total"]
                                            - before["aoti_sessions_checkpoint_seconds_total"]) / max(1.0, written))
                    print(f"{n} replicas, round {r}: {rates[n][-1]:.0f} tokens/s"
                          + (f" (alone {alone_rates[-1]:.0f}), overhead {overhead['ours'][-1]:.3f}x"
                             if n == counts[0] else "")
                          + "; cores: " + ", ".join(f"{k} {v:.2f}" for k, v in cores[n][-1].items()), flush=True)
        write(report(args, counts, lines, per_token, overhead, added_ms, request_ms, sequential_waits, rates,
                     alone_rates, waits, writes, cores), args)
        affinity: list[str] = []
        if affinity_counts:
            affinity += ["", "## Affinity: 40 chats x 3 turns", "",
                      "| replicas | follow-up turns | reused their cache (cached_tokens > 0) |", "|---:|---:|---:|"]
        for n in affinity_counts:
            with cluster(package, args, n, work) as (base, _):
                _, log = run(base, 40, 3, 8, "aff")
            follow_ups = [t for t in log if t[3] > 0]
            reused = sum(1 for t in follow_ups if t[2] > 0)
            affinity.append(f"| {n} | {len(follow_ups)} | {reused} ({100 * reused / len(follow_ups):.0f}%) |")
        write(report(args, counts, lines, per_token, overhead, added_ms, request_ms, sequential_waits, rates,
                     alone_rates, waits, writes, cores) + affinity, args)
    finally:
        single.terminate()
        single.wait(60)


def write(lines: list[str], args: argparse.Namespace) -> None:
    """The results so far (written after each phase: a run stopped midway keeps them)."""
    out = Path(args.out or ROOT / "bench" / f"RESULTS_cluster_{args.device.split(':')[0]}.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def report(args: argparse.Namespace, counts: list[int], head: list[str], per_token: dict[str, list[float]],
           overhead: dict[str, list[float]], added_ms: dict[str, list[float]], request_ms: dict[str, list[float]],
           sequential_waits: list[float], rates: dict[int, list[float]], alone_rates: list[float],
           waits: dict[int, list[float]], writes: dict[int, list[float]],
           cores: dict[int, list[dict[str, float]]]) -> list[str]:
    engine = "in an engine process" if args.engine_process else "in the serving process (--no-engine-process)"
    names = {"single": "aoti-sessions serve alone",
             "ours": f"{counts[0]} replica cluster (Serve throughput-optimized, cluster/_env.py)",
             "defaults": f"{counts[0]} replica cluster (Serve's defaults)"}
    settings = [k for k in ("ours", "defaults") if overhead[k]]
    lines = [*head, f"Every engine (the server alone's, each replica's) {engine}.", "",
             "## Routing overhead per generated token (one chat at a time)", "",
             f"One chat on a cluster and one on the server alone, turn by turn in lockstep; {args.rounds} rounds "
             f"of {args.turns} turns of {args.tokens} tokens for each of the cluster's Serve settings.", "",
             "| server | ms per generated token (min / median / max) |", "|---|---|"]
    lines += [f"| {names[k]} | {spread(v)} |" for k, v in per_token.items() if v]
    lines += ["", "| cluster's Serve settings | against the server alone, per round (min / median / max) | "
                  "a turn's added ms (each cluster turn less the server alone's same turn) |", "|---|---|---|"]
    lines += [f"| {names[k]} | {spread(overhead[k])} x (median {100 * (statistics.median(overhead[k]) - 1):+.1f}%) "
              f"| {spread(added_ms[k], 2)} ({len(added_ms[k])} turns) |" for k in settings]
    single_token = statistics.median(per_token["single"])
    lines += ["", f"A request's cost beyond its generation: {args.requests} one-token replies (each in a new "
                  "session, short prompt) per setting, alternating with the server alone "
                  f"(median {statistics.median(request_ms['single']):.2f} ms a request there):", "",
              "| cluster's Serve settings | added ms a request (min / median / max) | "
              f"as a share of a {args.tokens}-token turn's generation (median added / "
              f"({args.tokens} x the server alone's median {single_token:.3f} ms a token)) |", "|---|---|---|"]
    lines += [f"| {names[k]} | {spread(request_ms[k], 2)} | "
              f"{100 * statistics.median(request_ms[k]) / (args.tokens * single_token):+.1f}% |" for k in settings]
    lines += ["", f"Of the cluster's turns' time (ours), waiting for a checkpoint write: {spread(sequential_waits)} %.",
              "", f"## Throughput, {args.chats} chats at once ({args.turns} turns of {args.tokens} tokens)", "",
              "| server | generated tokens/s (min / median / max) | checkpoint wait, % of turn time | "
              "checkpoint write, ms each (off the request path) |", "|---|---|---|---|"]
    lines += [f"| aoti-sessions serve alone (in {counts[0]}-replica rounds) | {spread(alone_rates, 0)} | - | - |"]
    lines += [f"| {n} replica{'s' if n > 1 else ''} | {spread(rates[n], 0)} | {spread(waits[n], 3)} | "
              f"{spread(writes[n], 2)} |" for n in counts if rates[n]]
    done = [n for n in counts if rates[n]]
    if len(done) > 1:
        lines += ["", f"{done[-1]} replicas against {done[0]}, median tokens/s: "
                      f"{statistics.median(rates[done[-1]]) / statistics.median(rates[done[0]]):.2f} x "
                      f"(worst round of {done[-1]} against best of {done[0]}: "
                      f"{min(rates[done[-1]]) / max(rates[done[0]]):.2f} x)."]
    groups = [name for name, _ in GROUPS]
    lines += ["", "CPU cores busy during the throughput runs (median over rounds; /proc of the command and every "
                  "process under it):", "", "| replicas | " + " | ".join(groups) + " |",
              "|---:|" + "---:|" * len(groups)]
    lines += [f"| {n} | " + " | ".join(f"{statistics.median(c[g] for c in cores[n]):.2f}" for g in groups) + " |"
              for n in done]
    return lines


if __name__ == "__main__":
    main()
