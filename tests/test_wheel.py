"""`pip wheel` builds a wheel that installs and works in a fresh virtualenv."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.registry  # installs torch from the package index into the new environment
def test_wheel_installs_and_serves_in_a_fresh_venv(tmp_path: Path, counter_cpu_pkg: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("aoti_sessions-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"torch=={torch_version}", str(wheel)], check=True, capture_output=True)
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
