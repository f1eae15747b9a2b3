"""Bad input fails cleanly, before the model runs, and harms no other session."""

from __future__ import annotations

import os
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from conftest import counter_inputs, requires_cuda


@contextmanager
def bystander(engine: ais.Engine):
    """A session with some state that must come through unchanged and usable."""
    s = engine.new_session()
    x, slot = counter_inputs(engine.device, 1.0, 2)
    s(x, slot)
    before = s.state()
    reference = engine.new_session()
    reference.load_state(before)
    yield s
    after = s.state()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"bystander state {k} changed"
    assert torch.equal(s(x, slot), reference(x, slot)), "bystander no longer runs correctly"
    s.close()
    reference.close()


def _x(device, shape=(1, 8), dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, device=device)


def _slot(device, dtype=torch.int64):
    return torch.tensor([0], dtype=dtype, device=device)


@pytest.mark.parametrize(
    "make_args, error, words",
    [
        (lambda d: (_x(d),), ValueError, "takes 2 tensor inputs, got 1"),
        (lambda d: (_x(d), _slot(d), _slot(d)), ValueError, "takes 2 tensor inputs, got 3"),
        (lambda d: (_x(d, dtype=torch.float64), _slot(d)), TypeError, "dtype float64, expected float32"),
        (lambda d: (_x(d), _slot(d, torch.int32)), TypeError, "dtype int32, expected int64"),
        (lambda d: (_x(d, (2, 8)), _slot(d)), ValueError, "shape [2, 8], expected [1, 8]"),
        (lambda d: (_x(d, (8,)), _slot(d)), ValueError, "shape [8], expected [1, 8]"),
        (lambda d: (_x("meta"), _slot(d)), ValueError, "but the engine runs on {engine}"),
        (lambda d: (_x(d), 3), TypeError, "input 1 of method 'model' is a int"),
        (lambda d: (None, _slot(d)), TypeError, "is a NoneType"),
    ],
)
def test_bad_inputs(counter_engine: ais.Engine, device: str, make_args, error, words) -> None:
    words = words.format(engine=counter_engine.device)
    with bystander(counter_engine), counter_engine.new_session() as s:
        before = s.state()
        with pytest.raises(error) as info:
            s(*make_args(device))
        assert words in str(info.value)
        # The failing session is untouched too: checks run before the model.
        for k, v in s.state().items():
            assert torch.equal(v, before[k])
        s(*counter_inputs(device))


@requires_cuda
def test_cuda_engine_rejects_host_tensors(counter_cuda_pkg) -> None:
    with ais.Engine(counter_cuda_pkg, device="cuda:0") as eng, bystander(eng), eng.new_session() as s:
        with pytest.raises(ValueError, match="input 0 of method 'model' is on cpu, but the engine runs on cuda:0"):
            s(torch.randn(1, 8), torch.tensor([0], device="cuda"))
        with pytest.raises(ValueError, match="input 1 of method 'model' is on cpu"):
            s(torch.randn(1, 8, device="cuda"), torch.tensor([0]))


def test_non_contiguous_input_is_made_contiguous(counter_engine: ais.Engine, device: str) -> None:
    x = torch.randn(8, 1, device=device).t()  # [1, 8], strides (1, 1): contiguous by the size-1 rule
    wide = torch.randn(8, 2, device=device).t()[:1]  # [1, 8] with stride (1, 2): really strided
    assert not wide.is_contiguous()
    slot = torch.tensor([1], device=device)
    with counter_engine.new_session() as a, counter_engine.new_session() as b:
        assert torch.equal(a(wide, slot), b(wide.contiguous(), slot))
        a(x, slot)
        # A slice at a storage offset whose size-1 dim has another stride: the
        # view keeps its offset (it used to be applied twice).
        rows = torch.randn(3, 8, device=device)
        sliced = rows[2:].as_strided((1, 8), (5, 1), rows.storage_offset() + 16)
        assert sliced.storage_offset() == 16 and sliced.stride() == (5, 1)
        with counter_engine.new_session() as c, counter_engine.new_session() as d:
            assert torch.equal(c(sliced, slot), d(sliced.clone(), slot))


def test_model_failure_is_a_run_error(counter_cpu_pkg) -> None:
    # CPU only: on a GPU an out-of-bounds index is a device-side assert, which
    # poisons the whole CUDA context (nothing a runtime can recover from).
    with ais.Engine(counter_cpu_pkg) as engine, bystander(engine), engine.new_session() as s:
        # torch >= 2.13 hands the runtime's message over; older ones only print it.
        has_message = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
        reason = "index out of bounds" if has_message else "printed the reason to stderr"
        with pytest.raises(ais.RunError, match=reason):
            s(*counter_inputs("cpu", slot=100))
        s(*counter_inputs("cpu", slot=1))  # still usable


def test_unknown_method(counter_engine: ais.Engine, device: str) -> None:
    with counter_engine.new_session() as s:
        with pytest.raises(ValueError, match="unknown method 'decode'; this engine has: model"):
            s.run("decode", *counter_inputs(device))


def test_closed_session(counter_engine: ais.Engine, device: str) -> None:
    with bystander(counter_engine):
        s = counter_engine.new_session()
        s.close()
        s.close()  # idempotent
        assert s.closed
        for call in (lambda: s(*counter_inputs(device)), s.state, s.reset, s.fork,
                     lambda: s.load_state({})):
            with pytest.raises(ais.SessionClosedError, match="is closed"):
                call()


def test_closed_engine(counter_pkg, device: str) -> None:
    eng = ais.Engine(counter_pkg, device=device)
    s = eng.new_session()
    eng.close()
    assert eng.closed and s.closed
    with pytest.raises(ais.SessionClosedError):
        s(*counter_inputs(device))
    with pytest.raises(ais.SessionClosedError, match="engine is closed"):
        eng.new_session()


def test_max_sessions(counter_pkg, device: str) -> None:
    with ais.Engine(counter_pkg, device=device, max_sessions=2) as eng:
        a, b = eng.new_session(), eng.new_session()
        with bystander_running(a):
            with pytest.raises(ais.CapacityError, match="max_sessions=2 reached: 2 sessions are open"):
                eng.new_session()
            with pytest.raises(ais.CapacityError):
                a.fork()
        assert eng.stats()["live_sessions"] == 2
        b.close()
        eng.new_session().close()


def test_memory_budget_without_host_tier_refuses(counter_pkg, device: str) -> None:
    # host_budget=0: nothing may be offloaded, so a full device budget refuses.
    with ais.Engine(counter_pkg, device=device, memory_budget=1200, host_budget=0) as eng:
        per = eng.bytes_per_session
        sessions = [eng.new_session() for _ in range(1200 // per)]
        with pytest.raises(ais.CapacityError) as info:
            eng.new_session()
        msg = str(info.value)
        assert "memory_budget=1200 bytes" in msg and f"needs {per}" in msg
        assert f"hold {len(sessions) * per} bytes" in msg and "host_budget=0 bytes" in msg
        assert eng.stats()["live_bytes"] == len(sessions) * per  # nothing allocated
        with pytest.raises(ais.CapacityError, match="host_budget=0 bytes is full"):
            sessions[1].offload()
        assert sessions[1].resident
        sessions[0].close()
        eng.new_session().close()


@contextmanager
def bystander_running(session: ais.Session):
    x, slot = counter_inputs(session.engine.device)
    session(x, slot)
    before = session.state()
    yield
    assert all(torch.equal(session.state()[k], v) for k, v in before.items())
    session(x, slot)


@pytest.mark.parametrize(
    "state, error, words",
    [
        ({"acc": torch.zeros(4, 8)}, ValueError, "missing ['hits']"),
        ({"acc": torch.zeros(4, 8), "hits": torch.zeros(4, dtype=torch.int64), "x": torch.zeros(1)},
         ValueError, "unexpected ['x']"),
        ({"acc": torch.zeros(4, 8, dtype=torch.float16), "hits": torch.zeros(4, dtype=torch.int64)},
         TypeError, "state for 'acc' has dtype float16, expected float32"),
        ({"acc": torch.zeros(4, 9), "hits": torch.zeros(4, dtype=torch.int64)}, ValueError, "shape [4, 9]"),
        ({"acc": [0.0] * 32, "hits": torch.zeros(4, dtype=torch.int64)}, TypeError, "is a list"),
        ([("acc", torch.zeros(4, 8))], TypeError, "must be a mapping"),
    ],
)
def test_bad_state(counter_engine: ais.Engine, device: str, state, error, words) -> None:
    with bystander(counter_engine), counter_engine.new_session() as s:
        s(*counter_inputs(device))
        before = s.state()
        with pytest.raises(error) as info:
            s.load_state(state)
        assert words in str(info.value)
        assert all(torch.equal(s.state()[k], v) for k, v in before.items())


def test_bad_engine_arguments(counter_cpu_pkg) -> None:
    with pytest.raises(ValueError, match="max_sessions must be positive"):
        ais.Engine(counter_cpu_pkg, max_sessions=0)
    with pytest.raises(ValueError, match="memory_budget must be >= 0"):
        ais.Engine(counter_cpu_pkg, memory_budget=-5)
    # -1 is no longer a hidden "unlimited" (None is): refused like any negative.
    with pytest.raises(ValueError, match="memory_budget must be >= 0 bytes, got -1"):
        ais.Engine(counter_cpu_pkg, memory_budget=-1)
    with pytest.raises(ValueError, match="max_sessions must be positive, got -1"):
        ais.Engine(counter_cpu_pkg, max_sessions=-1)
    with pytest.raises(ValueError, match="host_budget must be >= 0"):
        ais.Engine(counter_cpu_pkg, host_budget=-5)
    with pytest.raises(TypeError, match="host_budget must be an int"):
        ais.Engine(counter_cpu_pkg, host_budget=2.5)
    with pytest.raises(ValueError, match="idle_timeout must be > 0"):
        ais.Engine(counter_cpu_pkg, idle_timeout=0)
    with pytest.raises(ValueError, match="idle_timeout must be > 0 seconds and finite"):
        ais.Engine(counter_cpu_pkg, idle_timeout=float("inf"))
    with pytest.raises(ValueError, match="idle_action must be"):
        ais.Engine(counter_cpu_pkg, idle_timeout=1, idle_action="drop")
    with pytest.raises(TypeError, match="max_sessions must be an int"):
        ais.Engine(counter_cpu_pkg, max_sessions=1.5)
    with pytest.raises(TypeError, match="not a single string"):
        ais.Engine(counter_cpu_pkg, mutable="acc")
    # A message quoting a huge input stays small: its start and end.
    with pytest.raises(ais.PackageError, match=r"mutable FQN 'xxx.*bytes left out.*xxx") as huge:
        ais.Engine(counter_cpu_pkg, mutable=["x" * 6_000_000])
    assert len(str(huge.value)) <= 1100
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        ais.Engine(counter_cpu_pkg, device="tpu")
    with pytest.raises(ValueError, match="runs models on 'cpu' or 'cuda', not 'meta'"):
        ais.Engine(counter_cpu_pkg, device=torch.device("meta"))
    with pytest.raises(TypeError, match=r"device must be a str \('cpu', 'cuda', 'cuda:N'\) or a torch.device, got int"):
        ais.Engine(counter_cpu_pkg, device=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown method 'mmmm.*' .5000000 characters.; this engine has"):
        ais.Engine(counter_cpu_pkg).new_session().run("m" * 5_000_000)
    with pytest.raises(TypeError, match="model must be a path"):
        ais.Engine(42)
    with pytest.raises(ValueError, match="mapping is empty"):
        ais.Engine({})


def test_package_for_another_device(counter_pkg, device: str) -> None:
    other = "cpu" if device == "cuda" else "cuda"
    with pytest.raises(ais.PackageError, match=f"compiled for {device}, but the engine's device is {other}"):
        ais.Engine(counter_pkg, device=other)


def test_mutable_declarations_fail_closed(counter_pkg, decoder_pkg, device: str) -> None:
    with pytest.raises(ais.PackageError, match="mutable FQN 'nope' matches no constant of any method"):
        ais.Engine(counter_pkg, device=device, mutable=["acc", "hits", "nope"])
    # Leaving out a buffer the program mutates would share it between sessions.
    with pytest.raises(ais.PackageError, match="buffer 'hits' is mutated by the model but not in the mutable set"):
        ais.Engine(counter_pkg, device=device, mutable=["acc"])
    with pytest.raises(ais.PackageError, match="v_cache' is mutated"):
        ais.Engine(decoder_pkg, device=device, mutable=["layers.*.k_cache"])
    # Extra FQNs and patterns are fine: a read-only buffer made per-session.
    with ais.Engine(counter_pkg, device=device, mutable=["acc", "hits", "tab*"]) as eng:
        assert sorted(eng.mutable_fqns) == ["acc", "hits", "table"]
    with ais.Engine(decoder_pkg, device=device, mutable=["layers.*_cache"]) as eng:
        assert len(eng.mutable_fqns) == 8


def test_methods_disagreeing_on_a_buffer(counter_pkg, counter_tall_pkg, device: str) -> None:
    with pytest.raises(ais.PackageError) as info:
        ais.Engine({"a": counter_pkg, "b": counter_tall_pkg}, device=device)
    msg = str(info.value)
    assert "mutable buffer 'acc' is float32[4, 8]" in msg and "in method 'a'" in msg
    assert "float32[6, 8]" in msg and "in method 'b'" in msg


def test_missing_and_broken_packages(tmp_path: Path, counter_cpu_pkg) -> None:
    with pytest.raises(ais.PackageError, match="does not exist"):
        ais.Engine(tmp_path / "missing.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip at all" * 10)
    with pytest.raises(ais.PackageError, match="neither a .pt2 package"):
        ais.Engine(junk)
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(Path(counter_cpu_pkg).read_bytes()[: os.path.getsize(counter_cpu_pkg) // 2])
    with pytest.raises(ais.PackageError):
        ais.Engine(truncated)
    empty = tmp_path / "empty.pt2"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("empty/archive_format", "pt2")
    with pytest.raises(ais.PackageError, match="holds no AOTInductor model"):
        ais.Engine(empty)
    not_a_model = tmp_path / "libnot.so"
    not_a_model.write_bytes(b"\x7fELF garbage")
    with pytest.raises(ais.PackageError, match="cannot load model library"):
        ais.Engine(not_a_model)


@pytest.mark.parametrize(
    "entry",
    ["../escape.txt", "pkg/../../escape.txt", "/abs/escape.txt"],
)
def test_package_entries_that_escape(tmp_path: Path, entry: str, monkeypatch) -> None:
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("pkg/data/aotinductor/model/x.so", b"")
        z.writestr(zipfile.ZipInfo(entry), b"payload")
    with pytest.raises(ais.PackageError, match="escapes the package directory|absolute path"):
        ais.Engine(bad)
    assert not (tmp_path / "escape.txt").exists()
    assert not list((tmp_path / "cache").rglob("escape.txt"))


def test_package_symlink_entry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "link.pt2"
    with zipfile.ZipFile(bad, "w") as z:
        info = zipfile.ZipInfo("pkg/data/aotinductor/model/x.so")
        info.external_attr = (0o120777 << 16)  # a symbolic link to /etc/passwd
        z.writestr(info, "/etc/passwd")
    with pytest.raises(ais.PackageError, match="is a symbolic link"):
        ais.Engine(bad)
