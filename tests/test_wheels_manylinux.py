"""scripts/build-wheels makes a manylinux_2_28 wheel that installs and serves in a fresh virtualenv.

Opt-in (AOTI_SESSIONS_WHEELS=1): the script builds the module with zig for the
running Python (minutes from a cold start) and the second test installs torch
from the package index into a new environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import aoti_sessions
from test_wheel import TORCH_VERSION, installed_in_fresh_venv

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("AOTI_SESSIONS_WHEEL_WORK", ROOT / "build" / "wheels"))
CUDA = os.environ.get("AOTI_SESSIONS_CUDA", "ON") == "ON"
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"

pytestmark = pytest.mark.skipif(os.environ.get("AOTI_SESSIONS_WHEELS") != "1",
                                reason="builds a manylinux wheel with zig (minutes): set AOTI_SESSIONS_WHEELS=1")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The script run for this Python alone: its one wheel and what it printed."""
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run([str(ROOT / "scripts" / "build-wheels"), "-o", str(out), sys.executable],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-6000:]
    (wheel,) = out.glob("*.whl")
    return wheel, run.stdout


def test_wheel_is_manylinux_2_28(built: tuple[Path, str]) -> None:
    wheel, printed = built
    assert wheel.name == f"aoti_sessions-{aoti_sessions.__version__}-{TAG}-{TAG}-manylinux_2_28_x86_64.whl"
    assert f"built_with_cuda() = {CUDA}" in printed, printed
    # auditwheel's own verdict on the wheel that was written: glibc 2.28's symbols or older ones.
    show = subprocess.run([str(WORK / "tools" / "bin" / "auditwheel"), "show", str(wheel)],
                          capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    verdict = re.search(r'consistent with\s+the following platform tag:\s+"manylinux_2_(\d+)_x86_64"', show.stdout)
    assert verdict is not None, show.stdout
    assert int(verdict[1]) <= 28, show.stdout
    # Only the system's C libraries: no libstdc++ (zig's libc++ is inside), no libtorch, no libpython.
    needed = set(re.findall(r"\b(lib[\w+-]+\.so(?:\.\d+)*)", show.stdout))
    assert needed <= {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"}, show.stdout
    # torch >= 2.13: older torch's model libraries hand over a libstdc++ map this libc++ build cannot read.
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(f"aoti_sessions-{aoti_sessions.__version__}.dist-info/METADATA").decode()
    assert re.search(r"^Requires-Dist: torch(<2\.15,>=2\.13|>=2\.13,<2\.15)$", metadata, re.M), metadata


@pytest.mark.registry  # installs torch from the package index into the new environment
def test_wheel_installs_and_serves_in_a_fresh_venv(built: tuple[Path, str], tmp_path: Path,
                                                   counter_cpu_pkg: Path) -> None:
    wheel, _ = built
    env_dir, python = installed_in_fresh_venv(wheel, tmp_path)
    smoke = (
        "import torch, aoti_sessions as ais\n"
        "from aoti_sessions import _core\n"
        f"assert _core.__file__.startswith({str(env_dir)!r}), _core.__file__\n"
        f"eng = ais.Engine({str(counter_cpu_pkg)!r})\n"
        "s = eng.new_session()\n"
        "s(torch.ones(1, 8), torch.tensor([1]))\n"
        "s(torch.ones(1, 8), torch.tensor([1]))\n"
        "print(_core.built_with_cuda(), eng.mutable_fqns, int(s.state()['hits'][1]))\n"
    )
    out = subprocess.run([str(python), "-c", smoke], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{CUDA} ('acc', 'hits') 2"
    # The console script the wheel installs.
    version = subprocess.run([str(env_dir / "bin" / "aoti-sessions"), "--version"], cwd=tmp_path,
                             capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    cuda = "with CUDA" if CUDA else "CPU only"
    assert version.stdout.startswith(f"aoti-sessions {aoti_sessions.__version__} ({cuda}; torch {TORCH_VERSION}"), \
        version.stdout
