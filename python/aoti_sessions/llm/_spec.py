"""What an LLM package carries besides its compiled methods, and reading it back.

``aoti_sessions.llm.export`` writes, below the package's top folder::

    data/aoti_sessions/llm/llm.json                 # LLMSpec, the fields below
    data/aoti_sessions/llm/generation_config.json   # the model's generation defaults
    data/aoti_sessions/llm/tokenizer/...            # tokenizer.save_pretrained output

The package's methods (``aoti_sessions.llm.export``) are ``prefill(input_ids
int64[B, T]) -> logits[B, V]`` for 2 <= T <= max_prefill and B <=
prefill_rows (rows right-padded with PAD_ID, -1; each row's last real
position's logits) and ``decode(input_ids int64[B, 1]) -> logits[B, V]``, over a pooled
KV cache of up to ``max_cache_len`` positions a session.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._json import Field
from .._package import _check_model_path, _extract, top_folder
from ..errors import PackageError

__all__ = ["LLMSpec", "LLMPackage", "read_llm_package", "require_transformers", "LLM_DIR", "SPEC_FILE", "GENERATION_CONFIG_FILE",
           "TOKENIZER_DIR", "SPEC_VERSION", "PAD_ID", "DEFAULT_MAX_BATCH", "DEFAULT_PAGE_SIZE",
           "QUANTIZATIONS", "HUB_ID"]

# Export's defaults, which its command line names too.
DEFAULT_MAX_BATCH = 64  # sessions one decode call takes at most
DEFAULT_PAGE_SIZE = 16  # positions a page of the pooled KV cache

PAD_ID = -1  # pads a shorter row of a prefill call (after its tokens): the compiled prefill skips it

LLM_DIR = "data/aoti_sessions/llm"  # below the package's top folder
SPEC_FILE = "llm.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_DIR = "tokenizer"
SPEC_VERSION = 1
# The weight-only quantization schemes export applies and a spec may record.
QUANTIZATIONS = ("int8wo", "int4wo")
# A hub id: "name" or "owner/name" (the hub's own rule for the characters): what export reads a model by,
# and what serve, which takes packages, names as a model export would take.
HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


@dataclass(frozen=True)
class LLMSpec:
    """``llm.json``: what the runtime needs to drive the two methods."""

    model_type: str  # transformers' config.model_type, e.g. "qwen3"
    architecture: str  # the model class, e.g. "Qwen3ForCausalLM"
    max_cache_len: int  # positions in the KV cache: prompt + completion
    max_prefill: int  # most tokens per prefill call
    vocab_size: int  # V, the logits' last dimension
    eos_token_ids: list[int]  # generation stops at any of these
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: str  # of the weights and the KV cache, e.g. "float32"
    name: str  # the model's id (its folder or hub name), for APIs that report one
    version: int = SPEC_VERSION
    prefill_rows: int = 1  # sessions one prefill call feeds at most (packages before batched prefill: 1)
    # Layers keep recurrent state (conv, SSM, delta-net: hybrid models) that
    # cannot rewind by position: prefill rows are never padded, and a session
    # whose history changes is fed again from its start.
    recurrent: bool = False
    # Window layers keep a ring of this many positions a session (0: no ring;
    # their rings rewind as recurrent state does).
    window_ring: int = 0
    # Weight-only quantization export applied (one of QUANTIZATIONS, llm/exporting/_quantize.py); None: the model's dtype.
    quantization: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class LLMPackage:
    """An LLM package as read by :func:`read_llm_package`."""

    path: Path
    spec: LLMSpec
    generation_config: dict[str, Any]
    tokenizer_dir: Path  # the tokenizer files, extracted (cached by the package's hash)

    def load_tokenizer(self) -> Any:
        """The package's tokenizer (``AutoTokenizer``), chat template included."""
        return require_transformers().AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)


def require_transformers() -> Any:
    """The transformers module, or an ImportError saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("aoti_sessions.llm needs transformers: pip install 'aoti-sessions[llm]'") from e
    return transformers


def _optional_id(doc: Field, key: str) -> int | None:
    value = doc.get(key)
    return None if value is None else value.integer(minimum=0)


def _spec(doc: Field) -> LLMSpec:
    version = doc["version"].integer()
    if version != SPEC_VERSION:
        raise PackageError(f"{doc.where('version')}: LLM spec of an unknown version ({version}); upgrade "
                           "aoti_sessions or export the model again")
    max_cache_len = doc["max_cache_len"].integer(minimum=2)
    max_prefill = doc["max_prefill"].integer(minimum=2)
    if max_prefill > max_cache_len:
        raise PackageError(f"{doc.where('max_prefill')} ({max_prefill}) exceeds max_cache_len ({max_cache_len})")
    vocab_size = doc["vocab_size"].integer(minimum=1)
    eos = [item.integer(minimum=0) for item in doc["eos_token_ids"].items()]
    if any(i >= vocab_size for i in eos):
        raise PackageError(f"{doc.where('eos_token_ids')} holds an id outside the vocabulary ({vocab_size}): {eos}")
    return LLMSpec(
        model_type=doc["model_type"].string(), architecture=doc["architecture"].string(),
        max_cache_len=max_cache_len, max_prefill=max_prefill, vocab_size=vocab_size, eos_token_ids=eos,
        bos_token_id=_optional_id(doc, "bos_token_id"), pad_token_id=_optional_id(doc, "pad_token_id"),
        dtype=doc["dtype"].string(), name=doc["name"].string(), version=version,
        prefill_rows=rows.integer(minimum=1) if (rows := doc.get("prefill_rows")) is not None else 1,
        recurrent=flag.boolean() if (flag := doc.get("recurrent")) is not None else False,
        window_ring=ring.integer(minimum=0) if (ring := doc.get("window_ring")) is not None else 0,
        quantization=_quantization(doc))


def _quantization(doc: Field) -> str | None:
    value = doc.get("quantization")
    if value is None:
        return None
    scheme = value.string()
    if scheme not in QUANTIZATIONS:
        raise PackageError(f"{doc.where('quantization')}: unknown quantization {scheme!r} "
                           f"({', '.join(QUANTIZATIONS)})")
    return scheme


def _read_entry(archive: zipfile.ZipFile, name: str, package: Path) -> Field:
    where = f"{package}:{name}"
    try:
        text = archive.read(name).decode("utf-8")
        return Field(json.loads(text), where)
    except KeyError:
        raise PackageError(f"{where} is missing") from None
    except UnicodeDecodeError:
        raise PackageError(f"{where} is not a text (UTF-8) file") from None
    except json.JSONDecodeError as e:
        raise PackageError(f"{where} is not valid JSON: {e}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise PackageError(f"{package} is a corrupt package: {e}") from None


def read_llm_package(path: str | os.PathLike[str]) -> LLMPackage:
    """The spec, generation config and tokenizer folder of an LLM package.

    A :class:`PackageError` names the file and the field when the package is
    not an LLM package (made by ``aoti_sessions.llm.export``) or a field is
    malformed."""
    package = Path(path)
    _check_model_path(package)
    if not zipfile.is_zipfile(package):
        raise PackageError(f"{package} is not a .pt2 package (zip); export the model with "
                           "aoti_sessions.llm.export")
    try:
        with zipfile.ZipFile(package) as archive:
            names = archive.namelist()
            top = top_folder(names)
            llm_dir = f"{top}/{LLM_DIR}"
            if f"{llm_dir}/{SPEC_FILE}" not in names:
                raise PackageError(f"{package} is not an LLM package (no {LLM_DIR}/{SPEC_FILE} in it); "
                                   "export the model with aoti_sessions.llm.export")
            spec = _spec(_read_entry(archive, f"{llm_dir}/{SPEC_FILE}", package))
            generation = _read_entry(archive, f"{llm_dir}/{GENERATION_CONFIG_FILE}", package)
    except zipfile.BadZipFile as e:
        raise PackageError(f"{package} is a corrupt package: {e}") from None
    if not isinstance(generation.value, dict):
        raise PackageError(f"{generation.where()} must be a JSON object, got {type(generation.value).__name__}")
    tokenizer_dir = _extract(package) / top / LLM_DIR / TOKENIZER_DIR
    if not tokenizer_dir.is_dir() or not any(tokenizer_dir.iterdir()):
        raise PackageError(f"{package} holds no tokenizer ({LLM_DIR}/{TOKENIZER_DIR}/ is missing or empty)")
    return LLMPackage(path=package, spec=spec, generation_config=dict(generation.value),
                      tokenizer_dir=tokenizer_dir)
