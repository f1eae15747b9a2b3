"""Package handling: raw libraries, the extraction cache, package metadata."""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

import pytest
import torch

import aoti_sessions as ais
from aoti_sessions._package import METADATA_KEY, open_model
from conftest import counter_inputs


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
