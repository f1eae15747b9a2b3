"""Builds the GoogleTest binaries (tests/cpp) against the core and runs them
through ctest, with the compiled test models they need."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import modeldefs
from aoti_sessions._package import open_model
from conftest import _compiled

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "cpp-tests"


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"


def test_gtest_binaries(counter_cpu_pkg: Path) -> None:
    _run(["cmake", "-S", str(ROOT), "-B", str(BUILD), "-DAOTI_SESSIONS_BUILD_TESTS=ON",
          "-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DPython_EXECUTABLE={sys.executable}"])
    _run(["cmake", "--build", str(BUILD), "--parallel", str(os.cpu_count() or 2)])
    env = dict(os.environ)
    env["AOTI_SESSIONS_COUNTER_SO"] = open_model(counter_cpu_pkg)[0].library
    env["AOTI_SESSIONS_COUNTER_TALL_SO"] = open_model(_compiled(modeldefs.CounterTall, "cpu"))[0].library
    if torch.cuda.is_available():  # the CUDA cases skip themselves without a GPU
        env["AOTI_SESSIONS_COUNTER_CUDA_SO"] = open_model(_compiled(modeldefs.Counter, "cuda"))[0].library
    # Model libraries find libtorch_cpu by name; the binaries link it with an rpath.
    torch_lib = str(Path(torch.__file__).parent / "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [torch_lib, env.get("LD_LIBRARY_PATH")]))
    _run(["ctest", "--test-dir", str(BUILD), "--output-on-failure", "--no-tests=error"], env)
