"""Session lifecycle: offload / restore, eviction under memory_budget and
host_budget, idle expiry, session files (save in one process, load in
another; every corruption refused with the engine intact), and threads racing
evictions with runs. Every test runs on the CPU (both tiers in host memory)
and, where there is one, on a GPU (pinned host tier)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions.demo import GreedyDecoding
from conftest import DECODER_PREFILL

PROMPTS = [[(13 * i + 5 * j + 3) % 256 for j in range(3)] for i in range(40)]
STEPS = 8


def _solo(engine: ais.Engine, prompt: list[int], steps: int = STEPS) -> list[int]:
    with engine.new_session() as s:
        return GreedyDecoding(s, prompt, steps).run()


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_accounting(engine: ais.Engine, budget: int | None = None) -> dict[str, Any]:
    st = engine.stats()
    per = engine.bytes_per_session
    flags = [s["resident"] for s in st["sessions"]]
    assert st["live_sessions"] == len(st["sessions"]) == st["resident_sessions"] + st["offloaded_sessions"]
    assert st["resident_sessions"] == sum(flags)
    assert st["device_bytes"] == st["resident_sessions"] * per
    assert st["host_bytes"] == st["offloaded_sessions"] * per
    assert st["live_bytes"] == st["device_bytes"] + st["host_bytes"] == sum(s["bytes"] for s in st["sessions"])
    if budget is not None:
        assert st["device_bytes"] <= budget
    return st


# ---------------------------------------------------------------- offload / restore

def test_offload_restore_is_bit_identical(decoder_engine: ais.Engine) -> None:
    eng = decoder_engine
    before = eng.stats()
    with eng.new_session() as s, eng.new_session() as reference:
        a, b = GreedyDecoding(s, PROMPTS[0], 12), GreedyDecoding(reference, PROMPTS[0], 12)
        for _ in range(6):
            a.step()
            b.step()
        state = s.state()
        s.offload()
        assert not s.resident and s._core.address == 0
        s.offload()  # already offloaded: nothing happens
        # Reads and writes reach the host tier without bringing it back.
        assert _same_state(s.state(), state) and not s.resident
        s.load_state(state)
        assert not s.resident
        report = eng.memory_report()["host"]
        assert report["offloaded"] == eng.bytes_per_session
        s.restore()
        assert s.resident and s._core.address != 0
        assert _same_state(s.state(), state)
        s.offload()
        while not a.done:  # a run restores by itself
            a.step()
            b.step()
        assert s.resident
        assert a.generated == b.generated
        assert _same_state(s.state(), reference.state())
        s.restore()  # resident: nothing happens
    after = eng.stats()
    assert after["offloads"] - before["offloads"] == 2
    assert after["restores"] - before["restores"] == 2
    assert after["evictions"] == before["evictions"]
    assert after["host_bytes"] == 0


def test_fork_reset_save_and_close_while_offloaded(decoder_engine: ais.Engine, tmp_path: Path) -> None:
    eng = decoder_engine
    s = eng.new_session()
    d = GreedyDecoding(s, PROMPTS[1], 6)
    for _ in range(4):
        d.step()
    state = s.state()
    s.offload()
    child = s.fork()  # copies from the host tier
    assert child.resident and not s.resident
    assert _same_state(child.state(), state)
    s.save(tmp_path / "offloaded.ais")  # saved from the host tier
    assert not s.resident
    with eng.load_session(tmp_path / "offloaded.ais") as loaded:
        assert _same_state(loaded.state(), state)
    s.reset()  # restores, then back to the initial state
    assert s.resident
    with eng.new_session() as fresh:
        assert _same_state(s.state(), fresh.state())
    s.offload()
    host = eng.stats()["host_bytes"]
    s.close()  # releases the host tier
    assert eng.stats()["host_bytes"] == host - eng.bytes_per_session
    with pytest.raises(ais.SessionClosedError):
        s.offload()
    with pytest.raises(ais.SessionClosedError):
        s.restore()
    child.close()


def test_max_sessions_counts_offloaded_sessions(decoder_pkg: Path, device: str) -> None:
    with ais.Engine(decoder_pkg, device=device, max_sessions=2) as eng:
        a, b = eng.new_session(), eng.new_session()
        a.offload()
        with pytest.raises(ais.CapacityError, match="max_sessions=2"):
            eng.new_session()
        assert b.resident


# ---------------------------------------------------------------- eviction

def test_round_robin_ten_times_the_budget(decoder_pkg: Path, device: str) -> None:
    """20 sessions decoding in turn under a device budget of 2: every session's
    tokens equal its solo run, the budget holds at every step, stats add up."""
    n, fit = 20, 2
    with ais.Engine(decoder_pkg, device=device) as plain:
        solo = [_solo(plain, p) for p in PROMPTS[:n]]
        per = plain.bytes_per_session
    budget = fit * per
    with ais.Engine(decoder_pkg, device=device, memory_budget=budget) as eng:
        sessions = [eng.new_session() for _ in range(n)]
        st = _check_accounting(eng, budget)
        assert st["resident_sessions"] == fit and st["offloaded_sessions"] == n - fit
        runs = [GreedyDecoding(s, p, STEPS) for s, p in zip(sessions, PROMPTS)]
        while not runs[0].done:
            for r in runs:
                r.step()
                # The session just run is resident; the budget always holds.
                assert r.session.resident
                _check_accounting(eng, budget)
        assert [r.generated for r in runs] == solo
        st = _check_accounting(eng, budget)
        assert st["evictions"] == st["offloads"] >= (n - fit) * (len(runs[0].prompt) + STEPS - 1)
        assert st["offloads"] - st["restores"] == st["offloaded_sessions"] == n - fit
        # LRU: the two resident sessions are the two run last.
        resident = {s["id"] for s in st["sessions"] if s["resident"]}
        assert resident == {sessions[-1].id, sessions[-2].id}
        last_use = {s["id"]: s["last_use"] for s in st["sessions"]}
        assert last_use[sessions[-1].id] >= last_use[sessions[0].id]
        assert last_use[sessions[-1].id] <= time.monotonic()
        for s in sessions:
            s.close()
        st = eng.stats()
        assert st["live_sessions"] == st["live_bytes"] == st["host_bytes"] == st["device_bytes"] == 0


def test_full_budgets_refuse_and_change_nothing(decoder_pkg: Path, device: str) -> None:
    with ais.Engine(decoder_pkg, device=device) as probe:
        per = probe.bytes_per_session
    with ais.Engine(decoder_pkg, device=device, memory_budget=per, host_budget=per) as eng:
        a = eng.new_session()
        b = eng.new_session()  # a goes to the host
        assert not a.resident and b.resident
        before = eng.stats()
        with pytest.raises(ais.CapacityError, match=r"memory_budget=.*host_budget="):
            eng.new_session()
        after = eng.stats()
        for key in ("live_sessions", "device_bytes", "host_bytes", "offloads"):
            assert after[key] == before[key], key
        a.close()
        # Room on the host again, but the session a call holds is never evicted for it.
        with pytest.raises(ais.CapacityError, match="the one this call uses"):
            b.fork()
        assert b.resident
        c = eng.new_session()  # b is idle again: evicted
        assert c.resident and not b.resident


def test_a_full_host_budget_still_swaps(decoder_pkg: Path, device: str) -> None:
    """Device and host budgets of one session each: restoring the offloaded
    session evicts the resident one (host use unchanged), so the two keep
    taking turns, decoding like solo runs."""
    with ais.Engine(decoder_pkg, device=device) as plain:
        solo = [_solo(plain, p) for p in PROMPTS[:2]]
        per = plain.bytes_per_session
    with ais.Engine(decoder_pkg, device=device, memory_budget=per, host_budget=per) as eng:
        sessions = [eng.new_session(), eng.new_session()]
        runs = [GreedyDecoding(s, p, STEPS) for s, p in zip(sessions, PROMPTS)]
        while not runs[0].done:
            for r in runs:
                r.step()
                _check_accounting(eng, per)
                assert eng.stats()["host_bytes"] <= per
        assert [r.generated for r in runs] == solo
        sessions[0].restore()
        assert sessions[0].resident and not sessions[1].resident


def test_forking_an_offloaded_session_respects_the_host_budget(decoder_pkg: Path, device: str) -> None:
    """The fork keeps its parent's host block: evicting for it needs host
    room of its own (only a restore swaps one block for another)."""
    with ais.Engine(decoder_pkg, device=device) as probe:
        per = probe.bytes_per_session
    with ais.Engine(decoder_pkg, device=device, memory_budget=per, host_budget=per) as eng:
        a = eng.new_session()
        a.offload()
        b = eng.new_session()
        with pytest.raises(ais.CapacityError, match="host_budget"):
            a.fork()
        st = _check_accounting(eng, per)
        assert st["host_bytes"] <= per and b.resident and not a.resident


def test_forks_waiting_on_each_other_fail_fast(decoder_pkg: Path, device: str) -> None:
    """Budget of two, both resident sessions forking at once: each fork holds
    its session, so neither can be evicted for the other. No call may wait
    for the other for the full capacity timeout."""
    with ais.Engine(decoder_pkg, device=device) as plain:
        per = plain.bytes_per_session
    with ais.Engine(decoder_pkg, device=device, memory_budget=2 * per) as eng:
        for _ in range(20):
            a, b = eng.new_session(), eng.new_session()
            outcome: list[object] = []
            start = threading.Barrier(2)

            def fork(s: ais.Session) -> None:
                start.wait()
                try:
                    outcome.append(s.fork())
                except ais.CapacityError as e:
                    outcome.append(e)

            began = time.monotonic()
            workers = [threading.Thread(target=fork, args=(s,)) for s in (a, b)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=30)
            assert not any(w.is_alive() for w in workers)
            assert time.monotonic() - began < 10
            for x in [*outcome, a, b]:
                if isinstance(x, ais.Session):
                    x.close()
            _check_accounting(eng, 2 * per)
        assert eng.stats()["live_sessions"] == 0


def test_concurrent_closes_of_an_engine_with_an_idle_timer(decoder_pkg: Path, device: str) -> None:
    for _ in range(10):
        eng = ais.Engine(decoder_pkg, device=device, idle_timeout=0.01)
        s = eng.new_session()
        closers = [threading.Thread(target=eng.close) for _ in range(3)]
        for c in closers:
            c.start()
        for c in closers:
            c.join(timeout=30)
        assert not any(c.is_alive() for c in closers)
        assert eng.closed and s.closed


# ---------------------------------------------------------------- idle expiry

def test_idle_sessions_are_offloaded_and_come_back(decoder_pkg: Path, device: str) -> None:
    with ais.Engine(decoder_pkg, device=device, idle_timeout=0.2) as eng:
        want = _solo(eng, PROMPTS[2], 10)
        idle, busy = eng.new_session(), eng.new_session()
        d = GreedyDecoding(idle, PROMPTS[2], 10)
        for _ in range(4):
            d.step()
        busy_run = GreedyDecoding(busy, PROMPTS[3], 200)
        deadline = time.monotonic() + 10
        while idle.resident and time.monotonic() < deadline:
            busy_run.step()  # used far more often than the timeout
            assert busy.resident
            time.sleep(0.01)
        assert not idle.resident
        assert eng.stats()["idle_offloads"] >= 1
        d.run()
        assert d.generated == want


def test_idle_sessions_can_be_closed(decoder_pkg: Path, device: str) -> None:
    with ais.Engine(decoder_pkg, device=device, idle_timeout=0.1, idle_action="close") as eng:
        s = eng.new_session()
        s(torch.tensor([[1]], device=device), torch.tensor([0], device=device))
        deadline = time.monotonic() + 10
        while not s.closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.closed
        with pytest.raises(ais.SessionClosedError, match="idle_timeout"):
            s(torch.tensor([[1]], device=device), torch.tensor([1], device=device))
        st = eng.stats()
        assert st["idle_closes"] == 1 and st["live_sessions"] == 0 and st["live_bytes"] == 0


# ---------------------------------------------------------------- threads

def test_threads_race_evictions_and_restores(decoder_pkg: Path, device: str) -> None:
    """Four threads decode three sessions each under a budget of three
    sessions, while a fifth offloads, restores and saves their sessions at
    random: every token equals the solo run and the accounting holds."""
    threads, each = 4, 3
    prompts = PROMPTS[: threads * each]
    with ais.Engine(decoder_pkg, device=device) as plain:
        solo = [_solo(plain, p, 12) for p in prompts]
        per = plain.bytes_per_session
    with ais.Engine(decoder_pkg, device=device, memory_budget=3 * per) as eng:
        sessions = [eng.new_session() for _ in prompts]
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []
        stop = threading.Event()

        def decode(k: int) -> None:
            try:
                mine = list(range(k * each, (k + 1) * each))
                runs = {i: GreedyDecoding(sessions[i], prompts[i], 12) for i in mine}
                while not all(r.done for r in runs.values()):
                    for i, r in runs.items():
                        if not r.done:
                            r.step()
                for i, r in runs.items():
                    results[i] = r.generated
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def meddle(folder: str) -> None:
            rng = random.Random(0)
            try:
                while not stop.is_set():
                    s = rng.choice(sessions)
                    action = rng.random()
                    if action < 0.45:
                        s.offload()
                    elif action < 0.9:
                        s.restore()
                    else:
                        s.save(os.path.join(folder, "meddle.ais"))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        import tempfile
        with tempfile.TemporaryDirectory() as folder:
            workers = [threading.Thread(target=decode, args=(k,)) for k in range(threads)]
            meddler = threading.Thread(target=meddle, args=(folder,))
            meddler.start()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            stop.set()
            meddler.join()
        assert not errors, errors
        assert [results[i] for i in range(len(prompts))] == solo
        st = _check_accounting(eng, 3 * per)
        assert st["evictions"] > 0 and st["restores"] > 0
        assert st["offloads"] - st["restores"] == st["offloaded_sessions"]


def test_a_busy_budget_waits_instead_of_failing(decoder_pkg: Path, device: str) -> None:
    """Budget of one session, two threads: each run waits for the other's to
    end, evicts it, and both decode exactly like solo runs."""
    with ais.Engine(decoder_pkg, device=device) as plain:
        solo = [_solo(plain, p, 16) for p in PROMPTS[:2]]
        per = plain.bytes_per_session
    with ais.Engine(decoder_pkg, device=device, memory_budget=per) as eng:
        sessions = [eng.new_session() for _ in range(2)]
        out: dict[int, list[int]] = {}

        def decode(i: int) -> None:
            out[i] = GreedyDecoding(sessions[i], PROMPTS[i], 16).run()

        workers = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert [out[0], out[1]] == solo
        assert eng.stats()["evictions"] >= 1


# ---------------------------------------------------------------- session files

_PROCESS = textwrap.dedent("""
    import json, sys, torch, aoti_sessions as ais
    package, device, mode, path, n = sys.argv[1:6]
    engine = ais.Engine(package, device=device)

    def decode(session, token, position, n):
        out = []
        for i in range(n):
            logits = session.run("decode", torch.tensor([[token]], device=device),
                                 torch.tensor([position + i], device=device))
            token = int(logits[0, -1].argmax())
            out.append(token)
        return out

    if mode == "save":
        s = engine.new_session()
        t = int(sys.argv[6])
        logits = s.run("prefill", torch.arange(1, t + 1, device=device).view(1, t), torch.arange(t, device=device))
        first = int(logits[0, -1].argmax())
        tokens = [first] + decode(s, first, t, int(n))
        s.save(path)
        print(json.dumps(tokens))
    else:
        s = engine.load_session(path)
        print(json.dumps(decode(s, int(sys.argv[6]), int(sys.argv[7]), int(n))))
""")


def _in_process(*args: object) -> list[int]:
    result = subprocess.run([sys.executable, "-c", _PROCESS, *map(str, args)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def test_save_in_one_process_continue_in_another(decoder_methods_pkg: Path, device: str, tmp_path: Path) -> None:
    t, n = DECODER_PREFILL, 6
    path = tmp_path / "conversation.ais"
    first = _in_process(decoder_methods_pkg, device, "save", path, n, t)
    assert path.is_file() and not list(tmp_path.glob("*aoti-tmp*"))
    second = _in_process(decoder_methods_pkg, device, "load", path, n, first[-1], t + n)
    # Uninterrupted, in this process.
    with ais.Engine(decoder_methods_pkg, device=device) as eng, eng.new_session() as s:
        logits = s.run("prefill", torch.arange(1, t + 1, device=device).view(1, t), torch.arange(t, device=device))
        tokens = [int(logits[0, -1].argmax())]
        for i in range(2 * n):
            logits = s.run("decode", torch.tensor([[tokens[-1]]], device=device), torch.tensor([t + i], device=device))
            tokens.append(int(logits[0, -1].argmax()))
    assert first + second == tokens
    assert len(set(tokens)) > 1, "the decoding should not be constant"


def _payload_start(data: bytes) -> int:
    header = int.from_bytes(data[16:24], "little")
    return (24 + header + 8 + 63) // 64 * 64


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


@pytest.fixture
def saved(decoder_engine: ais.Engine, tmp_path: Path):
    """A session file of a decoded conversation, and the session it came from."""
    with decoder_engine.new_session() as s:
        d = GreedyDecoding(s, PROMPTS[4], 4)
        d.run()
        path = tmp_path / "good.ais"
        s.save(path)
        yield path, s.state()


CORRUPTIONS = {
    "truncated in the prefix": (lambda b: b[:10], ais.SessionFileError, r"is truncated \(10 bytes\)"),
    "cut to 16 bytes": (lambda b: b[:16], ais.SessionFileError, r"is truncated \(16 bytes\)"),
    "truncated in the header": (lambda b: b[:40], ais.SessionFileError, "truncated"),
    "truncated in the payload": (lambda b: b[: len(b) // 2], ais.SessionFileError, "truncated"),
    "one byte short": (lambda b: b[:-1], ais.SessionFileError, "truncated"),
    "trailing bytes": (lambda b: b + b"\0", ais.SessionFileError, "unexpected bytes"),
    "header byte flipped": (lambda b: _flip(b, 30), ais.SessionFileError, "header checksum"),
    "first payload byte flipped": (lambda b: _flip(b, _payload_start(b)), ais.SessionFileError,
                                   "fails its checksum"),
    "last buffer byte flipped": (lambda b: _flip(b, len(b) - 1), ais.SessionFileError, "fails its checksum"),
    "other format version": (lambda b: b[:8] + (4).to_bytes(4, "little") + b[12:], ais.SessionFileError,
                             "format version 4; this build reads versions 1 to 3"),
    "not a session file": (lambda b: os.urandom(len(b)), ais.SessionFileError, "not an aoti_sessions"),
    "empty": (lambda b: b"", ais.SessionFileError, "is empty, not a session file"),
}


def test_an_attachment_travels_with_the_state(decoder_engine: ais.Engine, tmp_path: Path) -> None:
    """Session.save(path, attachment): the bytes come back from the same file
    with the state (format version 3, under the header's checksum); a file
    without one gives b"", and an attachment over 16 MiB is refused."""
    path = tmp_path / "s.ais"
    with decoder_engine.new_session() as s:
        GreedyDecoding(s, PROMPTS[1], 3).run()
        state = s.state()
        s.save(path, b"\x00mine\xff" * 1000)
        assert int.from_bytes(path.read_bytes()[8:12], "little") == 3
        loaded, attached = decoder_engine.load_session_attached(path)
        with loaded:
            assert attached == b"\x00mine\xff" * 1000 and _same_state(loaded.state(), state)
        with decoder_engine.load_session(path) as plain:  # read as any session file
            assert _same_state(plain.state(), state)
        flipped = tmp_path / "flipped.ais"
        raw = path.read_bytes()
        at = raw.index(b"mine")
        flipped.write_bytes(raw[:at] + b"M" + raw[at + 1:])
        with pytest.raises(ais.SessionFileError, match="header checksum"):
            decoder_engine.load_session_attached(flipped)
        s.save(path)
        assert int.from_bytes(path.read_bytes()[8:12], "little") == 1
        loaded, attached = decoder_engine.load_session_attached(path)
        loaded.close()
        assert attached == b""
        with pytest.raises(ValueError, match="attachment holds at most 16777216 bytes"):
            s.save(tmp_path / "big.ais", b"x" * ((16 << 20) + 1))
        assert not (tmp_path / "big.ais").exists()
        with pytest.raises(TypeError, match="attachment must be bytes"):
            s.save(path, "text")  # type: ignore[arg-type]


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupt_files_are_refused_and_change_nothing(decoder_engine: ais.Engine, saved, tmp_path: Path,
                                                      case: str) -> None:
    path, state = saved
    mutate, error, message = CORRUPTIONS[case]
    bad = tmp_path / "bad.ais"
    bad.write_bytes(mutate(path.read_bytes()))
    with decoder_engine.new_session() as other:
        GreedyDecoding(other, PROMPTS[5], 2).run()
        other_state = other.state()
        before = decoder_engine.stats()
        with pytest.raises(error, match=message):
            decoder_engine.load_session(bad)
        after = decoder_engine.stats()
        for key in ("live_sessions", "device_bytes", "host_bytes", "loads", "sessions_created"):
            assert after[key] == before[key], key
        assert _same_state(other.state(), other_state)
        # The engine still loads a good file.
        with decoder_engine.load_session(path) as loaded:
            assert _same_state(loaded.state(), state)


def test_refused_files_allocate_nothing(decoder_pkg: Path, counter_pkg: Path, device: str,
                                       tmp_path: Path) -> None:
    """Files refused by their header (missing, not a session file, another
    model) are refused before any host or device memory is taken."""
    with ais.Engine(counter_pkg, device=device) as counter, counter.new_session() as c:
        c.save(tmp_path / "counter.ais")
    (tmp_path / "junk.ais").write_bytes(b"junk" * 100)
    with ais.Engine(decoder_pkg, device=device) as eng:  # a fresh engine: no spare host block yet
        before = eng.stats()
        for name, error in (("missing.ais", ais.SessionFileNotFoundError), ("junk.ais", ais.SessionFileError),
                            ("counter.ais", ais.ModelMismatchError)):
            with pytest.raises(error):
                eng.load_session(tmp_path / name)
            after = eng.stats()
            for key in ("host_spare_bytes", "host_bytes", "device_bytes", "live_sessions"):
                assert after[key] == before[key], (name, key)


def test_missing_files_folders_and_pipes(decoder_engine: ais.Engine, tmp_path: Path) -> None:
    with pytest.raises(ais.SessionFileNotFoundError, match="nothere.ais") as info:
        decoder_engine.load_session(tmp_path / "nothere.ais")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ais.Error)
    with pytest.raises(ais.SessionFileError, match="folder"):
        decoder_engine.load_session(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading must not block
    with pytest.raises(ais.SessionFileError, match="not a regular file"):
        decoder_engine.load_session(fifo)


def test_saves_are_atomic(decoder_engine: ais.Engine, tmp_path: Path) -> None:
    path = tmp_path / "s.ais"
    with decoder_engine.new_session() as s:
        s.save(path)
        first = path.read_bytes()
        GreedyDecoding(s, PROMPTS[6], 3).run()
        s.save(path)  # replaces the file as a whole
        assert path.read_bytes() != first and len(path.read_bytes()) == len(first)
        with pytest.raises(ais.SessionFileError, match="cannot create"):
            s.save(tmp_path / "no" / "such" / "folder" / "s.ais")
        with pytest.raises(ais.SessionFileError):
            s.save(tmp_path)  # a folder: the rename fails, nothing is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.ais"]


def test_a_snapshot_is_the_state_when_taken(decoder_engine: ais.Engine, tmp_path: Path) -> None:
    """Session.snapshot copies the state out; the session runs on and the
    copy, written later (after the session is gone too), is the state of
    that moment, whole: a file that loads as it, as save's does."""
    with decoder_engine.new_session() as s:
        GreedyDecoding(s, PROMPTS[7], 3).run()
        then = s.state()
        snapshot = s.snapshot()
        assert snapshot.nbytes == decoder_engine.bytes_per_session
        GreedyDecoding(s, PROMPTS[8], 3).run()  # the session moves on
        assert not _same_state(s.state(), then)
        s.save(tmp_path / "saved.ais")
        snapshot.write(tmp_path / "then.ais", b"kept")
    snapshot.write(tmp_path / "again.ais")  # its session closed: the copy stands
    for name, want in (("then.ais", then), ("again.ais", then)):
        with decoder_engine.load_session(tmp_path / name) as loaded:
            assert _same_state(loaded.state(), want), name
    loaded, attached = decoder_engine.load_session_attached(tmp_path / "then.ais")
    loaded.close()
    assert attached == b"kept"
    assert (tmp_path / "then.ais").read_bytes() != (tmp_path / "saved.ais").read_bytes()
    with pytest.raises(TypeError, match="attachment must be bytes, got str"):
        snapshot.write(tmp_path / "x.ais", "text")  # type: ignore[arg-type]
    with pytest.raises(ais.SessionFileError, match="cannot create"):
        snapshot.write(tmp_path / "no" / "such" / "x.ais")
    with pytest.raises(ais.SessionClosedError):
        s.snapshot()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.ais", "saved.ais", "then.ais"]


def test_files_from_another_model_are_refused(decoder_engine: ais.Engine, saved, counter_pkg: Path,
                                              counter_tall_pkg: Path, prefill_pkg: Path, device: str,
                                              tmp_path: Path) -> None:
    path, state = saved
    # Other buffers altogether.
    with ais.Engine(counter_pkg, device=device) as counter:
        with pytest.raises(ais.ModelMismatchError, match="lacks buffers this engine has"):
            counter.load_session(path)
        with counter.new_session() as c:
            c.save(tmp_path / "counter.ais")
        with pytest.raises(ais.ModelMismatchError, match="acc"):
            decoder_engine.load_session(tmp_path / "counter.ais")
    # Same FQNs, another shape: refused even with strict=False.
    with ais.Engine(counter_tall_pkg, device=device) as tall:
        with pytest.raises(ais.ModelMismatchError,
                           match=r"buffer 'acc' is float32\[4, 8\].* in the file but float32\[6, 8\]"):
            tall.load_session(tmp_path / "counter.ais", strict=False)
    # Same buffers, another compiled library (the decoder compiled for 8
    # tokens per call): refused unless strict=False.
    with ais.Engine(prefill_pkg, device=device) as prefill:
        with pytest.raises(ais.ModelMismatchError, match="another compiled library"):
            prefill.load_session(path)
        with prefill.load_session(path, strict=False) as s:
            assert _same_state(s.state(), state)


def test_the_fingerprint_is_of_the_files_loaded(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    """The model files are fingerprinted when the engine loads them: touching,
    replacing or deleting them afterwards neither breaks saves nor changes what
    a save vouches for."""
    from aoti_sessions._package import open_model
    original = Path(open_model(counter_cpu_pkg)[0].library).read_bytes()
    x, slot = torch.ones(1, 8), torch.tensor([1])
    # Fresh files each time: a library still mapped is never written in place.
    for change in ("touch", "replace", "delete"):
        library = tmp_path / f"{change}.so"
        library.write_bytes(original)
        with ais.Engine(library, mutable=["acc", "hits"]) as eng, eng.new_session() as s:
            s(x, slot)
            if change == "touch":
                os.utime(library, (1, 1))
            elif change == "replace":  # another file at the same path
                replacement = tmp_path / "other.so"
                replacement.write_bytes(original + b"\0")
                os.replace(replacement, library)
            else:
                library.unlink()
            s.save(tmp_path / f"{change}.ais")
            state = s.state()
        same = tmp_path / f"{change}-same-bytes.so"
        same.write_bytes(original)
        with ais.Engine(same, mutable=["acc", "hits"]) as eng:
            with eng.load_session(tmp_path / f"{change}.ais") as loaded:  # strict: same library
                assert _same_state(loaded.state(), state)
    other = tmp_path / "other-model.so"
    other.write_bytes(original + b"\0")
    with ais.Engine(other, mutable=["acc", "hits"]) as eng:
        with pytest.raises(ais.ModelMismatchError, match="another compiled library"):
            eng.load_session(tmp_path / "replace.ais")


def test_saves_work_after_the_package_cache_is_cleared(counter_cpu_pkg: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    with ais.Engine(counter_cpu_pkg) as eng, eng.new_session() as s:
        import shutil
        shutil.rmtree(tmp_path / "cache")  # the extracted library is gone
        s.save(tmp_path / "s.ais")
        with eng.load_session(tmp_path / "s.ais") as loaded:
            assert _same_state(loaded.state(), s.state())


def test_files_from_other_weights_are_refused(decoder_methods_pkg: Path, device: str, tmp_path: Path) -> None:
    """The same libraries with one weight changed in the package's weights file."""
    other = tmp_path / "other-weights.pt2"
    with zipfile.ZipFile(decoder_methods_pkg) as src, zipfile.ZipFile(other, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("aoti_sessions/weights.bin"):
                data = _flip(data, 100)
            dst.writestr(info, data)
    with ais.Engine(decoder_methods_pkg, device=device) as eng, eng.new_session() as s:
        s.save(tmp_path / "s.ais")
    with ais.Engine(other, device=device) as eng:
        with pytest.raises(ais.ModelMismatchError, match="other weights"):
            eng.load_session(tmp_path / "s.ais")
        eng.load_session(tmp_path / "s.ais", strict=False).close()
