"""Per-session CUDA graphs: replays equal eager runs bit for bit, across
interleaved sessions, every lifecycle operation, weight updates, threads and
streams; methods that cannot be captured fall back or raise; nothing
synchronises the device. Skipped without a GPU."""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
import modeldefs
from aoti_sessions._compile import compile_cached
from aoti_sessions.demo import compiled_decoder
from aoti_sessions.models import SMALL
from conftest import FAST, on_threads, requires_cuda

pytestmark = requires_cuda

STEPS = 12  # decode steps per check: past the 3 warm-up runs and the capture


@pytest.fixture(scope="module")
def small_cuda() -> Path:
    return compiled_decoder(SMALL, "cuda")


@pytest.fixture(scope="module")
def graphs(small_cuda: Path):
    with ais.Engine(small_cuda, device="cuda") as engine:
        yield engine


@pytest.fixture(scope="module")
def eager(small_cuda: Path):
    with ais.Engine(small_cuda, device="cuda", cuda_graphs=False) as engine:
        yield engine


def _step(session: ais.Session, position: int, token: int) -> torch.Tensor:
    tokens = torch.tensor([[token]], device="cuda")
    positions = torch.tensor([position], device="cuda")
    return session(tokens, positions)


def _decode(session: ais.Session, start: int, steps: int, first: int = 3) -> list[torch.Tensor]:
    """Greedy decoding from `start`: every step's logits (copied to the host)."""
    token, out = first, []
    for position in range(start, start + steps):
        logits = _step(session, position, token)
        out.append(logits.cpu())
        token = int(logits[0, -1].argmax())
    return out


def _interleaved(engine: ais.Engine, sessions: int, steps: int) -> list[list[torch.Tensor]]:
    ss = [engine.new_session() for _ in range(sessions)]
    tokens = [3 + i for i in range(sessions)]
    out: list[list[torch.Tensor]] = [[] for _ in ss]
    for position in range(steps):
        for i, s in enumerate(ss):
            logits = _step(s, position, tokens[i])
            out[i].append(logits.cpu())
            tokens[i] = int(logits[0, -1].argmax())
    for s in ss:
        s.close()
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_replays_equal_eager_for_interleaved_sessions(graphs: ais.Engine, eager: ais.Engine) -> None:
    before = graphs.stats()
    replayed = _interleaved(graphs, 4, STEPS)
    after = graphs.stats()
    reference = _interleaved(eager, 4, STEPS)
    assert after["graph_captures"] - before["graph_captures"] >= 4
    assert after["graph_replays"] - before["graph_replays"] >= 4 * (STEPS - 6)
    for got, want in zip(replayed, reference):
        assert _equal(got, want)
    # A closed session's graphs are gone.
    assert after["graphs"] == before["graphs"]
    assert eager.stats()["graph_captures"] == 0


def test_outputs_stay_valid_after_the_next_run(graphs: ais.Engine) -> None:
    with graphs.new_session() as s:
        _decode(s, 0, STEPS)
        first = _step(s, STEPS, 5)
        kept = first.clone()
        _step(s, STEPS + 1, 6)
        assert torch.equal(first, kept), "a returned output was overwritten by the next replay"


def test_output_views_are_the_graphs_own(small_cuda: Path) -> None:
    with ais.Engine(small_cuda, device="cuda", graph_output_views=True) as engine, engine.new_session() as s:
        _decode(s, 0, STEPS)
        assert engine.stats()["graph_replays"] > 0
        view = _step(s, STEPS, 5)
        again = _step(s, STEPS + 1, 6)
        assert view.data_ptr() == again.data_ptr()  # zero-copy: the same memory, rewritten


def _reference_after(eager: ais.Engine, prefix: int, op) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    with eager.new_session() as s:
        _decode(s, 0, prefix)
        s = op(s) or s
        return _decode(s, prefix, STEPS, first=7)


@pytest.mark.parametrize("op", ["reset", "fork", "load_state", "offload_restore", "save_load"])
def test_lifecycle_operations_keep_graphs_right(graphs: ais.Engine, eager: ais.Engine, op: str,
                                                tmp_path: Path) -> None:
    def apply(engine: ais.Engine):  # type: ignore[no-untyped-def]
        def run(s: ais.Session):  # type: ignore[no-untyped-def]
            if op == "reset":
                s.reset()
            elif op == "fork":
                return s.fork()
            elif op == "load_state":
                other = engine.new_session()
                _decode(other, 0, 5, first=9)
                s.load_state(other.state())
                other.close()
            elif op == "offload_restore":
                s.offload()
                s.restore()
            elif op == "save_load":
                path = tmp_path / f"{id(engine)}.session"
                s.save(path)
                return engine.load_session(path)
            return None
        return run

    before = graphs.stats()
    with graphs.new_session() as s:
        _decode(s, 0, STEPS)  # captured and replaying
        t = apply(graphs)(s) or s
        got = _decode(t, STEPS, STEPS, first=7)
    want = _reference_after(eager, STEPS, apply(eager))
    assert _equal(got, want)
    after = graphs.stats()
    assert after["graph_replays"] - before["graph_replays"] >= STEPS
    if op in ("fork", "offload_restore", "save_load"):  # a new block: captured again
        assert after["graph_captures"] - before["graph_captures"] >= 2


@pytest.mark.parametrize("double_buffer", [False, True])
def test_weight_updates_reach_replays(small_cuda: Path, double_buffer: bool) -> None:
    with ais.Engine(small_cuda, device="cuda") as g, ais.Engine(small_cuda, device="cuda", cuda_graphs=False) as e:
        name = next(w["fqn"] for w in g.weights() if w["fqn"].endswith("weight"))
        shape = next(w["sizes"] for w in g.weights() if w["fqn"] == name)
        dtype = getattr(torch, next(w["dtype"] for w in g.weights() if w["fqn"] == name))
        new = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        results = []
        for engine in (g, e):
            with engine.new_session() as s:
                _decode(s, 0, STEPS)
                engine.update_weights({name: new}, double_buffer=double_buffer)
                results.append(_decode(s, STEPS, STEPS, first=7))
        assert _equal(results[0], results[1])
        stats = g.stats()
        assert stats["graph_replays"] >= 2 * (STEPS - 4)
        assert stats["graph_captures"] == (2 if double_buffer else 1)  # new weight addresses: again


def test_threads_on_their_own_streams_equal_serial(graphs: ais.Engine, eager: ais.Engine) -> None:
    k = 4
    serial = [_decode_alone(eager, 3 + i) for i in range(k)]
    results = on_threads(k, "cuda", lambda i: _decode_alone(graphs, 3 + i))
    for got, want in zip(results, serial):
        assert _equal(got, want)
    assert graphs.stats()["graph_pools"] >= 2  # one pool per capture stream


def _decode_alone(engine: ais.Engine, first: int) -> list[torch.Tensor]:
    with engine.new_session() as s:
        out = _decode(s, 0, 2 * STEPS, first=first)
        torch.cuda.current_stream().synchronize()
        return out


def test_eviction_recaptures(small_cuda: Path, eager: ais.Engine) -> None:
    with ais.Engine(small_cuda, device="cuda") as probe:
        per = probe.bytes_per_session
    with ais.Engine(small_cuda, device="cuda", memory_budget=2 * per) as engine:
        got = _interleaved(engine, 3, STEPS)  # three sessions, room for two: evictions every step
        stats = engine.stats()
    # Every restore is a new block: the graph is captured again, then replayed.
    assert stats["evictions"] > 0
    assert stats["graph_captures"] > 3 and stats["graph_replays"] >= stats["graph_captures"]
    assert all(_equal(a, b) for a, b in zip(got, _interleaved(eager, 3, STEPS)))


def test_no_device_synchronisation_on_replay_create_close(graphs: ais.Engine) -> None:
    busy, ours = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(ours):
        s = graphs.new_session()
        _decode(s, 0, STEPS)  # warm, captured on this stream
        before = graphs.stats()["graph_replays"]
        torch.cuda.synchronize()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU time
        start = time.perf_counter()
        for position in range(STEPS, STEPS + 8):
            _step(s, position, 4)  # replays (copies in and out included)
        other = graphs.new_session()
        other.close()
        elapsed = time.perf_counter() - start
        still_busy = not busy.query()
    torch.cuda.synchronize()
    assert graphs.stats()["graph_replays"] - before == 8
    s.close()
    assert still_busy, f"the other stream finished: something synchronised the device ({elapsed:.3f}s)"
    assert elapsed < 1.0, elapsed


# -- methods that cannot be captured -------------------------------------------------


@pytest.fixture(scope="module")
def host_sync_pkg() -> Path:
    def build():  # type: ignore[no-untyped-def]
        return modeldefs.HostSync().cuda(), tuple(a.cuda() for a in modeldefs.HostSync.example()), None

    return compile_cached(build, (inspect.getsource(modeldefs), "HostSync", "cuda"), name="hostsync-cuda",
                          inductor_configs=FAST)


@pytest.fixture(scope="module")
def batched_pkg() -> Path:
    def build():  # type: ignore[no-untyped-def]
        return modeldefs.Batched().cuda(), tuple(a.cuda() for a in modeldefs.Batched.example()), None

    batch = torch.export.Dim("batch", min=2, max=64)
    return compile_cached(build, (inspect.getsource(modeldefs), "Batched", "cuda"), name="batched-cuda",
                          dynamic_shapes=({0: batch},), inductor_configs=FAST)


def test_host_sync_falls_back_to_eager_once_logged(host_sync_pkg: Path, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.full((8,), 0.3, device="cuda")
    with ais.Engine(host_sync_pkg, device="cuda", cuda_graphs=False) as e, e.new_session() as s:
        want = [s(x).cpu() for _ in range(8)]
    with caplog.at_level(logging.WARNING, logger="aoti_sessions"):
        with ais.Engine(host_sync_pkg, device="cuda") as g, g.new_session() as s:
            got = [s(x).cpu() for _ in range(8)]
            stats = g.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert stats["graph_replays"] == 0 and stats["graphs"] == 0
    notes = [r.getMessage() for r in caplog.records if "cannot be captured" in r.getMessage()]
    assert len(notes) == 1 and "method 'model'" in notes[0], notes


def test_host_sync_raises_with_graphs_required(host_sync_pkg: Path) -> None:
    x = torch.full((8,), 0.3, device="cuda")
    with ais.Engine(host_sync_pkg, device="cuda", cuda_graphs=True) as g, g.new_session() as s:
        other = g.new_session()
        for _ in range(3):
            s(x)  # warm-up runs are eager
        with pytest.raises(ais.RunError, match="cuda_graphs=True: method 'model' cannot be captured"):
            s(x)
        # Nothing ran: the state holds the three warm-up steps; the other session is untouched.
        assert torch.allclose(s.state()["acc"], torch.full((8,), 0.9, device="cuda"))
        assert torch.equal(other.state()["acc"], torch.zeros(8, device="cuda"))
        # Every later capture of the method raises the same way, and the engine stays usable.
        with pytest.raises(ais.RunError, match="cannot be captured"):
            s(x)
        assert torch.allclose(s.state()["acc"], torch.full((8,), 0.9, device="cuda"))
        other.close()


def test_dynamic_shapes_run_eagerly_or_raise(batched_pkg: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="dynamic input shapes"):
        ais.Engine(batched_pkg, device="cuda", cuda_graphs=True)
    with caplog.at_level(logging.WARNING, logger="aoti_sessions"):
        with ais.Engine(batched_pkg, device="cuda") as g, g.new_session() as s:
            for n in (2, 5, 3, 2, 7):
                s(torch.ones(n, 8, device="cuda"))
            assert torch.equal(s.state()["acc"].cpu(), torch.full((8,), 19.0))
            assert g.stats()["graph_captures"] == 0
    assert any("dynamic input shapes" in r.getMessage() for r in caplog.records)
