"""Container lanes: a session that is hot keeps a container bound to its state,
so switching among hot sessions binds nothing; sessions on different threads
run at once on different lanes; weight updates reach every lane. On the CPU
and, where there is one, on a GPU (graphs off there: the eager lanes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from conftest import counter_inputs, on_threads


def _engine(pkg: Path, device: str, lanes: int) -> ais.Engine:
    return ais.Engine(pkg, device=device, lanes=lanes, cuda_graphs=False)


def _round_robin(engine: ais.Engine, device: str, sessions: int, rounds: int) -> list[list[torch.Tensor]]:
    ss = [engine.new_session() for _ in range(sessions)]
    out: list[list[torch.Tensor]] = [[] for _ in ss]
    for r in range(rounds):
        for i, s in enumerate(ss):
            x, slot = counter_inputs(device, value=0.25 * (i + 1) + r, slot=(i + r) % 4)
            out[i].append(s(x, slot).cpu())
    for s in ss:
        s.close()
    return out


def test_hot_sessions_switch_without_binding(counter_pkg: Path, device: str) -> None:
    with _engine(counter_pkg, device, 3) as hot, _engine(counter_pkg, device, 1) as one:
        got = _round_robin(hot, device, 3, 10)
        want = _round_robin(one, device, 3, 10)
        assert hot.stats()["binds"] == 3  # each session's first run only
        assert one.stats()["binds"] == 30  # one lane: every switch binds
        assert hot.stats()["lanes"] == 3
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_more_hot_sessions_than_lanes_take_the_least_recently_used(counter_pkg: Path, device: str) -> None:
    with _engine(counter_pkg, device, 2) as engine:
        a, b, c = (engine.new_session() for _ in range(3))
        x, slot = counter_inputs(device, value=1.0)
        for s in (a, b, a, b):
            s(x, slot)
        assert engine.stats()["binds"] == 2
        c(x, slot)  # takes a's lane, the least recently used
        b(x, slot)  # still bound
        assert engine.stats()["binds"] == 3
        a(x, slot)  # its lane went to c: binds again
        assert engine.stats()["binds"] == 4


@pytest.mark.parametrize("lanes", [1, 4])
def test_threads_on_their_own_sessions_equal_serial(counter_pkg: Path, device: str, lanes: int) -> None:
    k, steps = 4, 40

    def drive(engine: ais.Engine, i: int) -> list[torch.Tensor]:
        with engine.new_session() as s:
            out = []
            for step in range(steps):
                x, slot = counter_inputs(device, value=0.5 * i + step, slot=(i + step) % 4)
                out.append(s(x, slot).cpu())
            return out

    with _engine(counter_pkg, device, 1) as serial_engine:
        serial = [drive(serial_engine, i) for i in range(k)]
    with _engine(counter_pkg, device, lanes) as engine:
        results = on_threads(k, device, lambda i: drive(engine, i))
        assert engine.stats()["runs"] == k * steps
    for got, want in zip(results, serial):
        assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("double_buffer", [False, True])
def test_weight_updates_reach_every_lane(counter_pkg: Path, device: str, double_buffer: bool) -> None:
    new = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    outputs = []
    for lanes in (3, 1):
        with _engine(counter_pkg, device, lanes) as engine:
            ss = [engine.new_session() for _ in range(3)]
            x, slot = counter_inputs(device, value=1.0)
            for s in ss:  # each bound to a lane of its own (with 3 lanes)
                s(x, slot)
            engine.update_weights({"lin.weight": new}, double_buffer=double_buffer)
            outputs.append([s(x, slot).cpu() for s in ss])
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


def test_lanes_option_is_checked(counter_cpu_pkg: Path) -> None:
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match="lanes must be between 1 and 64"):
            ais.Engine(counter_cpu_pkg, device="cpu", lanes=bad)
    with pytest.raises(TypeError, match="lanes must be an int"):
        ais.Engine(counter_cpu_pkg, device="cpu", lanes=2.0)  # type: ignore[arg-type]


def test_cuda_graphs_option_is_checked(counter_cpu_pkg: Path) -> None:
    with pytest.raises(ValueError, match="cuda_graphs must be 'auto', True or False"):
        ais.Engine(counter_cpu_pkg, device="cpu", cuda_graphs="always")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA engine"):
        ais.Engine(counter_cpu_pkg, device="cpu", cuda_graphs=True)
    with ais.Engine(counter_cpu_pkg, device="cpu", cuda_graphs="auto") as engine, engine.new_session() as s:
        x, slot = counter_inputs("cpu", value=1.0)
        for _ in range(5):
            s(x, slot)
        assert engine.stats()["graph_captures"] == 0  # nothing to capture on a CPU
