"""Where an LLM step's time goes on one device (a diagnostic for bench_serve).

    python bench/profile_llm.py [--device cuda] [--graphs auto|off]

On the bench_serve model: prefill time by chunk length (host time until the
call returns, and until the device is done), decode, the chat template, prefill
on 1 vs 4 threads (4 sessions), and torch.profiler's table of one prefill
(CUDA runtime calls included: allocations and synchronisations show there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import bench_package, user_message  # noqa: E402

from aoti_sessions.llm import LLM  # noqa: E402


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
                with cs._lock, cs._on_stream():
                    cs._session.run("prefill", ids, pos)
                    sync_stream = torch.cuda.current_stream() if dev.type == "cuda" else None
                    if sync_stream is not None:
                        sync_stream.synchronize()
        for cs in sessions:
            work(cs, 3)
        t0 = time.perf_counter()
        work(sessions[0], 40)
        serial = time.perf_counter() - t0
        threads = [threading.Thread(target=work, args=(cs, 10)) for cs in sessions]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        parallel = time.perf_counter() - t0
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


if __name__ == "__main__":
    main()
