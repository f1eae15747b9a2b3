"""The main job: ``python -m aoti_sessions demo``."""

from __future__ import annotations

import subprocess
import sys


def test_demo_passes(decoder_pkg, device: str) -> None:  # the fixture compiles the demo's model once
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "demo", "--sessions", "3", "--steps", "10",
                             "--device", device],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "compiling" not in result.stderr  # served from the cache the fixture filled
    for row in ("weights", "bytes per session", "step, same session", "step, switching", "bind (switch cost)"):
        assert row in out
    assert out.count("PASS") == 4 and "FAIL" not in out
    assert "isolation           PASS" in out


def test_demo_needs_no_extras(decoder_pkg, device: str) -> None:
    """The README's first command installs aoti-sessions without extras: the
    demo runs with transformers, tokenizers, llguidance and FastAPI absent
    (each import of them fails here, as on such an install)."""
    hide = "import sys\nfor m in ('transformers', 'tokenizers', 'llguidance', 'fastapi', 'uvicorn'):\n" \
           "    sys.modules[m] = None\n" \
           "sys.argv = ['aoti-sessions', 'demo', '--sessions', '2', '--steps', '4', '--device', sys.argv[1]]\n" \
           "import runpy\nrunpy.run_module('aoti_sessions', run_name='__main__')\n"
    result = subprocess.run([sys.executable, "-c", hide, device], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "isolation           PASS" in result.stdout and "FAIL" not in result.stdout


def test_info_command(counter_pkg, device: str) -> None:
    """From the package's files by default; loaded (its libraries run) with --load."""
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "info", str(counter_pkg)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  model(x: float32[1, 8], slot: int64[1], /) -> float32[1, 8]" in lines
    assert "per-session state (declared): acc, hits" in lines and "--load shows them" in result.stdout
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "info", "--load", str(counter_pkg), "--device",
                             device], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "acc: float32[4, 8]" in result.stdout and "hits: int64[4] in model (zero initial)" in result.stdout


def test_cli_rejects_bad_arguments() -> None:
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "demo", "--sessions", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--sessions: must be at least 1, got 0" in result.stderr
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "info", "/nonexistent.pt2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "aoti-sessions: error: model file /nonexistent.pt2 does not exist" in result.stderr
    assert "Traceback" not in result.stderr
