"""The package cache: a ``.pt2`` package (a zip) extracted once into a folder
keyed by its content hash, checked against the package at every load.

A package is refused whole where an entry could escape that folder (absolute
paths, ``..``, links) or the extraction would fill the disk: the sizes its
entries declare are checked before anything is written (at most
``AOTI_SESSIONS_MAX_EXTRACT_RATIO`` times the package's own size, and what
the disk has free), and each entry is written with a running count, so one
whose content is not the size it declares stops there. A refused or failed
extraction leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from .errors import PackageError

__all__ = ["cache_dir", "extract", "remove_extraction", "MAX_EXTRACT_RATIO", "MAX_EXTRACT_RATIO_ENV"]

log = logging.getLogger("aoti_sessions")


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
    if info.flag_bits & 0x1:
        raise PackageError(f"package entry '{name}' is encrypted")


# Extracted, a package's files take at most this many times the package's own
# size. torch and ais.compile store them uncompressed (about 1x); a zip tool's
# deflate gives libraries and text 2-10x; a zip bomb gives 1000x and more (and
# entries sharing their compressed data, more than the sum of their compressed
# sizes: hence the package's size, not theirs).
MAX_EXTRACT_RATIO = 20.0
MAX_EXTRACT_RATIO_ENV = "AOTI_SESSIONS_MAX_EXTRACT_RATIO"
MAX_ENTRIES = 100_000  # files a package may hold (each takes an inode, whatever its size)


def _max_ratio() -> float:
    text = os.environ.get(MAX_EXTRACT_RATIO_ENV)
    if not text:
        return MAX_EXTRACT_RATIO
    try:
        ratio = float(text)
    except ValueError:
        ratio = 0.0
    if not 0 < ratio < float("inf"):
        raise PackageError(f"{MAX_EXTRACT_RATIO_ENV}={text!r}: must be a number above 0 (how many times its own "
                           "size a package may take once extracted)")
    return ratio


def _check_sizes(package: Path, infos: list[zipfile.ZipInfo], folder: Path) -> None:
    """Refuses a package whose entries declare more bytes than it may extract
    to (its size times the ratio above) or than ``folder``'s disk has free."""
    if len(infos) > MAX_ENTRIES:
        raise PackageError(f"{package} holds {len(infos)} entries; a package may hold at most {MAX_ENTRIES}")
    declared = sum(i.file_size for i in infos if not i.is_dir())
    size = max(1, package.stat().st_size)
    ratio = _max_ratio()
    if declared > ratio * size:
        raise PackageError(f"{package} would extract to {declared} bytes, {declared / size:.0f} times its own "
                           f"{size}: beyond the limit of {ratio:g} times (a zip bomb?); nothing was extracted. For a "
                           f"package you trust, set {MAX_EXTRACT_RATIO_ENV} to a higher ratio")
    free = shutil.disk_usage(folder).free
    if declared > free:
        raise PackageError(f"{package} would extract to {declared} bytes; the package cache {folder} has {free} "
                           "bytes free: make room, or set AOTI_SESSIONS_CACHE to a folder on a larger disk")


_CHUNK = 1 << 20


def _extract_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo, staging: Path) -> None:
    """Writes one (checked) entry below ``staging``, counting its bytes: an
    entry whose content is longer or shorter than its declared size (which
    _check_sizes counted) stops the extraction."""
    path = staging.joinpath(*PurePosixPath(info.filename).parts)
    if info.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with archive.open(info) as source, open(path, "wb") as out:
        while chunk := source.read(_CHUNK):
            written += len(chunk)
            if written > info.file_size:
                raise PackageError(f"package entry '{info.filename}' holds more than the {info.file_size} bytes its "
                                   "header declares")
            out.write(chunk)
    if written != info.file_size:
        raise PackageError(f"package entry '{info.filename}' holds {written} bytes; its header declares "
                           f"{info.file_size}")


def remove_extraction(target: Path) -> None:
    """Removes an extraction: set aside first (a process using its files
    keeps them; another setting it aside at the same time is no error)."""
    aside = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent))
    try:
        os.rename(target, aside / "old")
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _packages_dir(package: Path) -> Path:
    """The extraction cache, created if needed; a PackageError if it cannot be."""
    folder = cache_dir() / "packages"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        origin = "AOTI_SESSIONS_CACHE" if os.environ.get("AOTI_SESSIONS_CACHE") else "the user cache folder"
        raise PackageError(f"cannot extract {package}: the package cache {folder} ({origin}) is not a "
                           f"usable folder: {e.strerror or e}") from None
    return folder


# Extracted files up to this size are checked against their CRC-32 in the
# package at every load; larger ones (weights) by their size only.
CRC_CHECKED_BYTES = 64 << 20


def _changed_entry(package: Path, target: Path) -> str | None:
    """What differs between ``package``'s files and those extracted at
    ``target`` (a size, or the content of one up to CRC_CHECKED_BYTES), or
    None where they agree."""
    try:
        with zipfile.ZipFile(package) as archive:
            infos = [i for i in archive.infolist() if not i.is_dir()]
    except (OSError, zipfile.BadZipFile):
        return None  # the extraction below says what is wrong with the package
    for info in infos:
        path = target / info.filename
        try:
            size = os.stat(path).st_size
            if size != info.file_size:
                return f"{info.filename} has {size} bytes, the package's {info.file_size}"
            if size <= CRC_CHECKED_BYTES:
                crc = 0
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        crc = zlib.crc32(chunk, crc)
                if crc != info.CRC:
                    return f"{info.filename} differs from the package's"
        except OSError as e:
            return f"{info.filename} is unreadable ({e.strerror or e})"
    return None


def extract(package: Path) -> Path:
    """The folder ``package`` is extracted in (extracted now, unless an
    intact extraction is there already): its entries below their top folder."""
    if not zipfile.is_zipfile(package):
        raise PackageError(f"{package} is neither a .pt2 package (zip) nor a .so library")
    packages = _packages_dir(package)
    target = packages / _sha256(package)
    if target.is_dir():
        changed = _changed_entry(package, target)
        if changed is None:
            return target
        log.warning("the package cache's copy of %s was changed (%s): extracting it again", package.name, changed)
        remove_extraction(target)
    try:
        with zipfile.ZipFile(package) as archive:
            infos = archive.infolist()
            for info in infos:
                _check_entry(info)
            _check_sizes(package, infos, packages)
            staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=packages))
            try:
                for info in infos:
                    _extract_entry(archive, info, staging)
                try:
                    os.rename(staging, target)
                except OSError:
                    if not target.is_dir():  # not a concurrent extraction of the same package
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
        raise PackageError(f"{package} is a corrupt package: {e}") from None
    except OSError as e:
        raise PackageError(f"cannot extract {package} into {packages}: {e}") from None
    return target
