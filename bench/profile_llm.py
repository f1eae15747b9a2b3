"""Where an LLM step's time goes on one device (a diagnostic for bench_serve).

    python bench/profile_llm.py [--device cuda] [--graphs auto|off]
    python bench/profile_llm.py --attention-sweep LAYERS   (CUDA)
    python bench/profile_llm.py --chat-scaling LAYERS      (CUDA)
    python bench/profile_llm.py --step-loop ROWS[,ROWS...] [--device cpu]
    python bench/profile_llm.py --step-loop-fake ROWS[,ROWS...] [--profile]
    python bench/profile_llm.py --run-batch ROWS[,ROWS...]     (CUDA: the engine's batched decode alone)
    python bench/profile_llm.py --one-chat [ROUNDS]          (CUDA)

On the bench_serve model: prefill time by chunk length (host time until the
call returns, and until the device is done), decode, the chat template, prefill
on 1 vs 4 threads (4 sessions), and torch.profiler's table of one prefill
(CUDA runtime calls included: allocations and synchronisations show there).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import bench_package, user_message  # noqa: E402

from aoti_sessions.llm import LLM, ChatSession  # noqa: E402
from aoti_sessions.llm.process._remote_engine import SWITCH_INTERVAL_S  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, n: int) -> tuple[float, float]:
    """Median (host ms until fn returns, ms until the device is done)."""
    host, total = [], []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--graphs", default="auto")
    args = parser.parse_args()
    package = bench_package(args.device)
    graphs = {"auto": "auto", "off": False}[args.graphs]
    with LLM(package, device=args.device, cuda_graphs=graphs) as llm:
        dev = llm.device
        print(llm, "vocab", llm.spec.vocab_size, flush=True)
        chat = llm.new_session()
        sess = chat._session
        for count in (2, 8, 32, 64, 128, 256):
            ids = torch.randint(0, llm.spec.vocab_size, (1, count), device=dev)
            pos = torch.arange(count, device=dev)
            timed(lambda: sess.run("prefill", ids, pos), dev, 3)
            h, t = timed(lambda: sess.run("prefill", ids, pos), dev, 10)
            print(f"prefill T={count:4d}: host {h:7.2f} ms, done {t:7.2f} ms", flush=True)
        one = torch.tensor([[5]], device=dev)
        p = torch.tensor([300], device=dev)
        timed(lambda: sess.run("decode", one, p), dev, 10)
        h, t = timed(lambda: sess.run("decode", one, p), dev, 50)
        print(f"decode: host {h:.3f} ms, done {t:.3f} ms", flush=True)
        logits = sess.run("decode", one, p)
        h, t = timed(lambda: logits.reshape(-1).argmax().reshape(1), dev, 50)
        print(f"argmax: host {h:.3f} ms, done {t:.3f} ms", flush=True)
        messages = []
        for turn in range(4):
            messages += [{"role": "user", "content": user_message(0, turn)},
                         {"role": "assistant", "content": "word " * 8}]
        messages.append({"role": "user", "content": user_message(0, 4)})
        t0 = time.perf_counter()
        for _ in range(10):
            ids_list = llm.prompt_ids(messages)
        print(f"chat template + tokenize, {len(ids_list)} tokens: {(time.perf_counter() - t0) * 100:.2f} ms",
              flush=True)
        # Whole turns through ChatSession, like the server: TTFT and per token.
        for turn in range(3):
            g = chat.start(messages[:2 * turn + 1], max_tokens=32, temperature=0, ignore_eos=True)
            t0 = time.perf_counter()
            marks = []
            while g.step() is not None:
                marks.append(time.perf_counter() - t0)
            print(f"turn {turn}: prompt {g.prompt_tokens}, cached {g.cached_tokens}, prefilled "
                  f"{g.prefilled_tokens}; steps at ms {[round(m * 1e3, 1) for m in marks[:4]]} ... "
                  f"{marks[-1] * 1e3:.1f}", flush=True)
            g.close()
        # Prefill on 4 threads, 4 sessions (own streams) vs 1 thread.
        sessions = [llm.new_session() for _ in range(4)]
        count = 64
        ids = torch.randint(0, llm.spec.vocab_size, (1, count), device=dev)
        pos = torch.arange(count, device=dev)

        def work(cs, n: int) -> None:
            for _ in range(n):
                _run_synced(cs, "prefill", ids, pos)
        for cs in sessions:
            work(cs, 3)
        t0 = time.perf_counter()
        work(sessions[0], 40)
        serial = time.perf_counter() - t0
        parallel = _parallel([lambda cs=cs: _run_synced(cs, "prefill", ids, pos) for cs in sessions], 10)
        print(f"40 prefills T={count}: 1 thread {serial * 1e3:.1f} ms, 4 threads {parallel * 1e3:.1f} ms "
              f"({serial / parallel:.2f}x)", flush=True)
        print("stats", llm.engine.stats(), flush=True)
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            ids = torch.randint(0, llm.spec.vocab_size, (1, 64), device=dev)
            pos = torch.arange(64, device=dev)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    sess.run("prefill", ids, pos)
                sync(dev)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
        for cs in sessions:
            cs.close()
        chat.close()


def _run_synced(chat, method: str, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One run of ``method`` on a chat session as the runtime makes it (under
    the session's lock, on its stream), waited for."""
    with chat._lock, chat._on_stream():
        out = chat._session.run(method, ids, pos)
        if ids.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
    return out


def _first_on_new_thread(fn) -> float:
    """ms of fn's first call on a thread of its own, device work included."""
    out: list[float] = []

    def body() -> None:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    th = threading.Thread(target=body)
    th.start()
    th.join()
    return out[0]


def _parallel(fns, n: int) -> float:
    """Seconds for each fn run n times, all on threads of their own at once."""
    threads = [threading.Thread(target=lambda f=f: [f() for _ in range(n)]) for f in fns]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def attention_sweep(layers: int) -> None:
    """The bench model with each attention backend in both methods: prefill
    and decode times, the cost of a new prefill length and of a new thread,
    and 4-session scaling."""
    from torch.nn.attention import SDPBackend

    from aoti_sessions.llm.exporting import _export_methods
    variants = {"default (cuDNN)": None, "efficient": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
                "math": (SDPBackend.MATH,)}
    rows = []
    for label, backends in variants.items():
        _export_methods.PREFILL_ATTENTION = _export_methods.DECODE_ATTENTION = backends
        package = bench_package("cuda", num_hidden_layers=layers)
        with LLM(package, device="cuda") as llm:
            dev = llm.device
            chats = [llm.new_session() for _ in range(4)]
            ids64, pos64 = torch.randint(0, 100, (1, 64), device=dev), torch.arange(64, device=dev)
            timed(lambda: _run_synced(chats[0], "prefill", ids64, pos64), dev, 3)
            _, prefill = timed(lambda: _run_synced(chats[0], "prefill", ids64, pos64), dev, 10)
            new_len = []
            for count in (37, 41, 45, 49, 53):
                ids, pos = torch.randint(0, 100, (1, count), device=dev), torch.arange(count, device=dev)
                _, first = timed(lambda: _run_synced(chats[0], "prefill", ids, pos), dev, 1)
                _, again = timed(lambda: _run_synced(chats[0], "prefill", ids, pos), dev, 1)
                new_len.append(first - again)
            thread_first = _first_on_new_thread(lambda: _run_synced(chats[1], "prefill", ids64, pos64))
            one, p1 = torch.tensor([[5]], device=dev), torch.tensor([300], device=dev)
            decode_first = _first_on_new_thread(lambda: _run_synced(chats[2], "decode", one, p1))
            for c in chats:
                for _ in range(5):
                    _run_synced(c, "decode", one, p1)
            _, decode = timed(lambda: _run_synced(chats[0], "decode", one, p1), dev, 50)
            serial = _parallel([lambda: _run_synced(chats[0], "decode", one, p1)], 200)
            par = _parallel([lambda c=c: _run_synced(c, "decode", one, p1) for c in chats], 50)
            pser = _parallel([lambda: _run_synced(chats[0], "prefill", ids64, pos64)], 40)
            ppar = _parallel([lambda c=c: _run_synced(c, "prefill", ids64, pos64) for c in chats], 10)
            rows.append(f"| {label} | {prefill:.2f} | {statistics.median(new_len):.1f} | {thread_first:.1f} | "
                        f"{pser / ppar:.2f}x | {decode:.3f} | {decode_first:.1f} | {serial / par:.2f}x |")
            print(rows[-1], flush=True)
            for c in chats:
                c.close()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bench model with {layers} layers")
    print("| attention | prefill T=64 ms | new length extra ms (median of 5) | prefill, first on a new thread ms | "
          "prefill 4 sessions/4 threads vs 1 | decode ms (graph) | decode, first on a new thread ms (eager) | "
          "decode 4 sessions/4 threads vs 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows), flush=True)


def chat_scaling(layers: int) -> None:
    """Chats through ChatSession.stream in this process (no server): tokens/s
    of 4 chats on 4 threads vs one chat at a time, and cProfile's table of one
    chat's turn (where the host's time per token goes)."""
    import cProfile
    import pstats

    package = bench_package("cuda", num_hidden_layers=layers)
    with LLM(package, device="cuda") as llm:
        def chat(index: int, turns: int = 4) -> int:
            messages: list[dict[str, str]] = []
            made = 0
            with llm.new_session() as s:
                for turn in range(turns):
                    messages.append({"role": "user", "content": user_message(index, turn)})
                    c = s.generate(messages, max_tokens=32, temperature=0, ignore_eos=True)
                    made += c.completion_tokens
                    messages.append({"role": "assistant", "content": c.text})
            return made
        chat(0)
        for rnd in range(3):
            t0 = time.perf_counter()
            made = sum(chat(i) for i in range(4))
            serial = made / (time.perf_counter() - t0)
            counts: list[int] = []
            par = sum(counts) / _parallel([lambda i=i: counts.append(chat(i)) for i in range(4)], 1)
            print(f"round {rnd}: 4 chats one at a time {serial:.0f} tokens/s, on 4 threads {par:.0f} tokens/s "
                  f"({par / serial:.2f}x)", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        chat(1)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


@contextlib.contextmanager
def step_thread_timed(cpu: list[float]) -> Iterator[None]:
    """Step loops started (and ended) in the block add their thread's CPU
    seconds to ``cpu`` (what a loop costs whatever else the machine runs)."""
    from aoti_sessions.llm.runtime import _scheduler

    loop = _scheduler.Scheduler._loop

    def timed(self: _scheduler.Scheduler) -> None:
        start = time.thread_time()
        try:
            loop(self)
        finally:
            cpu.append(time.thread_time() - start)

    _scheduler.Scheduler._loop = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        _scheduler.Scheduler._loop = loop  # type: ignore[method-assign]


@contextlib.contextmanager
def step_thread_profiled(profile: cProfile.Profile) -> Iterator[None]:
    """Step loops started (and ended) in the block run under ``profile``,
    enabled on the step thread (cProfile sees only the thread that enables it)."""
    from aoti_sessions.llm.runtime import _scheduler

    loop = _scheduler.Scheduler._loop

    def profiled(self: _scheduler.Scheduler) -> None:
        profile.enable()
        try:
            loop(self)
        finally:
            profile.disable()

    _scheduler.Scheduler._loop = profiled  # type: ignore[method-assign]
    try:
        yield
    finally:
        _scheduler.Scheduler._loop = loop  # type: ignore[method-assign]


def step_loop(rows_list: list[int], device: str) -> None:
    """ROWS chats decoding together through one LLM (no server): the step
    loop's host time a step (LLM.stats: queueing, of it the engine's calls,
    waiting, text), then cProfile's table of the step thread alone, from a
    second LLM whose step thread runs profiled."""
    import pstats

    package = bench_package(device)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # (as a server's processes do: serve/_open.py)
    for rows in rows_list:
        firsts = [[{"role": "user", "content": user_message(i, 0)}] for i in range(rows)]

        def turn(chats: list[ChatSession], tokens: int) -> None:
            gens = [c.start(first, max_tokens=tokens, temperature=0, ignore_eos=True)
                    for first, c in zip(firsts, chats)]
            for g in gens:
                while g.step() is not None:
                    pass

        with LLM(package, device=device) as llm:
            chats = [llm.new_session() for _ in range(rows)]
            turn(chats, 96)  # (as long as the timed turn: its graph widths captured, the pool grown)
            for c in chats:
                c.reset()
            before = dict(llm.stats())
            t0 = time.perf_counter()
            turn(chats, 96)
            wall = time.perf_counter() - t0
            after = llm.stats()
            d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
            steps = max(1, d["steps"])
            print(f"rows {rows}: {steps} steps, {1e3 * wall / steps:.3f} ms a step by the wall, "
                  f"{d['decode_rows'] / steps:.1f} decode rows a step; host ms a step: queue "
                  f"{1e3 * d['step_queue_seconds'] / steps:.3f}, wait {1e3 * d['step_wait_seconds'] / steps:.3f}, "
                  f"text {1e3 * d['step_text_seconds'] / steps:.3f}; of queue, engine calls "
                  f"{1e3 * d['step_engine_seconds'] / steps:.3f}; graph captures {d.get('graph_captures', 0)}, "
                  f"pool grows {d.get('pool_grows', 0)}", flush=True)
        profile = cProfile.Profile()
        with step_thread_profiled(profile), LLM(package, device=device) as llm:
            turn([llm.new_session() for _ in range(rows)], 96)
        print(f"cProfile of the step thread, {rows} rows (prefill included):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)

def step_loop_fake(rows_list: list[int], profiled: bool) -> None:
    """The step loop's own host work a step, with an engine that does no
    work (tests/fake_engine.py; its calls' time, ~1 us a row of list
    appends, is counted apart): ROWS generations decode 256 greedy tokens
    together, each handing its tokens to a sink (an engine process's way);
    the fixed cost a step and the cost a row, from LLM.stats(), and the loop
    thread's CPU time a step (steadier on a shared machine than the wall).
    Five rounds a ROWS, the median; --profile: cProfile's table of the last
    round's loop."""
    import pstats

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fake_engine import FakeEngine, FakeLLM, FakeSession  # noqa: E402

    from aoti_sessions.llm.runtime._plan import Limits

    tokens, vocab = 256, 64

    class Instant(FakeEngine):
        """Every call's logits the same (token 1 wins): no model at all."""

        def run_batch(self, method: str, sessions: list[FakeSession], ids: torch.Tensor) -> torch.Tensor:
            for s, row in zip(sessions, ids.tolist()):
                s.cache += row
            return logits[: len(sessions)]

    logits = torch.zeros(1024, vocab)
    logits[:, 1] = 1.0
    profile = cProfile.Profile()
    for rows in rows_list:
        per_step = []
        for round_ in range(5):
            limits = Limits(budget=512, max_prefill=64, prefill_rows=8, max_context=4096)
            llm = FakeLLM(max_rows=rows, limits=limits, engine=Instant(rows))
            llm.max_context = 4096
            cpu: list[float] = []
            with step_thread_profiled(profile) if profiled and round_ == 4 else step_thread_timed(cpu):
                try:
                    done = threading.Semaphore(0)
                    sinks: list[list[object]] = []
                    for i in range(rows):
                        g = llm.new_session().start([2 + i % 50] * 8, max_tokens=tokens, temperature=0,
                                                    ignore_eos=True)
                        events: list[object] = []
                        sinks.append(events)
                        g.on_tokens(lambda e, events=events: (events.append(e), e is None and done.release()))
                    for _ in range(rows):
                        assert done.acquire(timeout=300), "a generation did not end"
                    stats = llm._scheduler.stats()
                finally:
                    llm._scheduler.close()  # (its thread ends in the block: the profiled loop with it)
            assert all(len(events) == tokens + 1 for events in sinks)
            steps = stats["steps"]
            host = stats["step_queue_seconds"] - stats["step_engine_seconds"] + stats["step_text_seconds"]
            per_step.append((1e3 * host / steps, 1e3 * (cpu[0] if cpu else 0.0) / steps,
                             1e3 * stats["step_queue_seconds"] / steps,
                             1e3 * stats["step_engine_seconds"] / steps, 1e3 * stats["step_text_seconds"] / steps,
                             stats["decode_rows"] / steps))
        host, thread, queue, engine, text, decode = (statistics.median(v) for v in zip(*per_step))
        print(f"rows {rows}: host ms a step {host:.3f} (min {min(p[0] for p in per_step):.3f}, max "
              f"{max(p[0] for p in per_step):.3f}), {1e3 * host / max(decode, 1):.2f} us a row; loop thread CPU ms a step "
              f"{thread:.3f} (min {min(p[1] for p in per_step):.3f}); queue {queue:.3f} "
              f"(of it the fake engine {engine:.3f}), text {text:.3f}; {decode:.1f} decode rows a step", flush=True)
    if profiled:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


# Qwen3-0.6B's shape on bench_serve's model (hidden 1024, 16 / 8 heads): 28 layers, head_dim 128.
ONE_CHAT_SHAPE = dict(num_hidden_layers=28, head_dim=128)


def one_chat(rounds: int) -> None:
    """One chat of the Qwen3-0.6B shape (random weights, bf16, CUDA): its
    inter-token time streaming 128 greedy tokens, against the device's work
    a decode step (bench_decode.one_chat_rounds: torch.profiler's kernel time
    over a turn of 128 tokens less that over a turn of 1, divided by the 127
    decode steps). The ratio is how much longer a token takes than the
    device's work for it: 1.0 where the host never keeps the device waiting."""
    from bench_decode import one_chat_rounds

    package = bench_package("cuda", **ONE_CHAT_SHAPE)  # type: ignore[arg-type]
    with LLM(package, device="cuda") as llm:
        print(f"{llm}: {ONE_CHAT_SHAPE}, {torch.cuda.get_device_name()}", flush=True)
        rows = []
        for rnd, r in enumerate(one_chat_rounds(llm, 128, rounds), 1):
            rows.append((r.ms_a_token, r.device_ms, r.ms_a_token / r.device_ms))
            print(f"round {rnd}: inter-token median {r.ms_a_token:.3f} ms; device work a decode step "
                  f"{r.device_ms:.3f} ms ({r.kernels:.0f} kernels); inter-token / device {rows[-1][2]:.3f}",
                  flush=True)
        for name, at in (("inter-token ms", 0), ("device ms a step", 1), ("ratio", 2)):
            values = sorted(r[at] for r in rows)
            print(f"{name}: min {values[0]:.3f} / median {statistics.median(values):.3f} / max {values[-1]:.3f}",
                  flush=True)


def run_batch(rows_list: list[int], device: str, calls: int = 100) -> None:
    """The engine's batched decode call alone, ROWS sessions of 64 tokens: its
    host time (the Python call, and the C++ core's part of it, Engine.stats'
    batch_seconds) with the device idle before each call, and with calls
    queued back to back as the step loop queues them (two in flight); the
    device's time a call. Where the core's time grows with the device busy,
    a call waits for the device inside it."""
    package = bench_package(device)
    with LLM(package, device=device) as llm:
        engine, dev = llm.engine, llm.device
        for rows in rows_list:
            sessions = [engine.new_session() for _ in range(rows)]
            prompt = torch.randint(0, llm.spec.vocab_size, (1, 64), device=dev)
            for s in sessions:
                s.run("prefill", prompt)
            one = torch.randint(0, llm.spec.vocab_size, (rows, 1), device=dev)
            for _ in range(10):  # (graphs captured)
                engine.run_batch("decode", sessions, one)
            torch.cuda.synchronize()
            for mode in ("idle", "queued"):
                host = []
                core0 = engine.stats()["batch_seconds"]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(calls):
                    if mode == "idle":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    engine.run_batch("decode", sessions, one)
                    host.append(time.perf_counter() - t0)
                    if mode == "queued" and i % 2:
                        torch.cuda.synchronize()  # (at most two calls in flight, as in the loop)
                end.record()
                torch.cuda.synchronize()
                core = engine.stats()["batch_seconds"] - core0
                slow = sorted(range(calls), key=lambda i: -host[i])[:4]
                length = sessions[0].length
                host.sort()
                device_ms = start.elapsed_time(end) / calls
                print(f"rows {rows}, {mode}: host ms a call min {1e3 * host[0]:.3f} / median "
                      f"{1e3 * host[len(host) // 2]:.3f} / max {1e3 * host[-1]:.3f}; in C++ "
                      f"{1e3 * core / calls:.3f} ms a call; the wall a call (device) {device_ms:.3f} ms; "
                      f"slowest calls at positions {[length - calls + i for i in slow]}", flush=True)
            for s in sessions:
                s.close()


if __name__ == "__main__":
    if "--one-chat" in sys.argv:
        at = sys.argv.index("--one-chat")
        one_chat(int(sys.argv[at + 1]) if len(sys.argv) > at + 1 else 3)
    elif "--step-loop-fake" in sys.argv:
        step_loop_fake([int(r) for r in sys.argv[sys.argv.index("--step-loop-fake") + 1].split(",")],
                       "--profile" in sys.argv)
    elif "--run-batch" in sys.argv:
        device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
        run_batch([int(r) for r in sys.argv[sys.argv.index("--run-batch") + 1].split(",")], device)
    elif "--step-loop" in sys.argv:
        device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
        step_loop([int(r) for r in sys.argv[sys.argv.index("--step-loop") + 1].split(",")], device)
    elif "--chat-scaling" in sys.argv:
        chat_scaling(int(sys.argv[sys.argv.index("--chat-scaling") + 1]))
    elif "--attention-sweep" in sys.argv:
        attention_sweep(int(sys.argv[sys.argv.index("--attention-sweep") + 1]))
    else:
        main()
