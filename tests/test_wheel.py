"""`pip wheel` builds a wheel that installs and works in a fresh virtualenv."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


TORCH_VERSION = torch.__version__.split("+")[0]


def installed_in_fresh_venv(wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A new venv under ``tmp_path`` holding this process's torch version (from the package index) and
    ``wheel``: its folder and its python."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"torch=={TORCH_VERSION}", str(wheel)], check=True, capture_output=True)
    return env_dir, python


@pytest.mark.registry  # installs torch from the package index into the new environment
def test_wheel_installs_and_serves_in_a_fresh_venv(tmp_path: Path, counter_cpu_pkg: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("aoti_sessions-*.whl")
    env_dir, python = installed_in_fresh_venv(wheel, tmp_path)
    smoke = (
        "import sys, torch, aoti_sessions as ais\n"
        f"assert ais.__file__.startswith({str(env_dir)!r}), ais.__file__\n"
        f"eng = ais.Engine({str(counter_cpu_pkg)!r})\n"
        "s = eng.new_session()\n"
        "s(torch.ones(1, 8), torch.tensor([1]))\n"
        "print(eng.mutable_fqns, int(s.state()['hits'][1]))\n"
    )
    out = subprocess.run([str(python), "-c", smoke], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('acc', 'hits') 1"
