"""The package format: finding the model libraries of a ``.pt2`` package or a
raw ``.so``, and reading what ``ais.compile`` stored in it. The writer
(``_compile.py``) takes its names and versions from here.

Packages are extracted once into the package cache (``_extraction.py``).
Every document read from a package is checked field by field: anything
malformed is a :class:`PackageError` naming the file and the field.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ._extraction import cache_dir, extract as _extract, remove_extraction  # _extract: llm/_spec.py's name
from ._json import Field, read_json
from .errors import PackageError

__all__ = ["MethodFiles", "SessionsMetadata", "PoolDoc", "InputDoc", "OutputDoc", "WeightDoc", "cache_dir", "open_model",
           "top_folder", "METADATA_KEY", "METADATA_VERSION", "WEIGHTS_INDEX", "WEIGHTS_BLOB", "WEIGHTS_VERSION",
           "WEIGHTS_ALIGN", "_extract"]

# Key of the JSON document ais.compile stores in the AOTI package metadata.
METADATA_KEY = "aoti_sessions"
METADATA_VERSION = 1
# The weights of a multi-method ais.compile package, below its top folder:
# one blob with every distinct tensor once, and its JSON index.
WEIGHTS_INDEX = "data/aoti_sessions/weights.json"
# Python modules defining the custom ops the package's methods call (a JSON
# list; ais.compile writes it): imported where an op is not registered yet.
OP_MODULES = "data/aoti_sessions/op_modules.json"
WEIGHTS_BLOB = "data/aoti_sessions/weights.bin"
WEIGHTS_VERSION = 1
WEIGHTS_ALIGN = 256  # bytes; every tensor in the blob starts on such a boundary


@dataclass(frozen=True)
class InputDoc:
    """One recorded input: ``None`` sizes are dynamic (``symbols`` names them);
    ``strides`` None means contiguous; ``name`` is the exported name (packages
    from before names were recorded have none)."""

    dtype: str
    sizes: list[int | None]
    strides: list[int] | None
    name: str | None = None
    symbols: list[str | None] | None = None


@dataclass(frozen=True)
class OutputDoc:
    """One recorded output tensor."""

    dtype: str
    sizes: list[int | None]
    symbols: list[str | None] | None = None


@dataclass(frozen=True)
class PoolDoc:
    """How a pooled method addresses the engine's pooled state (input positions)."""

    page_size: int
    tensors: list[tuple[int, str, str]]  # (input, name, "pages" | "slots")
    tokens: int
    max_rows: int
    page_table: int | None = None
    positions: int | None = None
    slot_ids: int | None = None
    max_pages: int = 0  # pages a session holds at most (the page table's width, or its bound)
    min_rows: int = 1  # rows a call takes at least (fewer are padded)

    @property
    def engine_filled(self) -> set[int]:
        """Inputs the engine fills (the caller gives the others)."""
        filled = {i for i, _, _ in self.tensors}
        return filled | {i for i in (self.page_table, self.positions, self.slot_ids) if i is not None}


@dataclass(frozen=True)
class SessionsMetadata:
    """What ais.compile recorded for one method."""

    mutable_buffers: list[str] | None
    inputs: list[InputDoc] | None
    outputs: list[OutputDoc] | None = None
    # Each dynamic dimension's symbol: its (min, max), None where unbounded.
    ranges: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    pool: PoolDoc | None = None


@dataclass(frozen=True)
class WeightDoc:
    """One tensor of the weights blob that a method reads."""

    fqn: str
    dtype: str
    sizes: list[int]
    strides: list[int]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class MethodFiles:
    """One compiled method: its library and what the package says about it."""

    name: str
    library: str
    cubin_dir: str
    device_key: str | None  # "cpu" / "cuda" from the package, None for a raw .so
    metadata: SessionsMetadata | None = None  # None for foreign packages
    # Libraries compiled without weights (multi-method ais.compile): the
    # weights file and the entries of it this method reads.
    weights_file: str | None = None
    weights: list[WeightDoc] = field(default_factory=list)
    op_modules: list[str] = field(default_factory=list)  # OP_MODULES

    def renamed(self, name: str) -> MethodFiles:
        return MethodFiles(name, self.library, self.cubin_dir, self.device_key, self.metadata,
                           self.weights_file, self.weights, self.op_modules)


def top_folder(names: list[str]) -> str:
    """The folder a package's entries sit under (named after its file, as
    torch writes packages), from the archive's names; "" for an empty one."""
    return names[0].split("/", 1)[0] if names else ""


def _sessions_metadata(raw: Field) -> SessionsMetadata:
    """The document ais.compile stored (a JSON string inside the AOTI metadata)."""
    doc = raw.json_string()
    version = doc["version"].integer()
    if version != METADATA_VERSION:
        raise PackageError(f"{doc.where('version')}: {METADATA_KEY} metadata of an unknown version "
                           f"({version}); upgrade aoti_sessions or recompile the package")
    mutable = doc.get("mutable_buffers")
    inputs = doc.get("inputs")
    outputs = doc.get("outputs")
    ranges = doc.get("ranges")
    return SessionsMetadata(
        mutable_buffers=None if mutable is None else mutable.strings(),
        inputs=None if inputs is None else [
            InputDoc(dtype=entry["dtype"].string(), sizes=_sizes(entry),
                     strides=None if entry.get("strides") is None
                     else [s.integer() for s in entry["strides"].items()],
                     name=None if entry.get("name") is None else entry["name"].string(),
                     symbols=_symbols(entry))
            for entry in inputs.items()
        ],
        outputs=None if outputs is None else [
            OutputDoc(dtype=entry["dtype"].string(), sizes=_sizes(entry), symbols=_symbols(entry))
            for entry in outputs.items()
        ],
        ranges={} if ranges is None else {
            r["symbol"].string(): (_optional_int(r.get("min")), _optional_int(r.get("max"))) for r in ranges.items()
        },
        pool=None if doc.get("pool") is None else _pool_doc(doc["pool"]),
    )


_POOL_KINDS = ("pages", "slots")


def _pool_doc(raw: Field) -> PoolDoc:
    tensors = []
    for t in raw["tensors"].items():
        kind = t["kind"].string()
        if kind not in _POOL_KINDS:
            raise PackageError(f"{t.where('kind')} must be one of {', '.join(_POOL_KINDS)}, got {kind!r}")
        tensors.append((t["input"].integer(minimum=0), t["name"].string(), kind))
    return PoolDoc(page_size=raw["page_size"].integer(minimum=0), tensors=tensors,
                   tokens=raw["tokens"].integer(minimum=0), max_rows=raw["max_rows"].integer(minimum=1),
                   page_table=_optional_int(raw.get("page_table")), positions=_optional_int(raw.get("positions")),
                   slot_ids=_optional_int(raw.get("slot_ids")),
                   max_pages=0 if raw.get("max_pages") is None else raw["max_pages"].integer(minimum=0),
                   min_rows=1 if raw.get("min_rows") is None else raw["min_rows"].integer(minimum=1))


def _sizes(entry: Field) -> list[int | None]:
    return [d.integer_or_none(minimum=0) for d in entry["sizes"].items()]


def _symbols(entry: Field) -> list[str | None] | None:
    symbols = entry.get("symbols")
    return None if symbols is None else [None if s.value is None else s.string() for s in symbols.items()]


def _optional_int(value: Field | None) -> int | None:
    return None if value is None else value.integer()


def _weights_of(top: Path) -> tuple[str | None, list[tuple[WeightDoc, list[str]]], list[str]]:
    """The weights file, its entries with the methods reading each, and the
    methods in the order given to ais.compile (empty if not recorded)."""
    index_path = top / WEIGHTS_INDEX
    if not index_path.is_file():
        return None, [], []
    index = read_json(index_path)
    version = index["version"].integer()
    if version != WEIGHTS_VERSION:
        raise PackageError(f"{index.where('version')}: weights index of an unknown version {version}")
    blob_name = index["blob"].string()
    blob = (top / blob_name).resolve()
    if not blob.is_relative_to(top.resolve()) or not blob.is_file():
        raise PackageError(f"{index.where('blob')}: weights file {blob_name} is missing")
    entries = []
    for e in index["entries"].items():
        doc = WeightDoc(fqn=e["fqn"].string(), dtype=e["dtype"].string(),
                        sizes=[s.integer(minimum=0) for s in e["sizes"].items()],
                        strides=[s.integer() for s in e["strides"].items()],
                        offset=e["offset"].integer(minimum=0), nbytes=e["nbytes"].integer(minimum=0))
        entries.append((doc, e["methods"].strings()))
    order = index.get("methods")
    return str(blob), entries, [] if order is None else order.strings()


def _op_modules_of(top: Path) -> list[str]:
    path = top / OP_MODULES
    if not path.is_file():
        return []
    modules = read_json(path)
    return [m.string() for m in modules.items()]


def _methods_in(root: Path, package: Path) -> list[MethodFiles]:
    methods = []
    order: list[str] = []
    for model_dir in sorted(root.glob("*/data/aotinductor/*")):
        if not model_dir.is_dir():
            continue
        libraries = sorted(model_dir.glob("*.so"))
        if len(libraries) != 1:
            raise PackageError(
                f"{package}: model '{model_dir.name}' holds {len(libraries)} libraries, expected 1"
            )
        device_key: str | None = None
        metadata: SessionsMetadata | None = None
        for meta_file in sorted(model_dir.glob("*metadata.json")):
            if not meta_file.name.startswith(libraries[0].name.split(".")[0]):
                continue
            meta = read_json(meta_file)
            key = meta.get("AOTI_DEVICE_KEY")
            device_key = None if key is None else key.string()
            raw = meta.get(METADATA_KEY)
            metadata = None if raw is None else _sessions_metadata(raw)
        weights_file, entries, order = _weights_of(model_dir.parents[2])
        op_modules = _op_modules_of(model_dir.parents[2])
        methods.append(MethodFiles(
            name=model_dir.name,
            library=str(libraries[0]),
            cubin_dir=str(model_dir),
            device_key=device_key,
            metadata=metadata,
            weights_file=weights_file,
            weights=[doc for doc, users in entries if model_dir.name in users],
            op_modules=op_modules,
        ))
    if not methods:
        raise PackageError(f"{package} holds no AOTInductor model (no data/aotinductor/<model>/)")
    # In the order given to ais.compile where it is recorded; by name otherwise.
    return sorted(methods, key=lambda m: (order.index(m.name) if m.name in order else len(order), m.name))


def _check_model_path(p: Path) -> None:
    if "\0" in str(p):
        raise ValueError(f"model path {str(p)!r}: embedded null byte")
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise PackageError(f"model file {p} does not exist") from None
    except OSError as e:
        raise PackageError(f"cannot read model file {p}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise PackageError(f"model file {p} is a folder; give a .pt2 package or a .so library")
    if not stat.S_ISREG(mode):
        raise PackageError(f"model file {p} is not a regular file (a device, FIFO or socket); "
                           "give a .pt2 package or a .so library")


def open_model(path: str | os.PathLike[str]) -> list[MethodFiles]:
    """The methods of a ``.pt2`` package, or the single method of a ``.so``."""
    p = Path(path)
    _check_model_path(p)
    if p.suffix == ".so":
        return [MethodFiles(name="forward", library=str(p.resolve()), cubin_dir=str(p.parent.resolve()),
                            device_key=None)]
    target = _extract(p)
    try:
        return _methods_in(target, p)
    except PackageError:
        remove_extraction(target)  # refused for what it holds: every later load would be too
        raise


