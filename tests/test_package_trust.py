"""A package is code, and an archive: what describing or loading one runs,
and what extracting one may write. `aoti-sessions info` loads no library and
imports no module; loading imports the op modules a package names only as
the caller allows (never from the current directory by default); extraction
refuses a zip bomb or a member lying about its size before the disk fills,
and a refused or failed extraction leaves nothing in the package cache."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
import proxy_ops
from aoti_sessions import _extraction, _package, _proxy
from aoti_sessions._compile import compile_cached
from aoti_sessions.serve._cli import add_arguments as add_serve_arguments
from conftest import FAST

HERE = Path(__file__).parent
MIB = 1 << 20


@pytest.fixture(scope="module")
def proxy_pkg() -> Path:
    """tests/test_proxy.py's package on the CPU (the same cache entry): its
    method calls proxy_ops' op, and its op_modules.json names proxy_ops."""
    def build():
        return proxy_ops.ProxyModel(), (torch.randn(3, 8),), None

    return compile_cached(build, (inspect.getsource(proxy_ops), "cpu"), name="proxy-cpu", inductor_configs=FAST)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty package cache of the test's own: its ``packages`` folder."""
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "packages"


def _left(packages: Path) -> list[str]:
    return sorted(p.name for p in packages.iterdir()) if packages.is_dir() else []


def _copy(package: Path, target: Path, replace: dict[str, bytes | None] | None = None,
          add: Callable[[zipfile.ZipFile, str], None] | None = None) -> Path:
    """``package`` copied to ``target`` (its top folder kept), each
    entry whose name ends with a key of ``replace`` holding that content
    (dropped where None); ``add(zip, top)`` writes more."""
    replace = replace or {}
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            key = next((k for k in replace if info.filename.endswith(k)), None)
            if key is None:
                dst.writestr(info, src.read(info))
            elif replace[key] is not None:
                dst.writestr(info, replace[key])
        if add is not None:
            add(dst, _package.top_folder(src.namelist()))
    return target


def _run(args: list[str], cwd: Path, cache: Path, marker: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in ``cwd`` (on sys.path as Python puts it there),
    proxy_ops and the aoti_sessions under test importable, ``cache`` its
    package cache."""
    path = os.pathsep.join([str(HERE), str(Path(ais.__file__).parent.parent)])
    env = {**os.environ, "PYTHONPATH": path, "AOTI_SESSIONS_CACHE": str(cache)}
    if marker is not None:
        env["AOTI_TEST_MARKER"] = str(marker)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


# -- op modules --------------------------------------------------------------

# A module of the current directory that the package names as its op module:
# imported, it leaves a file (and defines the ops, from proxy_ops).
_MARKER_MODULE = """\
import os
with open(os.environ["AOTI_TEST_MARKER"], "a") as f:
    f.write(__name__ + "\\n")
import proxy_ops  # noqa: F401
"""

_LOAD = """\
import os, sys, torch, aoti_sessions as ais
mine, shadowed, installed, here, elsewhere = sys.argv[1:4] + [os.getcwd(), sys.argv[4]]
for package, trust, folder in [(mine, False, here), (shadowed, False, here), (installed, False, elsewhere),
                               (mine, ["marker_ops"], here)]:
    os.chdir(folder)
    try:
        engine = ais.Engine(package, trust_op_modules=trust)
        print("ran:", tuple(engine.new_session().run("model", torch.ones(3, 8)).shape))
    except ais.errors.PackageError as e:
        print("refused:", e)
    print("imported:", os.path.exists(os.environ["AOTI_TEST_MARKER"]),
          "transformers.integrations.moe" in sys.modules)
"""


def test_op_modules_are_imported_only_as_the_caller_allows(proxy_pkg: Path, tmp_path: Path) -> None:
    """A fresh interpreter in a folder holding the module a package names
    (`python -c`: the current directory first on sys.path): by default the
    package is refused before the module is imported, and the refusal names
    it and how to allow it; so is one naming a `transformers` module that the
    current directory shadows; a module of the installed transformers is
    imported; with trust_op_modules naming it, the module is imported and the
    package runs."""
    def named(*modules: str) -> dict[str, bytes | None]:
        return {_package.OP_MODULES: json.dumps(list(modules)).encode()}

    mine = _copy(proxy_pkg, tmp_path / "mine.pt2", named("marker_ops"))
    shadowed = _copy(proxy_pkg, tmp_path / "shadowed.pt2", named("transformers.marker_ops"))
    installed = _copy(proxy_pkg, tmp_path / "installed.pt2", named("transformers.integrations.moe"))
    folder = tmp_path / "here"
    (folder / "transformers").mkdir(parents=True)
    (folder / "marker_ops.py").write_text(_MARKER_MODULE)
    (folder / "transformers" / "__init__.py").write_text(_MARKER_MODULE)
    (folder / "transformers" / "marker_ops.py").write_text(_MARKER_MODULE)
    marker = tmp_path / "imported"
    out = _run(["-c", _LOAD, str(mine), str(shadowed), str(installed), str(tmp_path)], folder, tmp_path / "cache",
               marker)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 8, out.stdout
    assert lines[0].startswith("refused: ") and "marker_ops" in lines[0] and "nothing was imported" in lines[0] \
        and "trust_op_modules=['marker_ops']" in lines[0] and "--trust-op-modules marker_ops" in lines[0], lines[0]
    assert lines[1] == "imported: False False"
    assert lines[2].startswith("refused: ") and "transformers.marker_ops" in lines[2] \
        and "nothing was imported" in lines[2], lines[2]
    assert lines[3] == "imported: False False"
    # Imported (transformers' own: allowed), and it does not define the package's op.
    assert lines[4].startswith("refused: ") and "no such op is registered" in lines[4], lines[4]
    assert lines[5] == "imported: False True"
    assert lines[6] == "ran: (3, 8)" and lines[7] == "imported: True True", out.stdout
    assert marker.read_text() == "marker_ops\n"


def test_info_runs_nothing_of_the_package(proxy_pkg: Path, tmp_path: Path) -> None:
    """`aoti-sessions info` (`python -m`: the current directory on sys.path)
    of a package whose library's constructor leaves a file when the library
    is loaded and whose op module (in the current directory) leaves one when
    imported: it describes the package from its files, and neither runs.
    `--load --trust-op-modules` runs both (the module first)."""
    library = tmp_path / "constructor.c"
    library.write_text('#include <stdio.h>\n#include <stdlib.h>\n'
                       '__attribute__((constructor)) static void ran(void) {\n'
                       '    FILE *f = fopen(getenv("AOTI_TEST_MARKER"), "a");\n'
                       '    if (f) { fputs("constructor\\n", f); fclose(f); }\n}\n')
    built = tmp_path / "constructor.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(library)], check=True, timeout=120)
    package = _copy(proxy_pkg, tmp_path / "code.pt2", {".wrapper.so": built.read_bytes(),
                                                        _package.OP_MODULES: b'["marker_ops"]'})
    folder = tmp_path / "here"
    folder.mkdir()
    (folder / "marker_ops.py").write_text(_MARKER_MODULE)
    marker = tmp_path / "ran"

    info = _run(["-m", "aoti_sessions", "info", str(package)], folder, tmp_path / "cache", marker)
    assert info.returncode == 0, info.stderr[-3000:]
    assert not marker.exists()
    lines = info.stdout.splitlines()
    assert "none of its code was loaded or run" in lines[0] and "  model(x: float32[3, 8], /) -> float32[3, 8]" in lines
    assert "op module: marker_ops (imported at load where its ops are not registered: only with " \
           "--trust-op-modules)" in lines
    assert "per-session state (declared): total" in lines

    loaded = _run(["-m", "aoti_sessions", "info", "--load", "--trust-op-modules", "marker_ops", str(package)], folder,
                  tmp_path / "cache", marker)
    assert loaded.returncode != 0  # the library is no model: it only says it ran
    assert marker.read_text().splitlines() == ["marker_ops", "constructor"], loaded.stderr[-3000:]


def test_the_engine_process_is_given_the_trust(proxy_pkg: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A RemoteLLM (as `serve` and each cluster replica open it) passes
    trust_op_modules to its engine process, a fresh interpreter in the
    current directory: the tiny qwen3 package, its decode also calling
    proxy_ops' op (the proxy package's extern-kernel description beside its
    library) and naming marker_ops, is refused there by default without
    importing it, and loads with the module trusted."""
    from llm_models import llm_package

    from aoti_sessions.llm import RemoteLLM

    with zipfile.ZipFile(proxy_pkg) as archive:
        description = next(archive.read(n) for n in archive.namelist() if n.endswith(".wrapper.json"))
    with zipfile.ZipFile(llm_package("qwen3")) as archive:
        library = next(n for n in archive.namelist() if "/aotinductor/decode/" in n and n.endswith(".wrapper.so"))

    def more(archive: zipfile.ZipFile, top: str) -> None:
        archive.writestr(library[:-len(".so")] + ".json", description)
        archive.writestr(f"{top}/{_package.OP_MODULES}", b'["marker_ops"]')

    package = _copy(llm_package("qwen3"), tmp_path / "calls.pt2", add=more)
    folder = tmp_path / "here"
    folder.mkdir()
    (folder / "marker_ops.py").write_text(_MARKER_MODULE)
    marker = tmp_path / "imported"
    monkeypatch.chdir(folder)
    monkeypatch.setenv("AOTI_TEST_MARKER", str(marker))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(Path(ais.__file__).parent.parent)]))
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ais.PackageError, match=r"trust_op_modules=\['marker_ops'\]"):
        RemoteLLM(package, threads=1)
    assert not marker.exists()
    with RemoteLLM(package, threads=1, trust_op_modules=["marker_ops"]) as remote:
        assert remote.alive and marker.read_text() == "marker_ops\n"


def test_trust_op_modules_is_checked(counter_cpu_pkg: Path) -> None:
    with pytest.raises(TypeError, match="trust_op_modules must be True, False or a sequence of module names"):
        ais.Engine(counter_cpu_pkg, trust_op_modules="marker_ops")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'marker-ops' is not a module name"):
        ais.Engine(counter_cpu_pkg, trust_op_modules=["marker-ops"])
    with ais.Engine(counter_cpu_pkg, trust_op_modules=["marker_ops"]) as engine:  # no op module needed: none imported
        assert engine.methods == ("model",)
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["p.pt2"]).trust_op_modules is False
    assert parser.parse_args(["p.pt2", "--trust-op-modules", "a.b, c"]).trust_op_modules == ("a.b", "c")
    assert parser.parse_args(["p.pt2", "--trust-op-modules", "all"]).trust_op_modules is True
    assert _proxy.trusted_by_default("transformers.integrations.moe") and not _proxy.trusted_by_default("proxy_ops")
    assert not _proxy.trusted_by_default("os")  # importable, but no package whose ops exported models call


# -- extraction --------------------------------------------------------------

def _zeros(mib: int) -> tuple[bytes, int]:
    """A raw deflate stream of ``mib`` MiB of zeros (about 1 KiB a MiB: one
    flushed segment repeated) and their CRC-32."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = compressor.compress(bytes(MIB)) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc, zeros = 0, bytes(MIB)
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    return segment * mib + b"\x03\x00", crc  # b"\x03\x00": an empty final block


def _bomb(path: Path, name: str, mib: int) -> Path:
    """A zip of one deflated member of ``mib`` MiB of zeros, written by hand
    (zipfile would deflate every byte)."""
    data, crc = _zeros(mib)
    size, raw = mib * MIB, name.encode()
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(data), size, len(raw), 0) + raw
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, crc, len(data), size, len(raw),
                          0, 0, 0, 0, 0, 0) + raw
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(data), 0)
    path.write_bytes(local + data + central + end)
    return path


def test_a_zip_bomb_is_refused_before_anything_is_written(cache: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """About 1 MB declaring 1 GiB of zeros (the finding: 1.04 MB extracted to
    1.1 GiB): refused from its declared sizes, the error naming the limit and
    how to raise it; nothing is left in the cache. Raised, the disk's free
    space still bounds it."""
    bomb = _bomb(tmp_path / "bomb.pt2", "bomb/data/aotinductor/model/zeros.bin", 1024)
    assert bomb.stat().st_size < 1.1e6
    with pytest.raises(ais.PackageError) as refused:
        ais.Engine(bomb)
    message = str(refused.value)
    assert f"would extract to {1 << 30} bytes" in message and "limit of 20 times" in message \
        and "AOTI_SESSIONS_MAX_EXTRACT_RATIO" in message, message
    assert _left(cache) == []
    monkeypatch.setenv("AOTI_SESSIONS_MAX_EXTRACT_RATIO", "2000")
    monkeypatch.setattr(_extraction.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 0, 100 * MIB))
    with pytest.raises(ais.PackageError, match=f"would extract to {1 << 30} bytes; the package cache .* has "
                                               f"{100 * MIB} bytes free"):
        ais.Engine(bomb)
    assert _left(cache) == []
    monkeypatch.setenv("AOTI_SESSIONS_MAX_EXTRACT_RATIO", "many")
    with pytest.raises(ais.PackageError, match="AOTI_SESSIONS_MAX_EXTRACT_RATIO='many': must be a number above 0"):
        ais.Engine(bomb)


def _declare(path: Path, name: str, size: int) -> None:
    """Makes ``name``'s headers (local and central) declare ``size`` bytes."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        struct.pack_into("<I", data, archive.getinfo(name).header_offset + 22, size)
        at = archive.start_dir
    while (at := data.find(b"PK\x01\x02", at)) >= 0:
        length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + length] == name.encode():
            struct.pack_into("<I", data, at + 24, size)
        at += 4
    path.write_bytes(bytes(data))


def test_a_member_lying_about_its_size_stops_the_extraction(counter_cpu_pkg: Path, cache: Path,
                                                            tmp_path: Path) -> None:
    """A loadable package with one more entry whose headers declare another
    size than it holds: fewer bytes (refused where the old extraction wrote a
    short file, which every later load then found changed), or more (64 MiB
    of zeros declared as 1 KiB: never more than the declared size is written,
    and its checksum is wrong). Either way nothing is left in the cache."""
    def extra(content: bytes) -> Callable[[zipfile.ZipFile, str], None]:
        return lambda archive, top: archive.writestr(f"{top}/data/extra.bin", content, zipfile.ZIP_DEFLATED)

    short = _copy(counter_cpu_pkg, tmp_path / "short.pt2", add=extra(bytes(1024)))
    long = _copy(counter_cpu_pkg, tmp_path / "long.pt2", add=extra(bytes(64 * MIB)))
    with zipfile.ZipFile(counter_cpu_pkg) as archive:
        name = f"{_package.top_folder(archive.namelist())}/data/extra.bin"
    _declare(short, name, 4096)
    _declare(long, name, 1024)
    with pytest.raises(ais.PackageError, match=f"package entry '{name}' holds 1024 bytes; its header declares 4096"):
        ais.Engine(short)
    assert _left(cache) == []
    with pytest.raises(ais.PackageError, match=f"long.pt2 is a corrupt package: Bad CRC-32 for file '{name}'"):
        ais.Engine(long)
    assert _left(cache) == []


def test_a_package_refused_for_what_it_holds_leaves_nothing(cache: Path, tmp_path: Path) -> None:
    """Extracted, then refused (no model in it): the extraction is removed,
    where it used to stay in the cache for good."""
    package = tmp_path / "empty.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("empty/data/readme.txt", "no model here")
    with pytest.raises(ais.PackageError, match="holds no AOTInductor model"):
        ais.Engine(package)
    assert _left(cache) == []
