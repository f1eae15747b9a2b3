"""The exception table (aoti_sessions.errors.CORE_ERRORS): every kind of
error the C++ core raises reaches Python as the class the table names, from a
real failure on a real model wherever one can be provoked on this machine, and
no C++ exception escapes untranslated."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions import _core
from aoti_sessions.errors import CORE_ERRORS
from conftest import counter_inputs


def test_the_table_covers_every_core_kind() -> None:
    assert set(_core.error_kinds()) | {"out_of_memory"} == set(CORE_ERRORS)
    # The documented table in the module docstring lists the same rows.
    doc = ais.errors.__doc__ or ""
    for kind, cls in CORE_ERRORS.items():
        assert f"{kind}" in doc and cls.__name__ in doc, kind


# (what C++ throws, the row of the table it must land on): every core kind,
# std::bad_alloc, and any other standard exception (std::out_of_range here).
THROWN = [*((k, k) for k in _core.error_kinds()), ("bad_alloc", "out_of_memory"), ("out_of_range", "internal")]


@pytest.mark.parametrize("thrown, row", THROWN)
def test_the_binding_translates_each_kind(thrown: str, row: str) -> None:
    """A C++ exception of each kind, thrown in the binding's own module."""
    with pytest.raises(BaseException) as info:
        _core._throw_for_test(thrown, "the message")
    assert type(info.value) is CORE_ERRORS[row], (thrown, type(info.value))
    if thrown != "bad_alloc":
        assert "the message" in str(info.value)


# A real failure of each kind, provoked through the public API on the CPU.

def _counter(pkg: Path, **kwargs: object) -> ais.Engine:
    return ais.Engine(pkg, **kwargs)  # type: ignore[arg-type]


def _invalid_argument(pkg: Path, tmp: Path) -> None:
    with _counter(pkg) as eng, eng.new_session() as s:
        s(torch.randn(1, 8))  # one input of two


def _type_mismatch(pkg: Path, tmp: Path) -> None:
    with _counter(pkg) as eng, eng.new_session() as s:
        s(torch.randn(1, 8, dtype=torch.float64), torch.tensor([0]))


def _package(pkg: Path, tmp: Path) -> None:
    _counter(pkg, mutable=["acc", "hits", "nope"])


def _capacity(pkg: Path, tmp: Path) -> None:
    with _counter(pkg, max_sessions=1) as eng, eng.new_session():
        eng.new_session()


def _session_closed(pkg: Path, tmp: Path) -> None:
    with _counter(pkg) as eng:
        s = eng.new_session()
        s.close()
        s.reset()


def _run(pkg: Path, tmp: Path) -> None:
    with _counter(pkg) as eng, eng.new_session() as s:
        s(*counter_inputs("cpu", slot=100))  # the model's own bounds check


def _session_file(pkg: Path, tmp: Path) -> None:
    (tmp / "junk.ais").write_bytes(b"not a session file" * 4)
    with _counter(pkg) as eng:
        eng.load_session(tmp / "junk.ais")


def _file_not_found(pkg: Path, tmp: Path) -> None:
    with _counter(pkg) as eng:
        eng.load_session(tmp / "missing.ais")


def _model_mismatch(pkg: Path, tmp: Path) -> None:
    with _counter(pkg) as eng, eng.new_session() as s:
        s.save(tmp / "counter.ais")
    with _counter(pkg, mutable=["acc", "hits", "table"]) as eng:
        eng.load_session(tmp / "counter.ais")


_CHILD = textwrap.dedent("""
    import os, sys, torch, aoti_sessions as ais
    eng = ais.Engine(sys.argv[1])
    pid = os.fork()
    if pid == 0:
        try:
            eng.new_session()
            print("no error")
        except BaseException as e:
            print(type(e).__name__, e)
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
""")


def _in_subprocess(script: str, *args: object) -> None:
    """Runs `script`, which prints the name of the exception it caught; raises
    an exception of that class here (AssertionError if it caught none)."""
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         timeout=300)
    name, _, message = out.stdout.strip().partition(" ")
    cls = getattr(ais.errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise AssertionError(out.stdout + out.stderr[-3000:])
    raise cls(message)


def _other_process(pkg: Path, tmp: Path) -> None:
    _in_subprocess(_CHILD, pkg)


_OOM = textwrap.dedent("""
    import resource, sys, aoti_sessions as ais
    eng = ais.Engine(sys.argv[1])
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    # Room for a few sessions' blocks, then the host allocator must fail.
    resource.setrlimit(resource.RLIMIT_AS, (size + 64 * eng.bytes_per_session, resource.RLIM_INFINITY))
    sessions = []
    try:
        while True:
            sessions.append(eng.new_session())
    except BaseException as e:
        print(type(e).__name__, e)
""")


def _device(pkg: Path, tmp: Path) -> None:
    # The decoder's 1 MiB blocks: the host allocator fails under an address-space limit.
    from aoti_sessions.demo import compiled_decoder
    _in_subprocess(_OOM, compiled_decoder())


REAL: dict[str, Callable[[Path, Path], None]] = {
    "invalid_argument": _invalid_argument,
    "type_mismatch": _type_mismatch,
    "package": _package,
    "capacity": _capacity,
    "session_closed": _session_closed,
    "other_process": _other_process,
    "run": _run,
    "device": _device,
    "session_file": _session_file,
    "file_not_found": _file_not_found,
    "model_mismatch": _model_mismatch,
}
# "internal" is a broken invariant of this library and "out_of_memory" a C++
# allocation failing: neither can be provoked on purpose; the binding test
# above pins their rows.


def test_every_provokable_kind_has_a_real_trigger() -> None:
    assert set(REAL) == set(CORE_ERRORS) - {"internal", "out_of_memory"}


@pytest.mark.parametrize("kind", REAL)
def test_a_real_failure_of_each_kind(kind: str, counter_cpu_pkg: Path, tmp_path: Path) -> None:
    with pytest.raises(BaseException) as info:
        REAL[kind](counter_cpu_pkg, tmp_path)
    assert type(info.value) is CORE_ERRORS[kind], (kind, type(info.value), str(info.value))
