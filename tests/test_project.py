"""Project invariants: the core's C-ABI-only boundary, stubs that match the
compiled module, and a public API that type-checks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "aoti_sessions"


def test_core_includes_no_framework_headers() -> None:
    forbidden = re.compile(r'#\s*include\s*[<"](torch/|ATen/|c10/|pybind11/|Python\.h)')
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "csrc" / "core").rglob("*"))
        if path.suffix in {".h", ".cc", ".cu", ".cpp"}
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert not offenders, "csrc/core must speak C ABIs only:\n" + "\n".join(offenders)


def test_stubs_match_the_compiled_module(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pybind11_stubgen", "aoti_sessions._core", "-o", str(tmp_path)],
                   check=True, capture_output=True)
    generated = (tmp_path / "aoti_sessions" / "_core.pyi").read_text()
    committed = (PACKAGE / "_core.pyi").read_text()
    assert generated == committed, (
        "python/aoti_sessions/_core.pyi is stale: regenerate it with "
        "`pybind11-stubgen aoti_sessions._core -o python`"
    )


def test_public_api_type_checks() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(ROOT / "build" / "mypy-cache"), str(PACKAGE)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
