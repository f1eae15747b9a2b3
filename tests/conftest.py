"""Shared fixtures: the test models, compiled once per run and cached.

Packages live in the aoti_sessions cache (``$AOTI_SESSIONS_CACHE``, by default
``build/test-cache`` in the repository), keyed by torch version and model
source, so a second run compiles nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("AOTI_SESSIONS_CACHE", str(ROOT / "build" / "test-cache"))

import torch  # noqa: E402

import aoti_sessions as ais  # noqa: E402
import modeldefs  # noqa: E402
import pooled_models  # noqa: E402
from aoti_sessions._compile import compile_cached  # noqa: E402
from aoti_sessions.demo import compiled_decoder  # noqa: E402
from aoti_sessions.models import SMALL, TinyDecoder  # noqa: E402

# Faster compiles for test-only models: the wrapper's C++ at -O0 (kernels are unaffected).
FAST = {"aot_inductor.compile_wrapper_opt_level": "O0"}
PREFILL = 8  # tokens per prefill call

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_in_triton_interpreter(script: str) -> str:
    """Runs the test file ``script`` as a program (its ``__main__`` case) in a
    process of its own under TRITON_INTERPRET=1, so the interpreter stays out
    of this one; asserts it exited 0 and returns its stdout."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result.stdout


def _compiled(cls: type, device: str) -> Path:
    def build():
        args, kwargs = cls.example() if cls is modeldefs.KwargsModel else (cls.example(), None)
        dev = torch.device(device)
        module = cls().to(dev)
        args = tuple(a.to(dev) for a in args)
        kwargs = {k: v.to(dev) for k, v in kwargs.items()} if kwargs else None
        return module, args, kwargs

    return compile_cached(build, (inspect.getsource(modeldefs), cls.__name__, device),
                          name=f"{cls.__name__.lower()}-{device}", inductor_configs=FAST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the exhaustive family variants (marked all_families by tests/llm_models.py family_params)
    unless AOTI_SESSIONS_ALL_FAMILIES=1: pytest's summary counts them as deselected."""
    if os.environ.get("AOTI_SESSIONS_ALL_FAMILIES") == "1":
        return
    left_out = [item for item in items if item.get_closest_marker("all_families")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("all_families")]


@pytest.fixture(autouse=True)
def _logging_as_found() -> object:
    """The root logger's level and the log level handed to child processes
    as each test found them, and no command-line handler left on it: the
    command line's main(), called in this process by a few tests, sets them
    up for the rest of a server's life."""
    import logging

    from aoti_sessions._logs import LEVEL_ENV, Stderr

    root = logging.getLogger()
    level, env = root.level, os.environ.get(LEVEL_ENV)
    yield
    for handler in [h for h in root.handlers if isinstance(h, Stderr)]:
        root.removeHandler(handler)
    root.setLevel(level)
    if env is None:
        os.environ.pop(LEVEL_ENV, None)
    else:
        os.environ[LEVEL_ENV] = env


@pytest.fixture(scope="session", params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request: pytest.FixtureRequest) -> str:
    """Every test that takes it runs on the CPU and, where there is one, on a GPU."""
    return str(request.param)


@pytest.fixture(scope="session")
def counter_pkg(device: str) -> Path:
    return _compiled(modeldefs.Counter, device)


@pytest.fixture(scope="session")
def counter_cpu_pkg() -> Path:
    """For tests about packages and arguments, where the device does not matter."""
    return _compiled(modeldefs.Counter, "cpu")


@pytest.fixture(scope="session")
def counter_cuda_pkg() -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _compiled(modeldefs.Counter, "cuda")


@pytest.fixture(scope="session")
def counter_tall_pkg(device: str) -> Path:
    return _compiled(modeldefs.CounterTall, device)


@pytest.fixture(scope="session")
def kwargs_pkg(device: str) -> Path:
    return _compiled(modeldefs.KwargsModel, device)


@pytest.fixture(scope="session")
def decoder_pkg(device: str) -> Path:
    """The demo's decoder (T=1), the very package ``aoti-sessions demo`` uses."""
    return compiled_decoder(SMALL, device)


@pytest.fixture(scope="session")
def prefill_pkg(device: str) -> Path:
    return compiled_decoder(SMALL, device, PREFILL, inductor_configs=FAST)


def _compiled_methods(name: str, device: str, build) -> Path:
    """A multi-method ais.compile package (weights stored once, outside the libraries)."""
    return compile_cached(build, (inspect.getsource(modeldefs), inspect.getsource(TinyDecoder), name, device,
                                  "methods"), name=f"{name}-{device}-methods", inductor_configs=FAST)


DECODER_PREFILL = 16  # tokens per prefill call of the two-method decoder


def compiled_decoder_methods(device: str) -> Path:
    """The demo decoder as two methods of one package: prefill (T=16) and decode (T=1)."""
    dev = torch.device(device)

    def build():
        model = TinyDecoder(SMALL).to(dev).eval()
        methods = {name: tuple(a.to(dev) for a in model.example_inputs(t))
                   for name, t in (("prefill", DECODER_PREFILL), ("decode", 1))}
        return model, {k: (v,) for k, v in methods.items()}, None

    return _compiled_methods("decoder", device, build)


def compiled_heads(device: str) -> Path:
    """Three methods over partly shared weights (modeldefs.Heads)."""
    dev = torch.device(device)

    def build():
        (idx,) = modeldefs.Heads.example()
        args = (idx.to(dev),)
        methods = {"a": ais.Method(args, entry="a"), "b": ais.Method(args, entry="b"), "both": ais.Method(args)}
        return modeldefs.Heads().to(dev), methods, None

    return _compiled_methods("heads", device, build)


@pytest.fixture(scope="session")
def decoder_methods_pkg(device: str) -> Path:
    return compiled_decoder_methods(device)


@pytest.fixture(scope="session")
def heads_pkg(device: str) -> Path:
    return compiled_heads(device)


def paged_package(device: str) -> Path:
    """A decoder over pooled state: paged KV and a recurrent slot (tests/pooled_models.py)."""
    return compile_cached(lambda: pooled_models.build(device), (inspect.getsource(pooled_models), device),
                          name=f"paged-{device}", inductor_configs=FAST)


@pytest.fixture(scope="session")
def paged_pkg(device: str) -> Path:
    return paged_package(device)


@pytest.fixture(scope="session")
def counter_reseeded_pkg(device: str) -> Path:
    return _compiled(modeldefs.CounterReseeded, device)


@pytest.fixture
def counter_engine(counter_pkg: Path, device: str):
    with ais.Engine(counter_pkg, device=device) as engine:
        yield engine


@pytest.fixture(scope="session")
def decoder_engine(decoder_pkg: Path, device: str):
    with ais.Engine(decoder_pkg, device=device) as engine:
        yield engine


@pytest.fixture
def eager_decoder(device: str) -> TinyDecoder:
    return TinyDecoder(SMALL).to(device).eval()


def counter_inputs(device: str, value: float | None = None, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Counter inputs on `device`: x random (or all `value`), slot as given."""
    x = torch.randn(1, 8) if value is None else torch.full((1, 8), value)
    return x.to(device), torch.tensor([slot], device=device)


T = TypeVar("T")


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine`` run to its end on a loop of its own, leaving this
    thread's current loop as it is. (asyncio.run would replace it: a loop
    a library left there, Ray's or litellm's, is then collected unclosed,
    its socket pair reported as an unraisable warning in whichever later
    test the collection falls.)"""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def on_threads(k: int, device: str, work: Callable[[int], T]) -> list[T]:
    """work(0), ..., work(k - 1) on k threads at once, each on a CUDA stream of
    its own when `device` is "cuda"; their results in order. The first error
    a thread raised is raised here."""
    results: list[T | None] = [None] * k
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            if device == "cuda":
                with torch.cuda.stream(torch.cuda.Stream()):
                    results[i] = work(i)
            else:
                results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return cast(list[T], results)  # every slot was filled: no thread failed

