"""What hostile testing found, each refused cleanly now: orphaned temporary
files of killed saves, garbage package metadata, libraries that claim huge
sizes, NUL bytes in paths, saves over devices and FIFOs, and inputs and
settings that used to surface torch or pybind11 internals."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions._package import METADATA_KEY, WEIGHTS_INDEX, open_model
from conftest import counter_inputs

# ---------------------------------------------------------------- orphaned saves

_SAVER = textwrap.dedent("""
    import sys, aoti_sessions as ais
    engine = ais.Engine(sys.argv[1], device=sys.argv[3])
    s = engine.new_session()
    print("ready", flush=True)
    while True:
        s.save(sys.argv[2])
""")


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".aoti-tmp-" in p.name)


def test_saves_killed_mid_write_leave_nothing_for_long(decoder_pkg: Path, device: str, tmp_path: Path) -> None:
    """kill -9 during saves leaves temporary files; the next save to the
    folder removes them (their writers are dead), and nothing else."""
    target = tmp_path / "s.ais"
    orphans = 0
    for _ in range(8):
        with subprocess.Popen([sys.executable, "-c", _SAVER, str(decoder_pkg), str(target), device],
                              stdout=subprocess.PIPE, text=True) as saver:
            assert saver.stdout is not None and saver.stdout.readline().strip() == "ready"
            time.sleep(0.3)
            saver.send_signal(signal.SIGKILL)
        orphans += len(_temporaries(tmp_path))
    assert orphans > 0, "no save was ever killed mid-write: the test proves nothing"
    # Files that are not ours stay, even named like ours: without the magic
    # bytes, or a finished session file under a temporary-like name.
    keep = tmp_path / ".notes.aoti-tmp-1-2"
    keep.write_text("mine")
    saved_as = tmp_path / "chat.tmp-20240101-1200"
    with ais.Engine(decoder_pkg, device=device) as eng, eng.new_session() as s:
        s.save(saved_as)
        s.save(tmp_path / "other.ais")  # any save into the folder cleans up
    assert _temporaries(tmp_path) == [".notes.aoti-tmp-1-2"]
    assert keep.read_text() == "mine" and saved_as.is_file()
    with ais.Engine(decoder_pkg, device=device) as eng:
        eng.load_session(target).close()  # the last complete save is intact


_HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"AISSTATE")
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_live_writers_temporary_file_is_left_alone(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    live = tmp_path / ".s.ais.aoti-tmp-999999-0"  # locked by a live process, as a save in progress is
    with subprocess.Popen([sys.executable, "-c", _HOLDER, str(live)], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            with ais.Engine(counter_cpu_pkg) as eng, eng.new_session() as s:
                s.save(tmp_path / "s.ais")
            assert live.exists()
        finally:
            holder.kill()


# ---------------------------------------------------------------- package metadata

def _rewrite(package: Path, target: Path, edit_file) -> Path:
    """A copy of `package` whose entries go through edit_file(name, data)."""
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, edit_file(info.filename, src.read(info)))
    return target


def _sessions_doc(edit):
    def edit_file(name: str, data: bytes) -> bytes:
        if not name.endswith("wrapper_metadata.json"):
            return data
        meta = json.loads(data)
        meta[METADATA_KEY] = edit(json.loads(meta[METADATA_KEY]))
        return json.dumps(meta).encode()
    return edit_file


def _metadata_file(data: bytes):
    return lambda name, old: data if name.endswith("wrapper_metadata.json") else old


def _weights_index(edit):
    def edit_file(name: str, data: bytes) -> bytes:
        return json.dumps(edit(json.loads(data))).encode() if name.endswith(WEIGHTS_INDEX) else data
    return edit_file


def _first_entry(**changes):
    def edit(doc):
        doc["entries"][0].update(changes)
        return doc
    return edit


METADATA_GARBAGE = {
    "random bytes": (_metadata_file(bytes(range(256)) * 4), "wrapper_metadata.json is not a text"),
    "bad JSON": (_metadata_file(b"{not json"), "wrapper_metadata.json is not valid JSON"),
    "a JSON list": (_metadata_file(b"[1, 2]"), "wrapper_metadata.json must be a JSON object"),
    "device key a number": (_metadata_file(b'{"AOTI_DEVICE_KEY": 3}'), "field 'AOTI_DEVICE_KEY' must be a string"),
    "document not JSON": (_sessions_doc(lambda d: "{oops"), f"field '{METADATA_KEY}' is not valid JSON"),
    "document a list": (_sessions_doc(lambda d: json.dumps([1])), f"field '{METADATA_KEY}' must be a JSON object"),
    "version a string": (_sessions_doc(lambda d: json.dumps({**d, "version": "1"})),
                         f"field '{METADATA_KEY}.version' must be an integer"),
    "mutable buffers a string": (_sessions_doc(lambda d: json.dumps({**d, "mutable_buffers": "acc"})),
                                 f"field '{METADATA_KEY}.mutable_buffers' must be a JSON list"),
    "input sizes of strings": (
        _sessions_doc(lambda d: json.dumps({**d, "inputs": [{**d["inputs"][0], "sizes": ["1"]}, d["inputs"][1]]})),
        f"field '{METADATA_KEY}.inputs[0].sizes[0]' must be an integer"),
    "input without a dtype": (
        _sessions_doc(lambda d: json.dumps({**d, "inputs": [{"sizes": [1, 8]}, d["inputs"][1]]})),
        f"field '{METADATA_KEY}.inputs[0].dtype' is missing"),
}


@pytest.mark.parametrize("case", METADATA_GARBAGE)
def test_garbage_metadata_is_a_package_error(counter_cpu_pkg: Path, tmp_path: Path, case: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    edit, words = METADATA_GARBAGE[case]
    bad = _rewrite(counter_cpu_pkg, tmp_path / "bad.pt2", edit)
    with pytest.raises(ais.PackageError) as info:
        ais.Engine(bad)
    assert words in str(info.value)


WEIGHTS_GARBAGE = {
    "random bytes": (lambda name, data: bytes(range(256)) if name.endswith(WEIGHTS_INDEX) else data,
                     "weights.json is not a text"),
    "a JSON list": (_weights_index(lambda d: [d]), "weights.json must be a JSON object"),
    "negative offset": (_weights_index(_first_entry(offset=-64)), "field 'entries[0].offset' must be an integer >= 0"),
    "offset a string": (_weights_index(_first_entry(offset="0")), "field 'entries[0].offset' must be an integer"),
    "sizes not a list": (_weights_index(_first_entry(sizes=4)), "field 'entries[0].sizes' must be a JSON list"),
    "no entries": (_weights_index(lambda d: {k: v for k, v in d.items() if k != "entries"}),
                   "field 'entries' is missing"),
    "offset past the end": (_weights_index(_first_entry(offset=1 << 40)), "truncated or unreadable"),
}


@pytest.mark.parametrize("case", WEIGHTS_GARBAGE)
def test_garbage_weights_index_is_a_package_error(heads_pkg: Path, device: str, tmp_path: Path, case: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    edit, words = WEIGHTS_GARBAGE[case]
    bad = _rewrite(heads_pkg, tmp_path / "bad.pt2", edit)
    with pytest.raises(ais.PackageError) as info:
        ais.Engine(bad, device=device)
    assert words in str(info.value)


# ---------------------------------------------------------------- libraries

def _claim_string_table_size(library: bytes, size: int) -> bytes:
    """`library` with the string table of its dynamic section claiming `size` bytes."""
    e_shoff, = struct.unpack_from("<Q", library, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", library, 0x3A)
    for i in range(e_shnum):
        at = e_shoff + i * e_shentsize
        sh_type, = struct.unpack_from("<I", library, at + 4)
        if sh_type == 6:  # SHT_DYNAMIC
            sh_link, = struct.unpack_from("<I", library, at + 40)
            out = bytearray(library)
            struct.pack_into("<Q", out, e_shoff + sh_link * e_shentsize + 32, size)
            return bytes(out)
    raise AssertionError("no dynamic section")


_LOAD_AND_MEASURE = textwrap.dedent("""
    import resource, sys, aoti_sessions as ais
    try:
        ais.Engine(sys.argv[1], mutable=["acc", "hits"]).close()
        print("loaded", end=" ")
    except ais.PackageError as e:
        print("PackageError", e, end=" ")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")


@pytest.mark.parametrize("claim", [3 << 30, 1 << 40])
def test_sizes_a_library_claims_are_bounded_by_its_file(counter_cpu_pkg: Path, tmp_path: Path, claim: int) -> None:
    library = Path(open_model(counter_cpu_pkg)[0].library).read_bytes()
    bad = tmp_path / "lying.so"
    bad.write_bytes(_claim_string_table_size(library, claim))
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(bad)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    peak = int(words[-1])
    assert " ".join(words[:-1]).startswith("PackageError") and "truncated or corrupt" in out.stdout, out.stdout
    assert peak < 2 << 30, f"peak RSS {peak} bytes: the claimed size was allocated"


# ---------------------------------------------------------------- paths and targets

def test_paths_with_a_nul_byte_are_refused(counter_engine: ais.Engine, tmp_path: Path) -> None:
    with counter_engine.new_session() as s:
        for call in (lambda: s.save(str(tmp_path / "a\0b")),
                     lambda: counter_engine.load_session(str(tmp_path / "a\0b")),
                     lambda: ais.Engine(str(tmp_path / "m\0.pt2"))):
            with pytest.raises(ValueError, match="embedded null byte"):
                call()
    assert list(tmp_path.iterdir()) == []  # nothing written at the cut path


def test_saves_never_replace_folders_devices_or_fifos(counter_engine: ais.Engine, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    with counter_engine.new_session() as s:
        with pytest.raises(ais.SessionFileError, match="not a regular file"):
            s.save(fifo)
        with pytest.raises(ais.SessionFileError, match="is a folder"):
            s.save(folder)
        with pytest.raises(ais.SessionFileError, match="not a regular file"):
            s.save("/dev/null")  # checked before anything is written
    assert fifo.is_fifo() and folder.is_dir() and Path("/dev/null").is_char_device()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pipe"]


# ---------------------------------------------------------------- messages

def test_models_that_are_not_files(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.pt2"
    os.mkfifo(fifo)
    for path, words in ((tmp_path, "is a folder"), (fifo, "not a regular file"), ("/dev/null", "not a regular file"),
                        (tmp_path / "missing.pt2", "does not exist")):
        with pytest.raises(ais.PackageError, match=words):
            ais.Engine(path)


def _nested(device: str) -> torch.Tensor:
    with warnings.catch_warnings():  # "nested tensors are a prototype"
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(8)], device=device)


@pytest.mark.parametrize("make, error, words", [
    (lambda d: torch.eye(8)[:1].to_sparse(), TypeError, "input 0 of method 'model' is a sparse_coo tensor"),
    (_nested, TypeError, "input 0 of method 'model' is a nested tensor"),
    (lambda d: torch.ones(1, 8, device="meta"), ValueError, "input 0 of method 'model' is on meta"),
])
def test_inputs_of_other_kinds(counter_engine: ais.Engine, device: str, make, error, words) -> None:
    with counter_engine.new_session() as s:
        with pytest.raises(error, match=words):
            s(make(device), counter_inputs(device)[1])
        s(*counter_inputs(device))


def test_state_of_other_kinds(counter_engine: ais.Engine) -> None:
    with counter_engine.new_session() as s:
        state = s.state()
        with pytest.raises(TypeError, match="state for 'acc' is a sparse_coo tensor"):
            s.load_state({**state, "acc": state["acc"].cpu().to_sparse()})
        with pytest.raises(ValueError, match="state for 'acc' is on meta"):
            s.load_state({**state, "acc": torch.zeros(4, 8, device="meta")})


def test_out_of_range_integers(counter_cpu_pkg: Path) -> None:
    for name in ("max_sessions", "memory_budget", "host_budget"):
        with pytest.raises(ValueError, match=f"{name}=9223372036854775808 does not fit a 64-bit integer"):
            ais.Engine(counter_cpu_pkg, **{name: 2**63})


def test_an_unusable_cache_folder(counter_cpu_pkg: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(blocker))
    with pytest.raises(ais.PackageError, match=r"package cache .* \(AOTI_SESSIONS_CACHE\) is not a usable folder"):
        ais.Engine(counter_cpu_pkg)
