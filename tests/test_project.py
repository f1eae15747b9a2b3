"""Project invariants: the core's C-ABI-only boundary, its layering and lock
annotations, small files, stubs that match the compiled module, and a public
API that type-checks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


# Core files that are headers alone, below everything else.
_LEAF_HEADERS = {"aoti_abi.h", "errors.h", "mutex.h"}


def _core_levels() -> dict[str, float]:
    """Each core component's level: its position in CMakeLists.txt's source
    list of the core (written bottom-up); header-only leaves are below all."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    listed = re.search(r"add_library\(aoti_sessions_core STATIC(.*?)\)", cmake, re.S)
    assert listed, "no aoti_sessions_core source list in CMakeLists.txt"
    names = [Path(p).stem for p in listed.group(1).split() if p.endswith(".cc")]
    levels: dict[str, float] = {Path(h).stem: -1 for h in _LEAF_HEADERS}
    levels.update({name: i for i, name in enumerate(names)})
    levels["cuda_device"] = levels["device"] + 0.5  # the CUDA device, added when a toolkit is found
    return levels


def test_core_includes_point_down() -> None:
    """No core file includes a component above it: the layout's arrows point one way."""
    levels = _core_levels()
    include = re.compile(r'#\s*include\s*"([^"/]+)\.h"')
    offenders, unknown = [], []
    for path in sorted((ROOT / "csrc" / "core").iterdir()):
        if path.suffix not in {".h", ".cc"}:
            continue
        if path.stem not in levels:
            unknown.append(path.name)
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = include.search(line)
            if m and m.group(1) != path.stem and levels.get(m.group(1), 10**6) >= levels[path.stem]:
                offenders.append(f"{path.name}:{n} includes {m.group(1)}.h, which is not below it")
    assert not unknown, f"core files missing from the CMake source list: {unknown}"
    assert not offenders, "\n".join(offenders)


def _python_imports() -> dict[str, list[tuple[str, bool]]]:
    """Each module of the package: the package modules it imports, each
    with whether at module level (type-checking imports included) or inside
    a function."""
    import ast

    def name_of(path: Path) -> str:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, list[tuple[str, bool]]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for n in ast.walk(f)}
        found = []
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
                # (``from . import x``: x a module, or the compiled _core, which imports nothing of ours)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
                           if node.module or f"{base}.{a.name}" in modules]
            for target in targets:
                if target in modules and target != module:  # (torch's, the compiled _core's: not ours)
                    found.append((target, id(node) not in functions))
        out[module] = found
    return out


def test_python_imports_run_one_way() -> None:
    """No circle among the package's module-level imports (type-checking
    ones included), and the runtime never imports export time: nothing
    outside llm/exporting imports it, at any level, but the export command
    and ``aoti_sessions.llm.export`` (loaded on first use)."""
    imports = _python_imports()
    assert "aoti_sessions.llm.exporting._export" in imports  # (the walk is live)
    graph = {m: {t for t, top in targets if top} for m, targets in imports.items()}
    done: set[str] = set()

    def circle(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for t in sorted(graph[m]):
            if (found := circle(t, path + [m])) is not None:
                return found
        done.add(m)
        return None

    circles = [c for m in sorted(graph) if (c := circle(m, [])) is not None]
    assert not circles, circles[0]
    # A subpackage uses a sibling's documented API or its interface module, never its private modules.
    def room(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and not parts[1].startswith("_")) else ""

    private = [f"{m} imports {t}" for m, targets in imports.items() for t, _ in targets
               if room(m) and room(t) and room(m) != room(t) and any(p.startswith("_") for p in t.split(".")[2:])]
    assert not private, private
    allowed = {"aoti_sessions.__main__", "aoti_sessions.llm"}
    export_time = [f"{m} imports {t}" for m, targets in imports.items() for t, _ in targets
                   if t.startswith("aoti_sessions.llm.exporting") and not m.startswith("aoti_sessions.llm.exporting")
                   and m not in allowed]
    assert not export_time, export_time
    serving = ("import sys, aoti_sessions.llm, aoti_sessions.serve._app, aoti_sessions.llm.process._remote_engine; "
               "print(sorted(m for m in sys.modules if '.exporting' in m))")
    loaded = subprocess.run([sys.executable, "-c", serving], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_files_stay_small() -> None:
    """One job per file: none of the sources under csrc/ (the core and the
    bindings) or python/ over 450 lines (the generated stubs aside), at any
    depth."""
    files = [p for folder in ("csrc", "python") for p in (ROOT / folder).rglob("*")
             if p.suffix in (".py", ".cc", ".h", ".cu", ".cuh") and p.is_file()]
    assert len(files) > 100 and PACKAGE / "serve" / "_sessions.py" in files  # (the walk is live)
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in files
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, long


@pytest.mark.clang
def test_lock_annotations_hold(tmp_path: Path) -> None:
    """The core builds warning-free under clang's -Wthread-safety (every
    GUARDED_BY / REQUIRES in it holds), and the check is live: a probe that
    reads guarded state without its lock is refused."""
    build = ROOT / "build" / "thread-safety"
    env = {**os.environ, "CXX": shutil.which("clang++") or "clang++"}
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DAOTI_SESSIONS_THREAD_SAFETY=ON",
                    f"-DPython_EXECUTABLE={sys.executable}"], check=True, capture_output=True, env=env)
    result = subprocess.run(["cmake", "--build", str(build), "--target", "aoti_sessions_core", "--parallel",
                             str(os.cpu_count() or 2)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    probe = tmp_path / "probe.cc"
    probe.write_text('#include "core/session_state.h"\n'
                     "char* Unlocked(aoti_sessions::SessionState& s) { return s.memory(); }\n")
    result = subprocess.run([env["CXX"], "-std=c++17", "-fsyntax-only", "-Wthread-safety", "-Werror",
                             f"-I{ROOT / 'csrc'}", str(probe)], capture_output=True, text=True)
    assert result.returncode != 0 and "requires holding mutex" in result.stderr, result.stderr


def test_scripts_run_rebuilds_only_when_a_source_changed(tmp_path: Path) -> None:
    """scripts/run installs again when what the build reads changed (the
    digest of scripts/source-hash), and not otherwise."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "CMakeLists.txt", "csrc", "python"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(source, tree / name)

    def digest() -> str:
        return subprocess.run([str(ROOT / "scripts" / "source-hash"), str(tree)], capture_output=True, text=True,
                              check=True).stdout.strip()

    first = digest()
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    (tree / "python" / "aoti_sessions" / "__pycache__").mkdir(exist_ok=True)
    (tree / "python" / "aoti_sessions" / "__pycache__" / "x.pyc").write_bytes(b"stale")
    assert digest() == first  # caches do not count
    core = next((tree / "csrc" / "core").glob("*.cc"))
    core.write_text(core.read_text() + "\n// edited\n")
    assert digest() != first
    script = (ROOT / "scripts" / "run").read_text()
    assert 'source-hash' in script and '.aoti-sessions-installed' in script


def test_scripts_run_refuses_an_unknown_job_before_setting_up(tmp_path: Path) -> None:
    """A mistyped job is refused at once, naming the jobs, with nothing set up."""
    venv = tmp_path / "venv"
    done = subprocess.run([str(ROOT / "scripts" / "run"), "serv", "model.pt2"], capture_output=True, text=True,
                          env={**os.environ, "AOTI_SESSIONS_VENV": str(venv)}, timeout=60)
    assert done.returncode == 2
    assert "unknown job 'serv': demo, test, bench, serve, export or cluster" in done.stderr
    assert not venv.exists()


def test_interface_modules_give_what_they_list() -> None:
    """llm/interface.py and serve/interface.py (what a sibling subpackage
    uses): every name listed resolves, and serve's lazy table lists no more
    and no less than its __all__."""
    import aoti_sessions.llm.interface as llm_interface
    import aoti_sessions.serve.interface as serve_interface

    assert set(serve_interface._WHERE) == set(serve_interface.__all__)
    for module in (llm_interface, serve_interface):
        missing = [n for n in module.__all__ if getattr(module, n, None) is None]
        assert not missing, (module.__name__, missing)
