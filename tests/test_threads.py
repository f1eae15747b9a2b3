"""Sessions used and closed from many threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import aoti_sessions as ais
from aoti_sessions.demo import GreedyDecoding
from conftest import counter_inputs

PROMPTS = [[1, 2, 3], [90, 80, 70], [5, 5, 5], [200, 100, 50]]


def test_four_threads_equal_serial(decoder_engine: ais.Engine) -> None:
    def decode(prompt: list[int]) -> tuple[list[int], dict[str, torch.Tensor]]:
        with decoder_engine.new_session() as s:
            d = GreedyDecoding(s, prompt, 16)
            d.run()
            return d.generated, s.state()

    serial = [decode(p) for p in PROMPTS]
    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            threaded = list(pool.map(decode, PROMPTS))
        for (tokens, state), (want_tokens, want_state) in zip(threaded, serial):
            assert tokens == want_tokens
            assert all(torch.equal(state[k], v) for k, v in want_state.items())


def test_state_operations_race_with_runs(counter_engine: ais.Engine, device: str) -> None:
    """Forks, resets and state reads of one session while others run."""
    x, slot = counter_inputs(device, 1.0, 1)
    runners = [counter_engine.new_session() for _ in range(3)]
    target = counter_engine.new_session()
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(s: ais.Session) -> None:
        try:
            for _ in range(300):
                s(x, slot)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def churn() -> None:
        try:
            while not stop.is_set():
                target.reset()
                f = target.fork()
                assert int(f.state()["hits"].sum()) == 0
                f.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in runners] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    stop.set()
    threads[-1].join()
    assert not errors, errors
    for s in runners:
        assert int(s.state()["hits"][1]) == 300
        s.close()
    target.close()


def test_close_while_another_thread_runs(counter_engine: ais.Engine, device: str) -> None:
    x, slot = counter_inputs(device)
    for _ in range(20):
        s = counter_engine.new_session()
        started = threading.Event()
        outcome: list[str] = []

        def loop() -> None:
            try:
                while True:
                    s(x, slot)
                    started.set()
            except ais.SessionClosedError:
                outcome.append("closed")
            except BaseException as e:  # noqa: BLE001
                outcome.append(repr(e))

        t = threading.Thread(target=loop)
        t.start()
        started.wait()
        s.close()  # waits for the run in flight, then frees the state
        t.join()
        assert outcome == ["closed"]
    # The engine serves new sessions afterwards.
    with counter_engine.new_session() as fresh:
        fresh(x, slot)
        assert int(fresh.state()["hits"].sum()) == 1


def test_engine_close_while_threads_run(counter_pkg, device: str) -> None:
    eng = ais.Engine(counter_pkg, device=device)
    sessions = [eng.new_session() for _ in range(4)]
    x, slot = counter_inputs(device)
    results: list[str] = []

    def loop(s: ais.Session) -> None:
        try:
            while True:
                s(x, slot)
        except ais.SessionClosedError:
            results.append("closed")

    threads = [threading.Thread(target=loop, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    eng.close()
    for t in threads:
        t.join()
    assert results == ["closed"] * 4


def test_engine_close_races_creates_and_forks(counter_pkg, device: str) -> None:
    """Sessions made while the engine closes are closed too, never leaked."""
    for _ in range(10):
        eng = ais.Engine(counter_pkg, device=device)
        parent = eng.new_session()
        outcomes: list[str] = []

        def churn() -> None:
            try:
                while True:
                    parent.fork()
                    eng.new_session()
            except ais.SessionClosedError:
                outcomes.append("closed")
            except BaseException as e:  # noqa: BLE001
                outcomes.append(repr(e))

        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        eng.close()
        for t in threads:
            t.join()
        assert outcomes == ["closed", "closed"]
        stats = eng.stats()
        assert stats["live_sessions"] == 0 and stats["live_bytes"] == 0


def test_state_is_one_snapshot_while_the_session_runs(counter_engine: ais.Engine, device: str) -> None:
    """state() of a session another thread keeps running: acc and hits always
    come from the same step, never a mix of two (each run adds to both)."""
    x, slot = counter_inputs(device, 1.0, 1)
    steps, wanted = 3000, 100
    with counter_engine.new_session() as solo:  # acc after k runs, for every k
        acc_after = [solo.state()["acc"][1].clone()]
        for _ in range(steps):
            solo(x, slot)
            acc_after.append(solo.state()["acc"][1].clone())
    with counter_engine.new_session() as s:
        done = threading.Event()
        seen, mixed = 0, []

        def run() -> None:
            # Until the reader has looked often enough (a busy machine may
            # schedule it rarely), and never past the steps precomputed.
            for _ in range(steps):
                s(x, slot)
                if device == "cuda":
                    # Runs queue in microseconds (graphs): keep them at the
                    # device's pace, or all of them are queued before the
                    # reader looks often enough.
                    torch.cuda.current_stream().synchronize()
                if seen >= wanted:
                    break
            done.set()

        runner = threading.Thread(target=run)
        runner.start()
        while not done.is_set():
            state = s.state()
            k = int(state["hits"][1])
            if not torch.equal(state["acc"][1], acc_after[k]):
                mixed.append(k)
            seen += 1
        runner.join()
    assert seen >= 20
    assert not mixed, f"{len(mixed)} of {seen} snapshots mixed two steps"


def test_readers_race_engine_close(counter_pkg, device: str) -> None:
    """Every reader of an engine (stats, memory report, descriptors) is safe
    while another thread closes it."""
    x, slot = counter_inputs(device)
    for _ in range(30):
        eng = ais.Engine(counter_pkg, device=device)
        s = eng.new_session()
        s(x, slot)
        errors: list[BaseException] = []
        started = threading.Event()

        def read() -> None:
            try:
                while not eng.closed:
                    report = eng.memory_report()
                    assert sum(report["device"].values()) + sum(report["host"].values()) > 0
                    eng.stats()
                    eng.weights()
                    eng.buffers()
                    started.set()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                started.set()

        readers = [threading.Thread(target=read) for _ in range(2)]
        for r in readers:
            r.start()
        started.wait()
        eng.close()
        for r in readers:
            r.join()
        assert not errors, errors
        report = eng.memory_report()  # and after the close
        assert report == eng.memory_report() and eng.stats()["live_sessions"] == 0
