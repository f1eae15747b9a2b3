"""The methods an LLM package compiles, with their example inputs and shapes
(``aoti_sessions.llm.export``; docs/batching.md): ``prefill`` and a batched
``decode`` over the pooled state and, where asked for, ``decode_one``.

``decode_one`` is decode compiled for one row alone, which the step loop
calls when one chat decodes (issue 38). Decoder layers of the Llama form
run their projections on ``_gemv``'s kernel (bf16 or torchao's int8 rows),
norms, SiLU-mul and residual adds inside it, and their q/k norms, rotary
and cache write on ``_kv_write``'s (``_one_row.py``). Elsewhere (other
layers, int4 weights), with the rows static at one, Inductor decomposes
each matrix-vector product into a reduction (its ``mm`` decomposition under
coordinate-descent tuning, as gpt-fast's decode relies on), fuses the
pointwise work around it into that kernel (a norm's scaling, SiLU-mul) and
tunes it for the shape. The batched ``decode`` keeps cuBLAS's kernels for
1-64 rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from ..._compile import Method, Pool
from ...errors import ExportError
from ._one_row import plan_one_row
from ._paged import PagedLM
from ._quantize import inductor_configs as quantize_configs

__all__ = ["methods", "DECODE_ONE", "DECODE_ONE_CONFIGS", "STEP_VALUES_ONCE", "PREFILL_ATTENTION", "DECODE_ATTENTION"]

DECODE_ONE = "decode_one"
# What decode_one's compile adds: the mm decomposition for one row and the tuning of its kernels.
DECODE_ONE_CONFIGS: dict[str, Any] = {"coordinate_descent_tuning": True}
# decode_one's compile, always: a step's values that every layer's kernels read (the rotary angles' cos and sin,
# the new position's page and offset, the rows' lengths) computed once a step. Inductor inlines a pointwise value
# into each consumer unless it reads more than this many buffers, and a Triton op's input must be a buffer: so
# each layer's kernels got copies of their own, a kernel or two a layer (2 of 8.9 a layer on the Qwen3-0.6B
# shape, ~70 us of a 0.78 ms step on an H200: bench/results/decode_cuda.md, stop 57).
STEP_VALUES_ONCE: dict[str, Any] = {"realize_reads_threshold": 0}
_EXAMPLE_PREFILL = 8  # tokens of the example prefill call (any size in [2, max_prefill] serves)
_EXAMPLE_ROWS = 2  # sessions of the example calls (any count in [1, max_batch] serves)


# Attention backends per method (bench/results/attention_cuda.md). Prefill:
# not cuDNN's, which builds an execution plan for every new input shape, cached
# per thread: about 50 ms on an H100 (torch 2.11) that a prefill of a length
# not seen before on that thread (most chat turns) would add to its time to
# first token; the memory-efficient kernel is as fast there. Decode: torch's
# choice (cuDNN on an H100): its one shape is planned once per thread, before
# the session's graph is captured, and its step is 1.7x faster than the
# memory-efficient kernel's.
PREFILL_ATTENTION: tuple[SDPBackend, ...] | None = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                    SDPBackend.MATH)
DECODE_ATTENTION: tuple[SDPBackend, ...] | None = None


def methods(module: PagedLM, max_prefill: int, max_batch: int, dtype: torch.dtype, device: torch.device,
            min_rows: int = 1, quantize: str | None = None, decode_one: bool = False,
            inductor_configs: Mapping[str, Any] | None = None) -> dict[str, Method]:
    """Example inputs: prefill's length is dynamic in [2, max_prefill], both
    methods' rows in [1, max_batch]; the pool's pages are dynamic (the engine
    sizes it). ``decode_one``: a third method, decode for one row alone
    (``DECODE_ONE``). A quantized package's decode methods are compiled with
    the Inductor settings torchao recommends (its prefill is not: the
    settings' tuning took minutes a prefill and serves decode's GEMVs).
    ``inductor_configs`` (the caller's) go over every method's own."""
    example = min(_EXAMPLE_PREFILL, max_prefill)
    # A hint, not a named Dim: on CUDA, attention pads the mask to a multiple of
    # 8 and dynamo cannot prove the guard that adds for every length in range
    # ("Constraints violated (tokens)"); a hint lets export keep it as a check.
    tokens = torch.export.Dim.DYNAMIC(min=2, max=max_prefill)
    # A model with slots (hybrid layers, window rings) makes the trace guard
    # the row count against 1 (views Inductor or export cannot prove for a
    # batch of one, torch 2.11 and 2.13 at different places): it is compiled
    # for two rows or more, and the engine pads a call of one session with a
    # scratch row (min_rows). So is any model whose trace guards it so
    # (``min_rows``: export tries again; transformers' grouped-mm fallback
    # in bfloat16 on torch 2.11's CPU does).
    rows = torch.export.Dim("rows", min=min(max(min_rows, 2 if module.state.slots else 1), max_batch),
                            max=max_batch)
    pages = torch.export.Dim.DYNAMIC
    # The page table's width: the pages the call's rows hold, so attention
    # reads only those; static (every page a session may hold) where decode
    # runs the paged kernel, which reads only held positions anyway and is
    # captured in CUDA graphs.
    # (At least 2: a width of one guards the trace; the engine passes at
    # least min(4, max_pages).)
    width = torch.export.Dim("width", min=2, max=module.max_pages) if module.max_pages > 2 else None
    prefill_width = {} if width is None else {1: width}
    decode_width = None if module.kernel or width is None else {1: width}
    # A hybrid model's conv and recurrent state, window layers' rings: slot
    # tensors (one slot a session; slot 0 is the engine's scratch), rows
    # addressed by slot_ids; passed by name.
    slots = module.slot_examples(1 + _EXAMPLE_ROWS, device)
    pool = Pool(tokens="input_ids", pages=("kv",), page_size=module.page_size, page_table="page_table",
                positions="positions", slots=tuple(slots), slot_ids="slot_ids" if slots else None)
    state = {"slot_ids": torch.arange(1, 1 + _EXAMPLE_ROWS, dtype=torch.int32, device=device), **slots} \
        if slots else {}
    state_shapes = {name: {0: rows if name == "slot_ids" else torch.export.Dim.DYNAMIC} for name in state}

    def shapes(tokens_dim: dict[int, Any], width_dim: dict[int, Any] | None) -> dict[str, Any]:
        return {"input_ids": tokens_dim, "kv": {0: pages}, "page_table": {0: rows, **(width_dim or {})},
                "positions": {0: rows}, **state_shapes}

    def table(n: int) -> torch.Tensor:
        t = torch.zeros(n, module.max_pages, dtype=torch.int32, device=device)
        t[:, 0] = torch.arange(2, 2 + n)
        return t

    kv = module.pool_example(2 + _EXAMPLE_ROWS, dtype, device)
    decode_configs = {**quantize_configs(quantize), **(inductor_configs or {})}
    found = {
        "prefill": Method((torch.zeros(_EXAMPLE_ROWS, example, dtype=torch.long, device=device), kv,
                           table(_EXAMPLE_ROWS), torch.zeros(_EXAMPLE_ROWS, dtype=torch.long, device=device)),
                          kwargs=state, dynamic_shapes=shapes({0: rows, 1: tokens}, prefill_width), entry="prefill",
                          attention=PREFILL_ATTENTION, pool=pool),
        "decode": Method((torch.zeros(_EXAMPLE_ROWS, 1, dtype=torch.long, device=device), kv, table(_EXAMPLE_ROWS),
                          torch.full((_EXAMPLE_ROWS,), example, dtype=torch.long, device=device)),
                         kwargs=state, dynamic_shapes=shapes({0: rows}, decode_width), entry="decode",
                         attention=DECODE_ATTENTION, pool=pool, inductor_configs=decode_configs),
    }
    if decode_one:
        if min_rows > 1 or slots:
            why = "keeps recurrent or ring state in slots" if slots else "traces for two rows at least"
            raise ExportError(f"decode_one=True: this model's decode {why}, so it is compiled for batches "
                              "alone; export with decode_one=False")
        # Layers on the one-row kernels (_one_row.py) need no tuning of Inductor's reductions (nor torchao's
        # settings for them); any other layer does.
        module.one_row = plan_one_row(module.model)
        tuning = dict(STEP_VALUES_ONCE) if module.one_row.complete else \
            {**STEP_VALUES_ONCE, **DECODE_ONE_CONFIGS, **quantize_configs(quantize)}
        found[DECODE_ONE] = Method((torch.zeros(1, 1, dtype=torch.long, device=device), kv, table(1),
                                    torch.full((1,), example, dtype=torch.long, device=device)),
                                   dynamic_shapes={"input_ids": {}, "kv": {0: pages}, "page_table": decode_width or {},
                                                   "positions": {}},
                                   entry=DECODE_ONE, attention=DECODE_ATTENTION, pool=pool,
                                   inductor_configs={**tuning, **(inductor_configs or {})})  # (the caller's last)
    return found
