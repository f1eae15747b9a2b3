"""One chat's decode against the memory's speed (issue 38), CUDA.

    python bench/bench_decode.py [--shapes 0.6b,4b-slice] [--variants fused,unfused,int8wo,int4wo]
                                 [--rounds 3] [--tokens 128] [--anchor] [--hbm-tbs 4.8] [--only-built]

Per model shape (random weights, bf16) and export variant (``fused``: the
default export, q/k/v and gate/up each one projection; ``unfused``: export's
``fuse=False``, the model's projections as they are; ``int8wo``, ``int4wo``:
the default export with weight-only quantization; ``autotune``: the default
export with Inductor's max-autotune and coordinate-descent tuning), in this
one process
and call: one chat streaming ``--tokens`` greedy tokens (``ChatSession.stream``,
decode captured as CUDA graphs): ms a token (the median gap between tokens
after the first), device ms a decode step and kernels a step
(torch.profiler's kernel time and count over a turn of ``--tokens`` less
those over a turn of 1, divided by the decode steps), the HBM roofline of a
step (the package's weight bytes and the KV cache read at the turn's middle
position, at ``--hbm-tbs`` TB/s: the card's, by its name, where not given)
and the share of it each time reaches. ``--anchor``: transformers' compiled
``generate`` at B = 1 on each shape's model (static cache, torch.compile
reduce-overhead: bench_serve's anchor), in a process of its own. And a
decode step of ``--rows`` sessions (the engine's batched decode alone,
captured: bench_pool's step time), so a variant that speeds one chat can be
seen not to slow a full batch.
A variant exported with ``decode_one`` (``one``, ``int8wo-one``,
``int4wo-one``) is measured twice from its one package: as it serves a lone
chat (its ``decode_one``) and, in the row ``<variant>, decode at B = 1``,
with the LLM's ``decode_one=False`` (its batched ``decode`` at one row, what
a package without ``decode_one`` runs): both paths' figures from one compile.
Rounds: each variant measured ``--rounds`` times, interleaved; min / median / max.
Quantized variants' accuracy against ``fused`` (bf16): over 8 fixed prompts,
``fused``'s greedy continuation of 32 tokens fed to both, position by
position: the share of positions where their greedy tokens agree, and the
largest logit error relative to the largest logit. A decode_one package's
steps are also compared with its own batched ``decode`` on the same tokens
(row ``<variant>: decode_one against its decode``): where the two part, the
one-row path is at fault, not the quantization.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pool import step_times  # noqa: E402
from bench_serve import bench_package, model_folder, run_anchor, user_message  # noqa: E402

from aoti_sessions.llm import LLM  # noqa: E402

# The shapes of issue 38 (random weights; the tokenizer and vocabulary are bench_serve's tiny Qwen3's).
SHAPES: dict[str, dict[str, object]] = {
    "0.6b": dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "4b-slice": dict(num_hidden_layers=12, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "4b": dict(num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}
VARIANTS: dict[str, dict[str, object]] = {
    "fused": {}, "unfused": {"fuse": False}, "int8wo": {"quantize": "int8wo"}, "int4wo": {"quantize": "int4wo"},
    # With export's decode_one: a lone chat's step on its own one-row method (the one-row kernels, _one_row.py).
    # The quantized ones' batched decode without torchao's tuning (_quantize.inductor_configs), which took minutes a
    # package on the GPU machine: their rows "decode at B = 1" and of --rows sessions are an untuned decode's (the
    # int8wo and int4wo variants' are tuned); their decode_one is not tuned by Inductor either way.
    "one": {"decode_one": True},
    "int8wo-one": {"quantize": "int8wo", "decode_one": True, "inductor_configs": {"coordinate_descent_tuning": False}},
    "int4wo-one": {"quantize": "int4wo", "decode_one": True, "inductor_configs": {"coordinate_descent_tuning": False}},
    # Inductor autotuning its matmul and pointwise kernels for the traced shapes (slow to compile: opt-in).
    "autotune": {"inductor_configs": {"max_autotune": True, "coordinate_descent_tuning": True}},
}
# Every variant's host wrapper compiled at -O0 (as the tests' packages): minutes less a package on the GPU machine,
# nothing lost here, where every decode step (one chat's and the 64 rows') replays a CUDA graph.
QUICK_WRAPPER = {"aot_inductor.compile_wrapper_opt_level": "O0"}
for _variant in VARIANTS.values():
    _variant["inductor_configs"] = {**QUICK_WRAPPER, **dict(_variant.get("inductor_configs") or {})}  # type: ignore[call-overload]
ACCURACY_PROMPTS = 8
ACCURACY_TOKENS = 32
# HBM bandwidth by the card's name, TB/s (vendors' figures).
HBM_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


@dataclass
class Round:
    ms_a_token: float
    device_ms: float
    kernels: float
    batch_ms: float = 0.0  # a decode step of --rows sessions
    step: dict[str, tuple[float, float]] = field(default_factory=dict)  # kernel name: (launches, us) a step


def one_chat_rounds(llm: LLM, tokens: int, rounds: int) -> list[Round]:
    """``rounds`` measurements of one chat on ``llm`` (see the module's doc)."""
    from torch.profiler import ProfilerActivity, profile

    prompt = [{"role": "user", "content": user_message(0, 0)}]
    chat = llm.new_session()

    def stream(n: int) -> list[float]:
        chat.reset()
        times = []
        for _ in chat.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
            times.append(time.perf_counter())
        return times

    def kernel_ms(n: int) -> tuple[float, int, dict[str, list[float]]]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            stream(n)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            seen = by_name.setdefault(e.name, [0, 0.0])
            seen[0] += 1
            seen[1] += e.time_range.elapsed_us()
        return sum(e.time_range.elapsed_us() for e in kernels) / 1e3, len(kernels), by_name

    stream(tokens)  # warm: graphs captured, allocations made
    out = []
    for _ in range(rounds):
        times = stream(tokens)
        gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))  # (the first token's: prefill's)
        whole, count, names = kernel_ms(tokens)
        first, count1, names1 = kernel_ms(1)
        device = (whole - first) / (tokens - 1)
        if count == count1 or device <= 0:
            raise SystemExit(f"torch.profiler saw no decode kernels ({count} and {count1} kernel events)")
        step = {name: ((n - names1.get(name, [0, 0.0])[0]) / (tokens - 1),
                       (us - names1.get(name, [0, 0.0])[1]) / (tokens - 1)) for name, (n, us) in names.items()}
        out.append(Round(1e3 * statistics.median(gaps), device, (count - count1) / (tokens - 1), step=step))
    return out


def kernel_table(shape: str, variant: str, step: dict[str, tuple[float, float]], top: int) -> str:
    """A decode step's ``top`` kernels by device time: launches and us a step (one round's)."""
    rows = sorted(step.items(), key=lambda item: -item[1][1])[:top]
    lines = [f"#### {shape} {variant}: a decode step's kernels by device time (launches, us a step)"]
    lines += [f"- {us:7.1f} us  {n:5.1f}x  {name[:150]}" for name, (n, us) in rows if n > 0]
    return "\n".join(lines)


def step_bytes(llm: LLM, size: dict[str, object], position: int) -> int:
    """What a decode step must read at least: every weight once, and the KV
    cache of ``position`` positions (keys and values of every layer of the
    shape ``size``, in the package's dtype)."""
    weights = sum(int(w["bytes"]) for w in llm.engine.weights())
    width = torch.finfo(getattr(torch, llm.spec.dtype)).bits // 8
    per_position = 2 * int(size["num_hidden_layers"]) * int(size["num_key_value_heads"]) * int(size["head_dim"])
    return weights + per_position * position * width


def _teacher_forced(package: Path, prompts: list[list[int]], continuations: list[list[int]] | None,
                    batched: bool = False) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt prefilled, then its continuation fed a token at a time
    (None: the package's own greedy tokens): the tokens fed and every
    position's logits (float32, on the host). Decoded as a lone chat is
    (``decode_one`` where the package has it), or on ``decode`` (``batched``)."""
    fed, logits = [], []
    with LLM(package, device="cuda") as llm:
        decode = "decode_one" if "decode_one" in llm.engine.methods and not batched else "decode"
        for i, prompt in enumerate(prompts):
            with llm.engine.new_session() as session:
                rows = [session.run("prefill", torch.tensor([prompt], device="cuda"))[0].float().cpu()]
                tokens: list[int] = []
                for step in range(ACCURACY_TOKENS):
                    tokens.append(int(rows[-1].argmax()) if continuations is None else continuations[i][step])
                    rows.append(session.run(decode, torch.tensor([[tokens[-1]]], device="cuda"))[0].float().cpu())
                fed.append(tokens)
                logits.append(torch.stack(rows[:-1]))
    return fed, logits


def reference_logits(reference: Path) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """The fixed prompts, ``reference``'s greedy continuations of them and its logits at every position."""
    with LLM(reference, device="cuda") as llm:
        prompts = [llm.encode(user_message(i, 0)) for i in range(ACCURACY_PROMPTS)]
    tokens, want = _teacher_forced(reference, prompts, None)
    return prompts, tokens, want


def agreement(want: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(greedy agreement, largest logit error / largest logit) of ``got``'s logits against ``want``'s."""
    agree = sum(int((w.argmax(-1) == g.argmax(-1)).sum()) for w, g in zip(want, got)) / sum(len(w) for w in want)
    error = max(float((w - g).abs().max() / w.abs().max()) for w, g in zip(want, got))
    return agree, error


def spread(values: list[float], digits: int = 3) -> str:
    s = sorted(values)
    return f"{s[0]:.{digits}f} / {statistics.median(s):.{digits}f} / {s[-1]:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="0.6b,4b-slice")
    parser.add_argument("--variants", default="fused,unfused")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--anchor", action="store_true")
    parser.add_argument("--hbm-tbs", type=float, default=None)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--kernels", type=int, default=0, help="list each variant's N costliest kernels a step")
    parser.add_argument("--only-built", action="store_true",
                        help="measure only the variants whose packages are built (the others are named, not compiled)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode measures CUDA decode steps: no CUDA device here")
    name = torch.cuda.get_device_name()
    hbm = args.hbm_tbs or next((tbs for card, tbs in HBM_TBS.items() if card in name), None)
    if hbm is None:
        raise SystemExit(f"no HBM bandwidth known for {name}: give --hbm-tbs")
    print(f"# bench_decode: {name}, HBM {hbm} TB/s, torch {torch.__version__}; {args.tokens} tokens a turn, "
          f"{args.rounds} rounds", flush=True)
    print("| shape | variant | ms a token | device ms a step | kernels a step | kernels a layer | roofline ms | "
          f"share (wall) | share (device) | tokens/s | ms a step of {args.rows} rows |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for shape in args.shapes.split(","):
        size = SHAPES[shape]
        results: dict[str, list[Round]] = {}
        roofline = {}
        packages = {}
        for v in args.variants.split(","):
            try:
                packages[v] = bench_package("cuda", dtype="bfloat16", build=not args.only_built, **VARIANTS[v], **size)
            except FileNotFoundError as e:
                print(f"| {shape} | {v} | not measured: {e} |", flush=True)
        if not packages:
            continue
        # A decode_one package's batched decode at one row too, beside its decode_one (see the module's doc).
        runs = [(v, p, True) for v, p in packages.items()] + \
               [(f"{v}, decode at B = 1", p, False) for v, p in packages.items() if VARIANTS[v].get("decode_one")]
        for turn in range(args.rounds):  # variants interleaved round by round: drift hits them alike
            for variant, package, decode_one in list(runs):
                try:
                    with LLM(package, device="cuda", max_sessions=args.rows + 1, decode_one=decode_one) as llm:
                        one = one_chat_rounds(llm, args.tokens, 1)[0]
                        one.batch_ms = step_times(llm.engine, llm.spec, args.rows, 1, "cuda")[0]
                        roofline[variant] = step_bytes(llm, size, args.tokens // 2) / (hbm * 1e12) * 1e3
                except Exception as e:  # noqa: BLE001 - named in the table; the other variants go on
                    print(f"| {shape} | {variant} | failed: {str(e).splitlines()[0][:300] if str(e) else repr(e)} |",
                          flush=True)
                    runs.remove((variant, package, decode_one))
                    results.pop(variant, None)
                    continue
                results.setdefault(variant, []).append(one)
                # Each round as it ends (a call cut short keeps what it measured), on stderr: not the table's.
                print(f"round {turn + 1}: {shape} {variant}: {one.ms_a_token:.3f} ms a token, {one.device_ms:.3f} "
                      f"device ms, {one.kernels:.0f} kernels, {one.batch_ms:.3f} ms a step of {args.rows} rows",
                      file=sys.stderr, flush=True)
        for variant, rounds in results.items():
            ms = [r.ms_a_token for r in rounds]
            dev = [r.device_ms for r in rounds]
            kernels = statistics.median(r.kernels for r in rounds)
            roof = roofline[variant]
            print(f"| {shape} | {variant} | {spread(ms)} | {spread(dev)} | {kernels:.0f} | "
                  f"{kernels / int(size['num_hidden_layers']):.1f} | {roof:.3f} | "
                  f"{roof / statistics.median(ms):.0%} | {roof / statistics.median(dev):.0%} | "
                  f"{1e3 / statistics.median(ms):,.0f} | {spread([r.batch_ms for r in rounds])} |", flush=True)
        if args.kernels:
            for variant, rounds in results.items():
                print(kernel_table(shape, variant, rounds[0].step, args.kernels), flush=True)
        reference = next((v for v in ("fused", "one") if v in packages), None)  # bf16's
        quantized = [v for v in packages if v.startswith("int")]
        if reference is not None and quantized:
            try:
                prompts, tokens, want = reference_logits(packages[reference])
            except Exception as e:  # noqa: BLE001 - named in the table
                print(f"| {shape} | {reference} bf16's logits | failed: {str(e).splitlines()[0][:300]} |", flush=True)
                quantized = []
            for variant in quantized:
                # Its decode_one's logits (what a lone chat runs) against bf16's, then against its own batched
                # decode's on the same tokens (a decode_one package): where those part, the one-row path is at fault.
                cases = [(f"{variant} against {reference} bf16", False)]
                cases += [(f"{variant}: decode_one against its decode", True)] * variant.endswith("-one")
                got: list[torch.Tensor] | None = None
                for label, own in cases:
                    try:
                        got = got or _teacher_forced(packages[variant], prompts, tokens)[1]
                        base = _teacher_forced(packages[variant], prompts, tokens, batched=True)[1] if own else want
                        agree, error = agreement(base, got)
                    except Exception as e:  # noqa: BLE001 - named in the table
                        print(f"| {shape} | {label} | failed: {str(e).splitlines()[0][:300]} |", flush=True)
                        continue
                    print(f"| {shape} | {label} | greedy agreement {agree:.1%}, largest logit error {error:.1%} of "
                          f"the largest logit ({ACCURACY_PROMPTS} prompts x {ACCURACY_TOKENS} positions) |",
                          flush=True)
        if args.anchor:
            anchor = run_anchor(model_folder(next(iter(packages.values()))), "cuda", 1, args.rounds)
            if anchor.error:
                print(f"| {shape} | transformers compiled, B = 1 | {anchor.error} |", flush=True)
            else:
                print(f"| {shape} | transformers compiled, B = 1 | {spread([1e3 / r for r in anchor.rates])} | | | | | "
                      f"| | {statistics.median(anchor.rates):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
