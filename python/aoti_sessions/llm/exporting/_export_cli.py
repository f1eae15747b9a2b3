"""``aoti-sessions export MODEL_DIR -o PACKAGE.pt2``: :func:`aoti_sessions.llm.export` from the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# The defaults only: the exporter (and transformers) load when the command runs.
from .._spec import DEFAULT_MAX_BATCH, DEFAULT_PAGE_SIZE, QUANTIZATIONS

__all__ = ["add_arguments", "run"]


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


_at_least_two = _at_least(2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="folder save_pretrained wrote for a causal LM and its tokenizer, or a "
                                          "hub id (Qwen/Qwen3-0.6B: from the hub's cache, or fetched)")
    parser.add_argument("-o", "--output", required=True, help="package to write (.pt2)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--max-cache-len", type=_at_least_two, default=None,
                        help="KV cache positions per session (default: the model's context, at most 4096)")
    parser.add_argument("--max-prefill", type=_at_least_two, default=None,
                        help="most tokens per prefill call (default: min(512, max cache len))")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="weights and KV cache dtype (default: the model's)")
    parser.add_argument("--max-batch", type=_at_least(1), default=DEFAULT_MAX_BATCH,
                        help=f"sessions one decode step takes at most (default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--page-size", type=_at_least(1), default=DEFAULT_PAGE_SIZE,
                        help=f"positions per page of the pooled KV cache (default {DEFAULT_PAGE_SIZE})")
    parser.add_argument("--window-cache", choices=["ring", "full"], default="ring",
                        help="sliding-window layers: a ring of the window a session (default; rewinds only to a "
                             "turn's start, as recurrent state) or every position in pages")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                        help="weight-only quantization of the linear layers but the output head (torchao; int4wo: "
                             "CUDA and bfloat16 only); default: none")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="keep each layer's q/k/v and gate/up projections apart (default: one matrix multiply each)")
    parser.add_argument("--decode-one", action="store_true",
                        help="also compile decode for one row alone, which a lone chat's steps run (tuned one-row "
                             "kernels; CUDA; not for models with recurrent or ring state)")
    parser.add_argument("--verbose", action="store_true",
                        help="where export fails in the model's tracing or compiling, the whole traceback too")


def run(args: argparse.Namespace) -> int:
    """Exports; a bad input is one line on stderr and exit status 2."""
    from ...errors import Error, ExportError
    from ._export import export

    try:
        path = export(args.model_dir, args.output, device=args.device, max_cache_len=args.max_cache_len,
                      max_prefill=args.max_prefill, dtype=args.dtype, max_batch=args.max_batch,
                      page_size=args.page_size, window_cache=args.window_cache, fuse=args.fuse,
                      quantize=args.quantize, decode_one=args.decode_one)
    except (Error, ValueError, TypeError, OSError, ImportError) as e:
        if args.verbose and isinstance(e, ExportError) and e.details:
            sys.stderr.write(e.details)
        sys.stderr.write(f"aoti-sessions: error: {e}\n")
        return 2
    print(path)
    return 0
