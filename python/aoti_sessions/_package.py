"""Finding the model libraries of a ``.pt2`` package or a raw ``.so``.

Packages are extracted once into a cache directory keyed by the package's
content hash. Entries that could escape that directory (absolute paths, ``..``,
links) refuse the whole package.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import PackageError

__all__ = ["MethodFiles", "cache_dir", "open_model", "METADATA_KEY"]

# Key of the JSON document ais.compile stores in the package metadata.
METADATA_KEY = "aoti_sessions"


@dataclass(frozen=True)
class MethodFiles:
    """One compiled method: its library and what the package says about it."""

    name: str
    library: str
    cubin_dir: str
    device_key: str | None  # "cpu" / "cuda" from the package, None for a raw .so
    metadata: dict[str, str] = field(default_factory=dict)
    # Libraries compiled without weights (multi-method ais.compile): the
    # weights file and the entries of it this method reads.
    weights_file: str | None = None
    weights: list[dict[str, Any]] = field(default_factory=list)

    def sessions_metadata(self) -> dict[str, Any] | None:
        """The document ais.compile recorded, or None for foreign packages."""
        raw = self.metadata.get(METADATA_KEY)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PackageError(f"method '{self.name}': unreadable {METADATA_KEY} metadata: {e}")
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise PackageError(
                f"method '{self.name}': {METADATA_KEY} metadata of an unknown version "
                f"({doc.get('version') if isinstance(doc, dict) else doc!r}); "
                "upgrade aoti_sessions or recompile the package"
            )
        return doc


def cache_dir() -> Path:
    """Root of aoti_sessions' caches: ``$AOTI_SESSIONS_CACHE``, else the user cache dir."""
    env = os.environ.get("AOTI_SESSIONS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aoti_sessions"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_entry(info: zipfile.ZipInfo) -> None:
    name = info.filename
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise PackageError(f"package entry '{name}' is an absolute path")
    if ".." in parts:
        raise PackageError(f"package entry '{name}' escapes the package directory")
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise PackageError(f"package entry '{name}' is a symbolic link")


def _extract(package: Path) -> Path:
    if not zipfile.is_zipfile(package):
        raise PackageError(f"{package} is neither a .pt2 package (zip) nor a .so library")
    target = cache_dir() / "packages" / _sha256(package)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
    try:
        with zipfile.ZipFile(package) as archive:
            infos = archive.infolist()
            for info in infos:
                _check_entry(info)
            for info in infos:
                archive.extract(info, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():  # not a concurrent extraction of the same package
                raise
    except zipfile.BadZipFile as e:
        raise PackageError(f"{package} is a corrupt package: {e}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# The weights file of a multi-method ais.compile package, below its top folder.
WEIGHTS_INDEX = "data/aoti_sessions/weights.json"


def _weights_of(top: Path, package: Path) -> tuple[str | None, list[dict[str, Any]]]:
    index = top / WEIGHTS_INDEX
    if not index.is_file():
        return None, []
    try:
        doc = json.loads(index.read_text())
        if doc.get("version") != 1:
            raise PackageError(f"{package}: weights index of an unknown version {doc.get('version')!r}")
        blob = (top / doc["blob"]).resolve()
        entries = list(doc["entries"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PackageError(f"{package}: unreadable weights index {WEIGHTS_INDEX}: {e}") from None
    if not blob.is_relative_to(top.resolve()) or not blob.is_file():
        raise PackageError(f"{package}: weights file {doc['blob']} is missing")
    return str(blob), entries


def _methods_in(root: Path, package: Path) -> list[MethodFiles]:
    methods = []
    for model_dir in sorted(root.glob("*/data/aotinductor/*")):
        if not model_dir.is_dir():
            continue
        libraries = sorted(model_dir.glob("*.so"))
        if len(libraries) != 1:
            raise PackageError(
                f"{package}: model '{model_dir.name}' holds {len(libraries)} libraries, expected 1"
            )
        metadata: dict[str, str] = {}
        for meta_file in sorted(model_dir.glob("*metadata.json")):
            if meta_file.name.startswith(libraries[0].name.split(".")[0]):
                metadata = json.loads(meta_file.read_text())
        weights_file, entries = _weights_of(model_dir.parents[2], package)
        methods.append(
            MethodFiles(
                name=model_dir.name,
                library=str(libraries[0]),
                cubin_dir=str(model_dir),
                device_key=metadata.get("AOTI_DEVICE_KEY"),
                metadata=metadata,
                weights_file=weights_file,
                weights=[e for e in entries if model_dir.name in e.get("methods", ())],
            )
        )
    if not methods:
        raise PackageError(f"{package} holds no AOTInductor model (no data/aotinductor/<model>/)")
    return methods


def open_model(path: str | os.PathLike[str]) -> list[MethodFiles]:
    """The methods of a ``.pt2`` package, or the single method of a ``.so``."""
    p = Path(path)
    if not p.is_file():
        raise PackageError(f"model file {p} does not exist")
    if p.suffix == ".so":
        return [MethodFiles(name="forward", library=str(p.resolve()), cubin_dir=str(p.parent.resolve()),
                            device_key=None)]
    return _methods_in(_extract(p), p)
