"""Where a family's compiled package departs from its own rewrite run eagerly (a diagnostic, not a benchmark).

    python bench/diag_family.py minimax [--device cuda] [--dtype bfloat16] [--steps 8]
                                [--variants default,unfused,gather,precise] [--prompt TEXT]

For a test family (tests/llm_models.py's tiny random-weight model): each package variant is built (in
processes of their own, before this one touches the device; the tests' package cache): ``default``
(export as the tests do), ``unfused`` (``fuse=False``), ``gather`` (decode gathers pages instead of
running the paged attention kernel), ``precise`` (Inductor's ``emulate_precision_casts``). Each variant
then runs the prompt through the engine (prefill, then decode steps fed the package's own greedy
tokens; CUDA graphs on and off) and through ``LLM.generate`` (the scheduler's path), and the same
tokens go through the rewritten model eagerly (``llm/exporting/_paged.py``'s PagedLM, the export's context) and
through transformers in float32. Per step: the package's token, the eager rewrite's and float32's on
the same history, the largest logit difference of package against eager rewrite and of eager rewrite
against float32, and float32's logit gap for the package's token. A step where the package departs
from its eager rewrite by far more than the rewrite departs from float32 is a compile or engine fault,
not rounding (issue 37: MiniMax bf16 on CUDA).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {}, "unfused": {"fuse": False}, "gather": {"kernel": False},
    "precise": {"inductor": {"emulate_precision_casts": True}},
}


def build(job: tuple[str, str, str, str]) -> str:
    """The package of one variant (cached by the tests' cache where it is the tests' own)."""
    family, device, dtype, variant = job
    import conftest  # noqa: F401  (the tests' cache)
    import aoti_sessions.llm.exporting._paged as paged
    from aoti_sessions.llm.exporting import _export
    from llm_models import FAST, cached_package, hf_model_dir, llm_package

    options = VARIANTS[variant]
    if not options:
        return str(llm_package(family, device, dtype=dtype))

    def export(path: Path) -> None:
        if options.get("kernel") is False:
            class Gathering(paged.PagedLM):
                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    super().__init__(*args, **{**kwargs, "kernel": False})
            _export.PagedLM = Gathering  # type: ignore[misc]  (this process builds this one package)
        _export.export(hf_model_dir(family), path, device=device, max_cache_len=128, dtype=dtype,
                       inductor_configs={**FAST, **options.get("inductor", {})}, fuse=options.get("fuse", True))

    return str(cached_package(f"diag-{family}-{device}-{dtype}-{variant}", (family, device, dtype, variant), export))


def _engine_tokens(package: str, device: str, prompt: list[int], steps: int, graphs: bool) -> tuple[list[int], list[Any]]:
    """The package's greedy tokens through the engine alone, and the logits of each."""
    import torch
    import aoti_sessions as ais

    tokens, logits = [], []
    with ais.Engine(package, device=device, cuda_graphs=graphs) as engine, engine.new_session() as session:
        row = session.run("prefill", torch.tensor([prompt], device=device))[0].float().cpu()
        for _ in range(steps):
            logits.append(row)
            tokens.append(int(row.argmax()))
            row = session.run("decode", torch.tensor([[tokens[-1]]], device=device))[0].float().cpu()
    return tokens, logits


def _eager_logits(family: str, device: str, dtype: str, prompt: list[int], fed: list[int], variant: str) -> list[Any]:
    """The rewritten model, eagerly, fed ``prompt`` then ``fed`` a token at a time: each step's logits."""
    import torch
    import transformers
    from aoti_sessions.llm.exporting._export import _exportable, _grouped_mm_compiles, rewritten
    from aoti_sessions.llm.exporting._linear_attention import layers_traceable
    from aoti_sessions.llm.exporting._paged import PagedLM
    from llm_models import hf_model_dir

    dev, options = torch.device(device), VARIANTS[variant]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(family), local_files_only=True)
    grouped = _grouped_mm_compiles(dev)
    pages, width = 12, 8
    out = []
    with _exportable(model, dev, getattr(torch, dtype), restore=False):
        with layers_traceable(model, 64):
            module = PagedLM(model, 16, max_pages=width, kernel=options.get("kernel", dev.type == "cuda"),
                             grouped_mm=grouped)
        with rewritten(model, 64, options.get("fuse", True), None, grouped):
            kv = module.pool_example(pages, getattr(torch, dtype), dev)
            slots = module.slot_examples(3, dev)
            state = {"slot_ids": torch.tensor([1], dtype=torch.int32, device=dev), **slots} if slots else {}
            table = torch.arange(2, 2 + width, dtype=torch.int32, device=dev)[None]
            row = module.prefill(torch.tensor([prompt], device=dev), kv, table, torch.tensor([0], device=dev), **state)
            for i, token in enumerate(fed):
                out.append(row[0].float().cpu())
                row = module.decode(torch.tensor([[token]], device=dev), kv, table,
                                    torch.tensor([len(prompt) + i], device=dev), **state)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--prompt", default="The quick brown fox")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    jobs = [(args.family, args.device, args.dtype, v) for v in variants]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        packages = dict(zip(variants, pool.map(build, jobs)))

    import conftest  # noqa: F401
    import torch
    import transformers
    from aoti_sessions.llm import LLM
    from llm_models import hf_model_dir

    exact = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(args.family), local_files_only=True)
    exact = exact.to(args.device).eval()
    with LLM(packages[variants[0]], device=args.device) as llm:
        prompt = llm.encode(args.prompt)
    print(f"# {args.family} {args.dtype} on {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}); prompt {prompt}", flush=True)
    for variant, package in packages.items():
        with LLM(package, device=args.device) as llm:
            scheduled = llm.new_session().generate(prompt, max_tokens=args.steps, temperature=0,
                                                   ignore_eos=True).token_ids
        for graphs in ((True, False) if args.device == "cuda" else (False,)):
            tokens, logits = _engine_tokens(package, args.device, prompt, args.steps, graphs)
            eager = _eager_logits(args.family, args.device, args.dtype, prompt, tokens, variant)
            print(f"## {variant}, graphs {'on' if graphs else 'off'}: engine {tokens}, LLM.generate {scheduled}")
            for i, (mine, theirs) in enumerate(zip(logits, eager)):
                with torch.no_grad():
                    truth = exact(torch.tensor([prompt + tokens[:i]], device=args.device)).logits[0, -1].float().cpu()
                print(f"step {i}: package {int(mine.argmax())} eager {int(theirs.argmax())} f32 {int(truth.argmax())} | "
                      f"package-eager {float((mine - theirs).abs().max()):.3f} eager-f32 "
                      f"{float((theirs - truth).abs().max()):.3f} | f32 gap of the package's token "
                      f"{float(truth.max() - truth[int(mine.argmax())]):.3f}", flush=True)


if __name__ == "__main__":
    main()
