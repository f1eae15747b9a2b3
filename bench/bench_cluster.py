"""The server on a Ray Serve cluster against one server (issue 21).

    python bench/bench_cluster.py [--device cpu|cuda] [--rounds 3] [--chats 32] [--turns 3] [--tokens 32]
                                  [--replicas 1,2] [--affinity-replicas 2,4] [--requests 100]

Serves bench_serve's model (exported once, cached) on 127.0.0.1:
``aoti-sessions serve`` alone (its engine in an engine process, as a
replica's, unless ``--no-engine-process``) and ``aoti-sessions serve
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
  tokens/s of the server alone, of each cluster, and (``--servers-alone``)
  of N servers alone beside an N-replica cluster, the chats split among
  them by the client (on CUDA one a GPU): what the hardware gives the load
  without a router, the ceiling of the N-replica cluster; each engine's
  step loop (steps/s, decode rows a step, where a step's time goes) and
  the CPU cores busy, by process group;
- checkpoint cost on the request path: the seconds requests waited for a
  checkpoint write (the replicas' ``checkpoint_wait_seconds_total``) against
  the turns' own seconds; and the writes' time, off the path.

Then affinity: 40 chats of 3 turns on clusters of ``--affinity-replicas``
replicas; the share of follow-up turns that reused their session's cache
(``cached_tokens > 0``). Writes bench/results/cluster_<device>.md.
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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_serve  # noqa: E402  (its model, server start and helpers)

import httpx  # noqa: E402

from serving import descendants, metrics  # noqa: E402

K = TypeVar("K")  # a server's name


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


def run(bases: list[str], chats: int, turns: int, tokens: int, tag: str,
        before_deletes: Callable[[], None] | None = None) -> tuple[float, list[tuple[float, int, int, int]]]:
    """``chats`` chats at once, chat ``i`` on ``bases[i % len(bases)]``, then
    their sessions deleted (``before_deletes`` called first); wall seconds
    and every turn's record."""
    log: list[tuple[float, int, int, int]] = []

    async def main() -> float:
        async with clients(dict(enumerate(bases)), httpx.Limits(max_connections=chats + 4)) as opened:
            on = [opened[i % len(bases)] for i in range(chats)]
            started = time.perf_counter()
            await asyncio.gather(*[chat(on[i], i, turns, tokens, tag, log) for i in range(chats)])
            wall = time.perf_counter() - started
            if before_deletes is not None:
                await asyncio.to_thread(before_deletes)
            await asyncio.gather(*[on[i].delete(f"/v1/sessions/{tag}-{i}") for i in range(chats)])  # (room)
            return wall

    return asyncio.run(main()), log


@contextlib.asynccontextmanager
async def clients(bases: dict[K, str],
                  limits: httpx.Limits | None = None) -> AsyncIterator[dict[K, httpx.AsyncClient]]:
    """One client per server, by the servers' names (``limits``: each
    client's connection pool; unbounded if None)."""
    opened = {name: httpx.AsyncClient(base_url=url, timeout=600, limits=limits or httpx.Limits())
              for name, url in bases.items()}
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


CHECKPOINTS = ("aoti_sessions_checkpoint_wait_seconds_total", "aoti_sessions_checkpoint_seconds_total",
               "aoti_sessions_checkpoints_total")
PHASES = ("wait", "queue", "text")  # the step loop's time a step (serve/_metrics.py)
STEPS = ("aoti_sessions_steps_total", "aoti_sessions_decode_rows_total",
         *(f'aoti_sessions_step_seconds_total{{phase="{p}"}}' for p in PHASES))


def counters(bases: list[str]) -> dict[str, float]:
    """The checkpoint and step loop counters, summed over the servers at
    ``bases`` (a cluster's /metrics: its totals over replicas)."""
    out = dict.fromkeys(CHECKPOINTS + STEPS, 0.0)
    for base in bases:
        with httpx.Client(base_url=base, timeout=60) as http:
            seen = metrics(http)
        for k in out:
            out[k] += seen.get(k, 0.0)
    return out


GROUPS = (("engine processes", b"aoti_sessions.llm.process._engine_main"), ("replicas", b"ServeReplica"),
          ("front (command)", None), ("Ray and Serve (other)", b""))


def cpu_seconds(roots: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each of ``roots`` and every
    process under them, by GROUPS (a root itself: the command's front)."""
    out = dict.fromkeys((name for name, _ in GROUPS), 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    for root in roots:
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


def gpus_of(root: int) -> list[str]:
    """The GPUs (bus ids) on which ``root`` or a process under it holds
    memory, by nvidia-smi; empty without it."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    mine = descendants(root)
    return sorted({bus.strip() for pid, _, bus in (line.partition(",") for line in listed.splitlines())
                   if pid.strip().isdigit() and int(pid) in mine})


@dataclass
class Load:
    """One throughput run (``--chats`` chats at once) on a set of servers."""
    rate: float  # generated tokens/s
    wait: float  # waiting for a checkpoint write, % of the turns' time
    write: float  # ms a checkpoint write (off the request path)
    writes: int  # checkpoints written (back-to-back turns are written once, after the last)
    cores: dict[str, float]  # CPU cores busy, by GROUPS
    steps: dict[str, float]  # each engine's step loop: steps/s, decode rows a step, ms a step by PHASES


def load(bases: list[str], roots: list[int], engines: int, args: argparse.Namespace, tag: str) -> Load:
    """``--chats`` chats at once over ``bases`` (servers of ``engines``
    engines in all, their processes under ``roots``)."""
    before, busy = counters(bases), cpu_seconds(roots)
    read: dict[str, dict[str, float]] = {}

    def at_end() -> None:  # (before the deletes, which wait for the writes under way)
        read["counters"], read["cpu"] = counters(bases), cpu_seconds(roots)

    wall, log = run(bases, args.chats, args.turns, args.tokens, tag, at_end)
    after, used = read["counters"], read["cpu"]
    d = {k: after[k] - before[k] for k in after}
    steps = max(d["aoti_sessions_steps_total"], 1.0)
    return Load(rate=sum(t[1] for t in log) / wall,
                wait=100 * d["aoti_sessions_checkpoint_wait_seconds_total"] / sum(t[0] for t in log),
                write=1e3 * d["aoti_sessions_checkpoint_seconds_total"]
                / max(1.0, d["aoti_sessions_checkpoints_total"]),
                writes=int(d["aoti_sessions_checkpoints_total"]),
                cores={k: (used[k] - busy[k]) / wall for k in used},
                steps={"steps/s": d["aoti_sessions_steps_total"] / wall / engines,
                       "rows/step": d["aoti_sessions_decode_rows_total"] / steps,
                       **{p: 1e3 * d[f'aoti_sessions_step_seconds_total{{phase="{p}"}}'] / steps for p in PHASES}})


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
        run([base], 2, 2, 4, "warm")
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
    parser.add_argument("--servers-alone", action=argparse.BooleanOptionalAction, default=True,
                        help="beside each cluster of N > 1 replicas, N servers alone (one a GPU on CUDA) with the "
                             "chats split among them by the client: what the hardware gives the load, no router")
    parser.add_argument("--overhead-rounds", type=int, default=0,
                        help="rounds of the overhead measurement (one chat at a time, in lockstep; at least --rounds)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.overhead_rounds = max(args.overhead_rounds, args.rounds)
    cpu = args.device.startswith("cpu")
    counts = [int(n) for n in args.replicas.split(",")]
    affinity_counts = [int(n) for n in args.affinity_replicas.split(",") if n]
    package = bench_serve.bench_package(args.device)
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    gpus = 0
    lines = [f"# Cluster against one server ({args.device})", "",
             f"`python bench/bench_cluster.py --device {args.device} --rounds {args.rounds} --chats {args.chats} "
             f"--turns {args.turns} --tokens {args.tokens} --replicas {args.replicas} "
             f"--affinity-replicas {args.affinity_replicas} --requests {args.requests} "
             f"--overhead-rounds {args.overhead_rounds}`", "",
             f"Model: bench_serve's ({package.name}); {os.cpu_count()} CPUs; every server on 127.0.0.1.", ""]
    if not cpu:
        import torch

        gpus = torch.cuda.device_count()
        lines += [f"GPUs: {gpus} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}", ""]
    engine_args = [] if args.engine_process else ["--no-engine-process"]

    def server(name: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
        port = bench_serve.free_port()
        proc = bench_serve.start_server(package, args.device, port, work / f"{name}.log",
                                        args.threads if cpu else None, engine_args, env)
        base = f"http://127.0.0.1:{port}"
        run([base], 2, 2, 4, "warm")
        return proc, base

    single, single_base = server("single")
    r = Results(args, counts)

    def request_round(base: str, settings: str) -> None:
        """A request's fixed cost: one-token replies, alternating servers."""
        seconds = request_cost({"single": single_base, "cluster": base}, args.requests, f"q-{settings}")
        r.request_ms["single"] += [1e3 * t for t in seconds["single"]]
        r.request_ms[settings] += [1e3 * (c - s) for s, c in zip(seconds["single"], seconds["cluster"])]

    def overhead_round(base: str, settings: str, i: int) -> None:
        """One chat on the cluster and one on the server alone, in lockstep."""
        before = counters([base])
        turns = lockstep({"single": single_base, "cluster": base}, args.turns, args.tokens, f"o{i}-{settings}")
        after = counters([base])
        for name, key in (("single", "single"), ("cluster", settings)):
            r.per_token[key].append(1e3 * sum(turns[name]) / (args.turns * args.tokens))
        r.added_ms[settings] += [1e3 * (c - s) for s, c in zip(turns["single"], turns["cluster"])]
        if settings == "ours":
            r.sequential_waits.append(100 * (after["aoti_sessions_checkpoint_wait_seconds_total"] -
                                             before["aoti_sessions_checkpoint_wait_seconds_total"])
                                      / sum(turns["cluster"]))
        r.overhead[settings].append(sum(turns["cluster"]) / sum(turns["single"]))

    def extra_servers(n: int) -> list[tuple[subprocess.Popen[bytes], str]]:
        """With the server alone, n servers alone (on CUDA one a GPU: the
        server alone holds the first)."""
        if n < 2 or not args.servers_alone or (not cpu and gpus < n):
            return []
        return [server(f"alone-{i}", None if cpu else {"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(1, n)]

    try:
        if args.serve_defaults:
            with cluster(package, args, counts[0], work, env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}) as (base, _):
                request_round(base, "defaults")
                for i in range(args.rounds):
                    overhead_round(base, "defaults", i)
                    print(f"Serve's defaults, round {i}: overhead {r.overhead['defaults'][-1]:.3f}x", flush=True)
        # One cluster at a time (on GPUs, each replica holds one), its rounds;
        # the first one's rounds interleaved with the server alone's, the
        # others' with as many servers alone.
        for n in counts:
            with cluster(package, args, n, work) as (base, pid):
                if not cpu:
                    r.placement[n] = gpus_of(pid)
                extra = extra_servers(n)
                try:
                    if n == counts[0]:
                        request_round(base, "ours")
                    for i in range(args.rounds):
                        runs: dict[str, Load] = {}
                        if n == counts[0]:  # overhead: one chat at a time
                            overhead_round(base, "ours", i)
                            runs["alone"] = load([single_base], [single.pid], 1, args, f"a{i}")
                        runs[f"{n} replicas"] = load([base], [pid], n, args, f"t{i}")
                        if extra:
                            runs[f"{n} alone"] = load([single_base] + [b for _, b in extra],
                                                      [single.pid] + [p.pid for p, _ in extra], n, args, f"s{i}")
                        for key, run_ in runs.items():
                            r.loads.setdefault(key, []).append(run_)
                        print(f"{n} replicas, round {i}: " + "; ".join(f"{k} {v.rate:.0f} tokens/s"
                                                                       for k, v in runs.items())
                              + (f"; overhead {r.overhead['ours'][-1]:.3f}x" if n == counts[0] else ""), flush=True)
                    if n == counts[0]:  # more overhead rounds: one chat at a time is the noisier measure
                        for i in range(args.rounds, args.overhead_rounds):
                            overhead_round(base, "ours", i)
                finally:
                    for p, _ in extra:
                        p.terminate()
                        p.wait(60)
            write(r.report(lines), args)
        affinity: list[str] = []
        if affinity_counts:
            affinity += ["", "## Affinity: 40 chats x 3 turns", "",
                         "| replicas | follow-up turns | reused their cache (cached_tokens > 0) |", "|---:|---:|---:|"]
        for n in affinity_counts:
            with cluster(package, args, n, work) as (base, _):
                _, log = run([base], 40, 3, 8, "aff")
            follow_ups = [t for t in log if t[3] > 0]
            reused = sum(1 for t in follow_ups if t[2] > 0)
            affinity.append(f"| {n} | {len(follow_ups)} | {reused} ({100 * reused / len(follow_ups):.0f}%) |")
        write(r.report(lines) + affinity, args)
    except BaseException:
        for server_log in sorted(work.glob("*.log")):  # what the servers said, for a run that failed
            print(f"--- {server_log.name} (its end):\n{server_log.read_text(errors='replace')[-4000:]}", flush=True)
        raise
    finally:
        single.terminate()
        single.wait(60)


def write(lines: list[str], args: argparse.Namespace) -> None:
    """The results so far (written after each phase: a run stopped midway keeps them)."""
    out = Path(args.out or ROOT / "bench" / "results" / f"cluster_{args.device.split(':')[0]}.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class Results:
    """Every figure of a run, and its report."""

    def __init__(self, args: argparse.Namespace, counts: list[int]) -> None:
        self.args, self.counts = args, counts
        self.overhead: dict[str, list[float]] = {"ours": [], "defaults": []}  # cluster / alone, per round
        self.added_ms: dict[str, list[float]] = {"ours": [], "defaults": []}  # a cluster turn less the alone's
        self.sequential_waits: list[float] = []  # checkpoint wait, % of the cluster's turn time, one chat
        self.per_token: dict[str, list[float]] = {"single": [], "ours": [], "defaults": []}
        self.request_ms: dict[str, list[float]] = {"single": [], "ours": [], "defaults": []}  # one-token
        self.loads: dict[str, list[Load]] = {}  # "alone", "N replicas", "N alone": per round
        self.placement: dict[int, list[str]] = {}  # GPUs holding each cluster's processes

    def report(self, head: list[str]) -> list[str]:
        args, counts = self.args, self.counts
        engine = "in an engine process" if args.engine_process else "in the serving process (--no-engine-process)"
        names = {"single": "aoti-sessions serve alone",
                 "ours": f"{counts[0]} replica cluster (Serve throughput-optimized, cluster/_env.py)",
                 "defaults": f"{counts[0]} replica cluster (Serve's defaults)"}
        settings = [k for k in ("ours", "defaults") if self.overhead[k]]
        lines = [*head, f"Every engine (the servers' alone, each replica's) {engine}.", "",
                 "## Routing overhead per generated token (one chat at a time)", "",
                 f"One chat on a cluster and one on the server alone, turn by turn in lockstep; "
                 f"{len(self.overhead['ours']) or args.rounds} rounds of {args.turns} turns of {args.tokens} tokens "
                 "for each of the cluster's Serve settings.", "",
                 "| server | ms per generated token (min / median / max) |", "|---|---|"]
        lines += [f"| {names[k]} | {spread(v)} |" for k, v in self.per_token.items() if v]
        lines += ["", "| cluster's Serve settings | against the server alone, per round (min / median / max) | "
                      "a turn's added ms (each cluster turn less the server alone's same turn) |", "|---|---|---|"]
        lines += [f"| {names[k]} | {spread(self.overhead[k])} x (median {100 * (median(self.overhead[k]) - 1):+.1f}%) "
                  f"| {spread(self.added_ms[k], 2)} ({len(self.added_ms[k])} turns) |" for k in settings]
        if self.per_token["single"] and self.request_ms["single"]:
            single_token = median(self.per_token["single"])
            lines += ["", f"A request's cost beyond its generation: {args.requests} one-token replies (each in a new "
                          "session, short prompt) per setting, alternating with the server alone "
                          f"(median {median(self.request_ms['single']):.2f} ms a request there):", "",
                      "| cluster's Serve settings | added ms a request (min / median / max) | "
                      f"as a share of a {args.tokens}-token turn's generation (median added / "
                      f"({args.tokens} x the server alone's median {single_token:.3f} ms a token)) |", "|---|---|---|"]
            lines += [f"| {names[k]} | {spread(self.request_ms[k], 2)} | "
                      f"{100 * median(self.request_ms[k]) / (args.tokens * single_token):+.1f}% |" for k in settings]
        if self.sequential_waits:
            lines += ["", "Of the cluster's turns' time (ours), waiting for a checkpoint write: "
                          f"{spread(self.sequential_waits)} %."]
        lines += self._throughput()
        return lines

    def _label(self, key: str) -> str:
        n, kind = key.split(" ") if " " in key else ("1", key)
        if kind == "replicas":
            return f"{n} replica{'s' if n != '1' else ''}"
        where = "one a GPU" if not self.args.device.startswith("cpu") else "sharing the CPUs"
        return "aoti-sessions serve alone" if key == "alone" else f"{n} servers alone ({where}; chats split by index)"

    def _throughput(self) -> list[str]:
        loads = {k: v for k, v in self.loads.items() if v}
        if not loads:
            return []
        args = self.args
        lines = ["", f"## Throughput, {args.chats} chats at once ({args.turns} turns of {args.tokens} tokens)", "",
                 "| servers | generated tokens/s (min / median / max) | checkpoint wait, % of turn time | "
                 "checkpoint write, ms each (off the request path) | checkpoints written a round |",
                 "|---|---|---|---|---|"]
        for key, runs in loads.items():
            checkpoints = " replicas" in key
            lines.append(f"| {self._label(key)} | {spread([x.rate for x in runs], 0)} | "
                         + (f"{spread([x.wait for x in runs])} | {spread([x.write for x in runs], 2)} | "
                            f"{median([x.writes for x in runs]):.0f} |" if checkpoints else "- | - | - |"))
        rate = {k: median([x.rate for x in v]) for k, v in loads.items()}
        worst = {k: min(x.rate for x in v) for k, v in loads.items()}
        best = {k: max(x.rate for x in v) for k, v in loads.items()}
        first = f"{self.counts[0]} replicas"
        ratios = []
        for n in self.counts[1:]:
            if f"{n} replicas" in rate and first in rate:
                ratios.append(f"{n} replicas against {self.counts[0]}: {rate[f'{n} replicas'] / rate[first]:.2f} x "
                              f"(worst round against best: {worst[f'{n} replicas'] / best[first]:.2f} x)")
            if f"{n} alone" in rate and "alone" in rate:
                ratios.append(f"{n} servers alone against one (what the hardware gives this load, no router): "
                              f"{rate[f'{n} alone'] / rate['alone']:.2f} x")
            if f"{n} alone" in rate and f"{n} replicas" in rate:
                ratios.append(f"{n} replicas against {n} servers alone: "
                              f"{rate[f'{n} replicas'] / rate[f'{n} alone']:.2f} x")
        if first in rate and "alone" in rate:
            ratios.insert(0, f"{self._label(first)} against the server alone: {rate[first] / rate['alone']:.2f} x")
        lines += ["", "Medians of tokens/s:", ""] + [f"- {x}" for x in ratios]
        lines += ["", "Each engine's step loop during the throughput runs (median over rounds; the servers' "
                      "/metrics, a cluster's summed over replicas): steps a second, decode rows a step, and its "
                      "time a step waiting for the device, queueing the step (host work) and making text.", "",
                  "| servers | steps/s an engine | decode rows / step | wait, ms / step | queue, ms / step | "
                  "text, ms / step |", "|---|---:|---:|---:|---:|---:|"]
        for key, runs in loads.items():
            cells = [f"{median([x.steps[c] for x in runs]):.{3 if c in PHASES else 1}f}"
                     for c in ("steps/s", "rows/step", *PHASES)]
            lines.append(f"| {self._label(key)} | " + " | ".join(cells) + " |")
        groups = [name for name, _ in GROUPS]
        lines += ["", "CPU cores busy during the throughput runs (median over rounds; /proc of each command and "
                      "every process under it):", "", "| servers | " + " | ".join(groups) + " |",
                  "|---|" + "---:|" * len(groups)]
        lines += [f"| {self._label(k)} | " + " | ".join(f"{median([c.cores[g] for c in v]):.2f}" for g in groups)
                  + " |" for k, v in loads.items()]
        if self.placement:
            lines += ["", "GPUs holding each cluster's processes (nvidia-smi): " + "; ".join(
                f"{n} replica{'s' if n > 1 else ''}: {len(bus)} ({', '.join(bus)})"
                for n, bus in self.placement.items())]
        return lines


if __name__ == "__main__":
    main()
