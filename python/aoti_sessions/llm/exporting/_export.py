"""``aoti_sessions.llm.export``: a transformers causal LM as one package with a
``prefill`` and a batched ``decode`` method over pooled state.

Both methods share the weights (stored once by the multi-method
``ais.compile``) and the pooled, paged KV cache the engine owns
(docs/batching.md; the module is ``_paged.PagedLM``): ``prefill`` feeds a
chunk of the prompts of up to ``max_batch`` sessions, ``decode`` one token to
each of up to ``max_batch`` sessions, reading the weights once for all rows.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..._compile import compile
from ..._package import top_folder
from ...errors import Error, ExportError
from ._export_check import Refused, check_shapes, refuses_one_row
from ._export_errors import explained, ours
from ._export_methods import methods
from ._export_source import HUB_ID, check_folder, checked_model, hub_folder, load_model, load_tokenizer
from ._linear_attention import layers_traceable
from ._paged import PagedLM, paged_attention_on
from ._fused import fused_projections
from ._quantize import check_scheme, check_target, quantized_weights
from ._rotary import real_rotary
from .._spec import (DEFAULT_MAX_BATCH, DEFAULT_PAGE_SIZE, GENERATION_CONFIG_FILE, LLM_DIR, SPEC_FILE, TOKENIZER_DIR,
                    LLMSpec, require_transformers)

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["export", "DEFAULT_MAX_CACHE_LEN", "DEFAULT_MAX_PREFILL", "DEFAULT_MAX_BATCH", "DEFAULT_PAGE_SIZE"]

log = logging.getLogger("aoti_sessions.llm")

DEFAULT_MAX_CACHE_LEN = 4096  # capped by the model's max_position_embeddings
DEFAULT_MAX_PREFILL = 512  # capped by max_cache_len
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def _sizes(config: Any, max_cache_len: int | None, max_prefill: int | None,
           tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """max_cache_len and max_prefill, defaults filled in and checked against the model."""
    cache_len = _cache_len(config, max_cache_len)
    prefill_len = min(DEFAULT_MAX_PREFILL, cache_len) if max_prefill is None else max_prefill
    if not 2 <= prefill_len <= cache_len:
        raise ValueError(f"max_prefill must be in [2, max_cache_len={cache_len}], got {prefill_len}")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size} logits")
    return cache_len, prefill_len


def _cache_len(config: Any, max_cache_len: int | None) -> int:
    # Sliding-window layers attend within their window at any context (the
    # pooled cache holds every position; _paged.py): the model's own limit holds.
    limit = getattr(config, "max_position_embeddings", None)
    if max_cache_len is None:
        return min(DEFAULT_MAX_CACHE_LEN, limit or DEFAULT_MAX_CACHE_LEN)
    if max_cache_len < 2:
        raise ValueError(f"max_cache_len must be at least 2, got {max_cache_len}")
    if limit is not None and max_cache_len > limit:
        raise ValueError(f"max_cache_len {max_cache_len} exceeds what the model supports ({limit}: "
                         "max_position_embeddings)")
    return max_cache_len


def _eos_ids(generation: GenerationConfig, config: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    for value in (generation.eos_token_id, getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is not None:
            return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return []


def _first_id(*values: Any) -> int | None:
    for value in values:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def _guards_one_row(error: BaseException) -> bool:
    """Whether an export failed because its trace refuses a batch of one
    row (a guard ``size()[0] != 1`` on the rows)."""
    seen: BaseException | None = error
    while seen is not None:
        text = str(seen)
        if "Constraints violated (rows)" in text and "size()[0] != 1" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _compiled_for_its_rows(compiled: Callable[[int], None], max_batch: int) -> None:
    """``compiled(1)``: the package compiled for one row or more and checked;
    where the trace or the compiled code takes two rows at least, compiled
    again for two rows at least (a lone session's call then pads a scratch
    row), and checked. Raises :class:`Refused` for a shape the package would
    declare and its code refuse."""
    note = "compiling for two rows at least (a lone session's call pads a scratch row): the %s assumes two or more"
    try:
        compiled(1)
        return
    except Refused as refused:
        if not refuses_one_row(refused) or max_batch < 2:
            raise
        log.info(note, f"compiled '{refused.method}'")
    except Exception as e:  # noqa: BLE001 - only the guard below is retried; anything else is raised
        if not _guards_one_row(e) or max_batch < 2:
            raise
        log.info(note, "trace")
    compiled(2)


def _grouped_mm_compiles(device: torch.device) -> bool:
    """Whether this torch's AOTInductor compiles ``torch._grouped_mm`` for
    ``device``: its C shim declares the function (torch 2.11's CUDA shim does
    not; transformers calls it for bfloat16 MoE experts)."""
    if device.type != "cuda":
        return True
    header = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "inductor" / "aoti_torch" / "generated" \
        / "c_shim_cuda.h"
    return not header.is_file() or "aoti_torch_cuda__grouped_mm(" in header.read_text()


@contextmanager
def _grouped_mm_fallback(on: bool) -> Iterator[None]:
    """With ``on``: transformers' MoE experts take their grouped-mm fallback
    (a custom op, run through the proxy executor) instead of torch's grouped
    mm, for every dtype (it takes it for all but bfloat16 anyway)."""
    if not on:
        yield
        return
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextmanager
def rewritten(model: PreTrainedModel, max_prefill: int, fuse: bool, quantize: str | None,
              grouped_mm: bool) -> Iterator[None]:
    """``model`` as export traces it, for the block: its linear-attention and
    state-space layers traceable, its rotary in real arithmetic, its sibling
    projections fused (``fuse``), its weights quantized (``quantize``; on
    CUDA, int8 linears on our matmul, ``_int8_mm.py``), its
    MoE experts off torch's grouped mm where AOTInductor cannot compile it.
    (bench/diag_family.py runs the model so, eagerly.)"""
    with layers_traceable(model, max_prefill), real_rotary(model), \
            fused_projections(model) if fuse else nullcontext(), quantized_weights(model, quantize, int8_kernel=True), \
            _grouped_mm_fallback(not grouped_mm):
        yield


@contextmanager
def _exportable(model: PreTrainedModel, device: torch.device, dtype: torch.dtype | None,
                restore: bool) -> Iterator[None]:
    """``model`` on ``device`` in ``dtype``, in eval mode and no_grad, running
    the paged attention; the caller's model is put back as it was when
    ``restore``."""
    import transformers

    if model.generation_config is None:
        model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
    use_cache = model.config.use_cache
    training, old_device, old_dtype = model.training, model.device, model.dtype
    model.config.use_cache = True
    try:
        cast(torch.nn.Module, model).to(device=device, dtype=dtype).eval()
        with torch.no_grad(), paged_attention_on(model):
            yield
    finally:
        model.config.use_cache = use_cache
        if restore:
            cast(torch.nn.Module, model).to(device=old_device, dtype=old_dtype).train(training)


def _model_name(model: PreTrainedModel, source: Path | None) -> str:
    """The hub id the model came from, else its folder's name, else its class."""
    name = str(getattr(model, "name_or_path", "") or "")
    if source is not None or (name and os.path.isdir(name)):
        return Path(name or str(source)).resolve().name
    return name or type(model).__name__


def _append_files(package: str, files: Mapping[str, bytes]) -> None:
    """Adds ``files`` (names relative to LLM_DIR) below the package's top folder."""
    with zipfile.ZipFile(package, "a", allowZip64=True) as zf:
        top = top_folder(zf.namelist())
        for name, data in files.items():
            zf.writestr(f"{top}/{LLM_DIR}/{name}", data)


def _tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {f"{TOKENIZER_DIR}/{p.relative_to(folder).as_posix()}": p.read_bytes()
                for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def export(
    model_or_dir: PreTrainedModel | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    max_cache_len: int | None = None,
    max_prefill: int | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str] | None = None,
    inductor_configs: Mapping[str, Any] | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    page_size: int = DEFAULT_PAGE_SIZE,
    window_cache: str = "ring",
    fuse: bool = True,
    quantize: str | None = None,
    decode_one: bool = False,
) -> str:
    """Compile a transformers causal LM into one LLM package at ``path`` (.pt2).

    ``model_or_dir`` is a ``PreTrainedModel``, a local folder that
    ``save_pretrained`` wrote for the model and its tokenizer, or a hub id
    (``"Qwen/Qwen3-0.6B"``, where no such folder exists: read from the hub's
    cache, fetched where the hub is reachable). The package has two methods over a pooled KV cache the
    engine owns (docs/batching.md), of which each session holds the pages
    (``page_size`` positions each) its positions fall in, up to
    ``max_cache_len`` positions: ``prefill(input_ids[B, T])`` feeds up to T new
    tokens to each of B sessions (2 <= T <= ``max_prefill``; a shorter row is
    right-padded with -1 and truncated to its length after the call) and
    ``decode(input_ids[B, 1])`` one token to each of B sessions (1 <= B <=
    ``max_batch``), each returning the logits of every row's last (real)
    position; the engine fills in
    the cache and each row's pages and positions. The tokenizer, generation
    config and an ``llm.json`` spec travel in the package (read back with
    :func:`aoti_sessions.llm._spec.read_llm_package`).

    ``max_cache_len`` defaults to the model's context (at most 4096),
    ``max_prefill`` to ``min(512, max_cache_len)``, ``dtype`` to the model's.
    ``window_cache``: how sliding-window layers (Gemma 2/3, Mistral, GPT-OSS)
    keep their cache where the window is shorter than the context: "ring"
    (each session keeps its window of positions per layer, a slot of the
    pool that rewinds only to a turn's start, as recurrent state does;
    ``llm/exporting/_ring.py``) or "full" (pages of every position, as global layers:
    rewinds anywhere, feeds generated tokens a step ahead, pads prefill rows).
    ``fuse``: each layer's query, key and value projections compiled as one
    matrix multiply, and its MLP's gate and up projections as one
    (``llm/exporting/_fused.py``; the same results, fewer kernels a step); False keeps
    the model's projections as they are.
    ``quantize``: ``"int8wo"`` or ``"int4wo"``: weight-only quantization of
    every linear layer but the output head (torchao, ``llm/exporting/_quantize.py``;
    the spec records it); None (default): the weights in ``dtype``.
    ``decode_one``: also compile decode for one row alone (a method
    ``decode_one``, which the step loop calls when one chat decodes; its
    matrix-vector products are tuned Triton reductions with their
    neighbours' pointwise work fused in: ``llm/exporting/_export_methods.py``).
    For CUDA; not for models with recurrent or ring state. Off by default:
    one more method to compile.
    Returns the package path.
    """
    require_transformers()

    target = os.fspath(path)
    if not target.endswith(".pt2"):
        raise ValueError(f"package path must end in .pt2, got {target}")
    check_scheme(quantize)
    for flag, setting in (("fuse", fuse), ("decode_one", decode_one)):
        if not isinstance(setting, bool):
            raise ValueError(f"{flag} must be True or False, got {setting!r}")
    if window_cache not in ("ring", "full"):
        raise ValueError(f"window_cache must be 'ring' or 'full', got {window_cache!r}")
    for name, value, low in (("max_batch", max_batch, 1), ("page_size", page_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    torch_dtype = None if dtype is None else _as_dtype(dtype)
    if torch_dtype is not None:  # (before any weight is read; else once the model's dtype is known)
        check_target(quantize, torch.device(device), torch_dtype)
    source: Path | None = None
    hub_id: str | None = None
    if isinstance(model_or_dir, (str, os.PathLike)):
        source = folder = Path(model_or_dir)
        given = os.fspath(model_or_dir)
        if not folder.exists() and isinstance(model_or_dir, str) and HUB_ID.fullmatch(given):
            hub_id, folder = given, hub_folder(given)
        config = check_folder(folder).get_text_config()
        tok = load_tokenizer(tokenizer, folder)
        # Every check before the weights are read: bad input fails fast.
        cache_len, prefill_len = _sizes(config, max_cache_len, max_prefill, tok)
        model = checked_model(load_model(folder, torch_dtype))
    else:
        model = checked_model(model_or_dir)
        config = model.config.get_text_config()
        tok = load_tokenizer(tokenizer, getattr(model, "name_or_path", None))
        cache_len, prefill_len = _sizes(config, max_cache_len, max_prefill, tok)
        if torch_dtype is not None and torch_dtype != model.dtype:
            model = copy.deepcopy(model)  # converting the caller's weights back and forth would round them

    dev = torch.device(device)
    check_target(quantize, dev, torch_dtype or model.dtype)
    generation = model.generation_config  # what the package records: the model's own defaults
    with _exportable(model, dev, torch_dtype, restore=model is model_or_dir), \
            tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(target))) as staging:
        # Decode reads the pages with the Triton kernel on CUDA, by gathering them elsewhere.
        # (Not for attention sinks, which the kernel does not take: GPT-OSS decodes on the gather path.)
        sinks = any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())
        grouped_mm = _grouped_mm_compiles(dev)
        # Export under the final name: the package's top folder is named after the file.
        tmp = os.path.join(staging, os.path.basename(target))
        try:
            with layers_traceable(model, prefill_len):  # (it runs the model once, to see its state)
                module = PagedLM(model, page_size, max_pages=-(-cache_len // page_size),
                                 kernel=dev.type == "cuda" and not sinks, grouped_mm=grouped_mm,
                                 ring_len=cache_len if window_cache == "ring" else None)
            # A hybrid model's recurrent state would read a padded row's padding: one row a prefill call.
            # (Rings too: they rewind only to checkpoints, so a padded row could not be cut back.)
            prefill_rows = 1 if module.state.slots else max_batch

            def compiled(min_rows: int) -> None:
                cast(torch.nn.Module, model).to(dev)
                with rewritten(model, prefill_len, fuse, quantize, grouped_mm):
                    compile(module, methods(module, prefill_len, max_batch, model.dtype, dev, min_rows=min_rows,
                                            quantize=quantize, decode_one=decode_one,
                                            inductor_configs=inductor_configs),
                            path=tmp, inductor_configs=inductor_configs, strict=False)
                if dev.type == "cuda":  # (the package's copy of the weights beside the model's would double them)
                    cast(torch.nn.Module, model).to("cpu")
                    torch.cuda.empty_cache()
                check_shapes(tmp, dev, int(config.vocab_size), prefill_len, prefill_rows, max_batch)

            _compiled_for_its_rows(compiled, max_batch)
        except Refused as refused:
            raise ExportError(f"export of {type(model).__name__}: {refused}; no package written") from None
        except Error:
            raise
        except Exception as e:  # noqa: BLE001 - said as what failed where, the traceback kept
            if ours(e):
                raise
            raise explained(e, model) from e
        missing = sorted({*module.state.attention, *module.state.recurrent} - module.layers_written)
        if missing:
            raise RuntimeError(f"export: the model did not write the cache of layers {missing} (it writes "
                               f"{sorted(module.layers_written)}); this model or transformers version does not "
                               "take the cache export passes it")
        spec = LLMSpec(
            model_type=str(config.model_type), architecture=type(model).__name__,
            max_cache_len=cache_len, max_prefill=prefill_len, vocab_size=int(config.vocab_size),
            eos_token_ids=_eos_ids(generation, config, tok),
            bos_token_id=_first_id(generation.bos_token_id, config.bos_token_id, tok.bos_token_id),
            pad_token_id=_first_id(generation.pad_token_id, getattr(config, "pad_token_id", None), tok.pad_token_id),
            dtype=str(model.dtype).removeprefix("torch."), name=hub_id or _model_name(model, source),
            prefill_rows=prefill_rows, recurrent=bool(module.state.slots),
            window_ring=module.state.ring.window if module.state.ring else 0, quantization=quantize)
        _append_files(tmp, {SPEC_FILE: spec.to_json().encode(),
                            GENERATION_CONFIG_FILE: generation.to_json_string().encode(),
                            **_tokenizer_files(tok)})
        os.replace(tmp, target)
    return target
