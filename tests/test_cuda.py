"""GPU specifics: device memory per session, streams, no device-wide syncs,
CUDA errors. The suites shared with the CPU run here too, through the
`device` fixture; this file holds what only a GPU has. Skipped without one."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions.demo import GreedyDecoding, compiled_decoder
from aoti_sessions.models import SMALL
from conftest import requires_cuda

pytestmark = requires_cuda

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def gpu_engine():
    with ais.Engine(compiled_decoder(SMALL, "cuda"), device="cuda:0") as engine:
        yield engine


def _free_bytes() -> int:
    # Engines of earlier tests let go of their memory first, not during a measurement.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def test_sessions_have_distinct_device_blocks(gpu_engine: ais.Engine) -> None:
    sessions = [gpu_engine.new_session() for _ in range(4)]
    spans = sorted((s._core.address, s._core.address + gpu_engine.bytes_per_session) for s in sessions)
    assert all(start != 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "blocks overlap"
    for s in sessions:
        s.close()
        assert s._core.address == 0


def test_device_memory_grows_per_session_and_returns(gpu_engine: ais.Engine) -> None:
    per = gpu_engine.bytes_per_session
    start = _free_bytes()
    n = 64
    sessions = [gpu_engine.new_session() for _ in range(n)]
    grown = start - _free_bytes()
    # The pool maps device memory in chunks (one may be mapped already, by the
    # lanes' parking memory): allow one chunk of slack either way.
    chunk = 32 << 20
    assert n * per - chunk <= grown <= n * per + chunk, f"grew {grown} bytes for {n} sessions of {per}"
    for s in sessions:
        s.close()
    back = _free_bytes()
    # The engine may keep one spare block for the next session (Retain).
    assert back >= start - per - (2 << 20), f"{start - back} bytes not returned after close"


def _decode_on(engine: ais.Engine, streams: list[torch.cuda.Stream]) -> list[int]:
    """Greedy decode, switching to the next stream on every step."""
    with engine.new_session() as s:
        d = GreedyDecoding(s, PROMPT, 8)
        i = 0
        while not d.done:
            with torch.cuda.stream(streams[i % len(streams)]):
                d.step()
            i += 1
        return d.generated


def test_runs_follow_the_current_stream(gpu_engine: ais.Engine) -> None:
    default = _decode_on(gpu_engine, [torch.cuda.current_stream()])
    assert _decode_on(gpu_engine, [torch.cuda.Stream()]) == default
    # A session moving between streams is ordered after its previous work.
    assert _decode_on(gpu_engine, [torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()]) == default


def test_no_device_wide_synchronisation(gpu_engine: ais.Engine) -> None:
    """Session work on one stream never waits for a long kernel on another."""
    busy, ours = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(ours):
        x, p = torch.tensor([[7]], device="cuda"), torch.tensor([0], device="cuda")

        def session_work() -> None:
            s = gpu_engine.new_session()
            s(x, p)
            f = s.fork()
            s.reset()
            f.load_state(f.state())
            f.close()
            s.close()
            ours.synchronize()

        session_work()  # warm-up: kernels loaded, torch's allocator cache filled for this stream
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU time
    start = time.perf_counter()
    with torch.cuda.stream(ours):
        session_work()
    elapsed = time.perf_counter() - start
    still_busy = not busy.query()
    torch.cuda.synchronize()
    assert still_busy, f"the other stream finished: something synchronised the device ({elapsed:.3f}s)"
    assert elapsed < 1.0, elapsed


def test_out_of_memory_creates_nothing(gpu_engine: ais.Engine) -> None:
    per = gpu_engine.bytes_per_session
    before = gpu_engine.stats()
    hog = []
    chunk = 1 << 30
    while chunk >= per // 2:  # take the device's memory until less than a session is left
        try:
            hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            chunk //= 2
    created = []
    try:
        with pytest.raises(ais.DeviceError, match="out of memory"):
            for _ in range(64):  # whatever fragment is left must run out
                created.append(gpu_engine.new_session())
        during = gpu_engine.stats()
    finally:
        del hog
        torch.cuda.empty_cache()
    # The failed session left nothing behind: the counters hold the ones made.
    assert during["live_sessions"] == before["live_sessions"] + len(created)
    assert during["live_bytes"] == before["live_bytes"] + len(created) * per
    for s in created:
        s.close()
    with gpu_engine.new_session() as s:  # the engine still works
        GreedyDecoding(s, PROMPT, 2).run()


def test_unknown_device_index(gpu_engine: ais.Engine) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        ais.Engine(compiled_decoder(SMALL, "cuda"), device="cuda:63")
