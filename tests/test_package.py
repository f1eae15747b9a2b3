"""Package handling: raw libraries, the extraction cache, package metadata."""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions._package import METADATA_KEY, open_model
from conftest import SMALL, counter_inputs
from aoti_sessions.models import TinyDecoder


def test_raw_library_is_a_foreign_model(counter_cpu_pkg: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bare .so carries no aoti_sessions metadata: every buffer becomes session
    state (with a warning), and the model's own input checks guard the call."""
    library = open_model(counter_cpu_pkg)[0].library
    with caplog.at_level(logging.WARNING, logger="aoti_sessions"):
        engine = ais.Engine(library)
    assert sorted(engine.mutable_fqns) == ["acc", "hits", "table"]
    assert "mutable state from every buffer" in caplog.text and "table" in caplog.text
    with engine, engine.new_session() as s:
        reference = torch._inductor.aoti_load_package(str(counter_cpu_pkg))
        x, slot = counter_inputs("cpu", slot=2)
        assert torch.equal(s(x, slot), reference(x, slot))
        with pytest.raises(ais.RunError):  # no recorded specs: the model's own check refuses it
            s(x.double(), slot)
        # Contiguous with odd strides on a size-1 dimension: passed as the canonical view.
        odd = torch.randn(8, 1).t()
        assert odd.stride() == (1, 1)
        assert torch.equal(s(odd, slot), reference(torch.empty(1, 8).copy_(odd), slot))


def test_extraction_is_cached_by_content(counter_cpu_pkg: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path))
    first = open_model(counter_cpu_pkg)[0].library
    stamp = Path(first).stat().st_mtime_ns
    copy = tmp_path / "renamed.pt2"
    copy.write_bytes(Path(counter_cpu_pkg).read_bytes())
    assert open_model(copy)[0].library == first  # same content, same extraction
    assert Path(first).stat().st_mtime_ns == stamp
    assert len(list((tmp_path / "packages").iterdir())) == 1


def test_a_changed_cache_entry_is_extracted_again(decoder_methods_pkg: Path, tmp_path: Path, monkeypatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The extraction cache is checked against the package at every load
    (sizes; CRC-32 of files up to 64 MiB): a byte appended to a method's
    library, or that library replaced by another method's, is found, said in
    one log line, and extracted anew; the engine then runs as before."""
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path))
    files = {f.name: Path(f.library) for f in open_model(decoder_methods_pkg)}
    prefill, decode = files["prefill"], files["decode"]
    original = decode.read_bytes()
    assert original != prefill.read_bytes()
    for damaged in (original + b"\0",                                   # one byte appended
                    prefill.read_bytes(),                                # another method's library
                    original[:-1] + bytes([original[-1] ^ 1])):          # one bit, same size
        # Written beside and renamed over it: this process has the library
        # mapped, and a write in place would change what it runs.
        beside = decode.with_name("damaged")
        beside.write_bytes(damaged)
        os.replace(beside, decode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aoti_sessions"), ais.Engine(decoder_methods_pkg) as engine:
            assert sorted(engine.methods) == ["decode", "prefill"]
            with engine.new_session() as s:
                tokens, positions = TinyDecoder(SMALL).example_inputs(1)
                assert s.run("decode", tokens, positions).shape[:2] == (tokens.shape[0], 1)
        changed = [r.getMessage() for r in caplog.records if "package cache" in r.getMessage()]
        assert len(changed) == 1 and "extracting it again" in changed[0] and "decode" in changed[0], changed
        assert decode.read_bytes() == original
    # Intact: loaded from the cache as it is, nothing said.
    stamp = decode.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aoti_sessions"):
        open_model(decoder_methods_pkg)
    assert decode.stat().st_mtime_ns == stamp and "package cache" not in caplog.text
    assert [p.name for p in (tmp_path / "packages").iterdir()] == [decode.relative_to(tmp_path / "packages").parts[0]]


def _with_metadata(package: Path, target: Path, edit) -> Path:
    """A copy of `package` whose aoti_sessions metadata went through `edit`."""
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("wrapper_metadata.json"):
                meta = json.loads(data)
                doc = json.loads(meta[METADATA_KEY])
                meta[METADATA_KEY] = json.dumps(edit(doc))
                data = json.dumps(meta).encode()
            dst.writestr(info, data)
    return target


def test_unknown_metadata_version_is_refused(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    bad = _with_metadata(counter_cpu_pkg, tmp_path / "v2.pt2", lambda d: {**d, "version": 2})
    with pytest.raises(ais.PackageError, match="unknown version"):
        ais.Engine(bad)


def test_inconsistent_input_specs_are_refused(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    def edit(doc):
        doc["inputs"][0]["strides"] = [1]
        return doc

    bad = _with_metadata(counter_cpu_pkg, tmp_path / "strides.pt2", edit)
    with pytest.raises(ais.PackageError, match="input 0 has 2 sizes but 1 strides"):
        ais.Engine(bad)


def test_metadata_declares_the_mutable_set(counter_cpu_pkg: Path, tmp_path: Path) -> None:
    """With the package's declaration, exactly the declared buffers are state."""
    more = _with_metadata(counter_cpu_pkg, tmp_path / "more.pt2",
                          lambda d: {**d, "mutable_buffers": ["acc", "hits", "table"]})
    with ais.Engine(more) as engine:
        assert sorted(engine.mutable_fqns) == ["acc", "hits", "table"]
    with ais.Engine(counter_cpu_pkg) as engine:
        assert sorted(engine.mutable_fqns) == ["acc", "hits"]


def test_long_buffer_lists_are_shortened_in_the_log() -> None:
    """A package with dozens of state buffers (an LLM's KV cache) logs a count
    and the first names, not a wall of names."""
    from aoti_sessions._engine import _names

    assert _names(["acc", "hits", "table"]) == "acc, hits, table"
    names = [f"layer{i}" for i in range(48)]
    assert _names(names) == ("48 buffers: " + ", ".join(names[:8]) +
                             " and 40 more (Engine.mutable_fqns lists all)")
