"""What weight quantization alone does to a bench model's logits: torchao's
own quantization of every projection (int8wo's per-row int8, int4wo's
tinygemm groups of 128 with their scale and zero), dequantized, in an eager
float32 forward on the CPU, against the unquantized model, over
bench_decode's fixed prompt set and accuracy measures.

bench_decode's "<variant> against <ref> bf16" rows compare compiled
packages on the GPU; where this script's figures match them, the packages
compute what the quantization gives, and a low agreement is the
quantization's on that model, not a defect (stop 58: int4wo at the 4B slice).

    python bench/quant_accuracy.py [--shape 4b-slice] [--schemes int8wo,int4wo]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "tests")]
from bench_decode import ACCURACY_PROMPTS, ACCURACY_TOKENS, SHAPES, agreement  # noqa: E402
from bench_serve import bench_model, user_message  # noqa: E402

from aoti_sessions.llm.exporting import _quantize  # noqa: E402


def int8wo(w: torch.Tensor) -> torch.Tensor:
    """``w`` through torchao's int8 weight-only quantization and back."""
    from torchao.quantization import quantize_  # type: ignore[import-untyped]
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    linear.weight.data = w.clone()
    quantize_(linear, _quantize._config("int8wo", w.device))  # (export's own settings)
    return linear.weight.dequantize().to(w.dtype)


def int4wo(w: torch.Tensor) -> torch.Tensor:
    """``w`` through torchao's int4 weight-only quantization (the tile-packed
    format's: tinygemm's asymmetric groups) and back."""
    from torchao.quantization.quant_primitives import (  # type: ignore[import-untyped]
        MappingType, _choose_qparams_affine_tinygemm, _dequantize_affine_tinygemm, _quantize_affine_tinygemm)
    block = (1, _quantize.INT4_GROUP)
    scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15,
                                                  scale_dtype=w.dtype, zero_point_dtype=w.dtype)
    q = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    return _dequantize_affine_tinygemm(q, block, scale, zero, torch.int32, 0, 15, output_dtype=w.dtype)


SCHEMES = {"int8wo": int8wo, "int4wo": int4wo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4b-slice", choices=sorted(SHAPES))
    parser.add_argument("--schemes", default="int8wo,int4wo")
    args = parser.parse_args()
    model, tokenizer = bench_model("qwen3", {k: v for k, v in SHAPES[args.shape].items() if k != "dtype"})
    projections = [m for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
    bf16 = [m.weight.data.to(torch.bfloat16) for m in projections]  # the package's weights
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float()

    @torch.no_grad()
    def greedy(prompt: list[int]) -> list[int]:
        """``prompt`` and the unquantized model's argmax continuation (as bench_decode's reference
        continues: every id may come, the end of text too)."""
        out = model(torch.tensor([prompt]), use_cache=True)
        ids = [*prompt, int(out.logits[0, -1].argmax())]
        for _ in range(ACCURACY_TOKENS - 1):
            out = model(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
            ids.append(int(out.logits[0, -1].argmax()))
        return ids

    start = time.perf_counter()
    prompts = [tokenizer.encode(user_message(i, 0)) for i in range(ACCURACY_PROMPTS)]
    seqs = [greedy(p) for p in prompts]
    want = [logits(s)[len(p) - 1:-1] for p, s in zip(prompts, seqs)]
    print(f"# quant_accuracy: {args.shape}, torch {torch.__version__}, float32 forward on the CPU (bench_decode's "
          f"reference is the bf16 package on the GPU: its continuations may differ); the reference in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    for scheme in args.schemes.split(","):
        for m, w in zip(projections, bf16):
            m.weight.data = SCHEMES[scheme](w).float()
        agree, error = agreement(want, [logits(s)[len(p) - 1:-1] for p, s in zip(prompts, seqs)])
        print(f"| {args.shape} | {scheme}, eager, against the unquantized model | greedy agreement {agree:.1%}, "
              f"largest logit error {error:.1%} of the largest logit ({ACCURACY_PROMPTS} prompts x "
              f"{ACCURACY_TOKENS} positions) |", flush=True)
        for m, w in zip(projections, bf16):
            m.weight.data = w.float()


if __name__ == "__main__":
    main()
