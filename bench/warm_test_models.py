"""Compiles the models the test suite uses most, for the given devices, in
parallel processes, into the cache the tests read (tests/conftest.py's): the
core's test models and, with --llm, the LLM packages of the families the run
tests (tests/llm_models.py tested(): AOTI_SESSIONS_ALL_FAMILIES=1 for all). A fresh
GPU machine has many cores and no cache: this turns the suite's sequential
compiles (a minute each) into about one minute overall. On a 2-CPU machine
two at a time still halve it: a compile is mostly one process (tracing, then
one C++ file a method). Models the tests build that are not listed here are
compiled by the tests as before.

    python bench/warm_test_models.py [--devices cpu cuda] [--jobs 8] [--llm]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


# The LLM packages the suite builds: each tested family's (tests/llm_models.llm_package),
# the qwen3 contexts of the server tests, the full window cache of test_llm_export.
LLM_VARIANTS: list[dict[str, object]] = [{"max_cache_len": 512}, {"max_cache_len": 256}]
WINDOW_FULL = ("mistral",)
# The longest compiles first (more layers, MoE experts, recurrent state), so
# that none starts last.
# (DeepSeek's and Ernie's compile twice: their compiled prefill takes two rows at least, found by export's check.)
SLOW_FIRST = ("deepseek_v3", "deepseek_v2", "qwen3_5_moe", "gemma3", "ernie4_5_moe", "qwen3_next", "gpt_oss", "zamba2",
              "jamba", "qwen3_moe", "falcon_h1", "lfm2", "mamba2", "llama4", "minimax")


def _compile_llm(arch: str, device: str, variant: dict[str, object]) -> str:
    import llm_models  # noqa: E402

    return f"llm {arch} {device} {variant}: {llm_models.llm_package(arch, device, **variant)}"  # type: ignore[arg-type]


def _compile(job: tuple[str, str] | tuple[str, str, dict[str, object]]) -> str:
    name, device = job[0], job[1]
    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: E402  (sets the test cache folder)
    if len(job) == 3:
        return _compile_llm(name, device, job[2])  # type: ignore[misc]
    import modeldefs  # noqa: E402
    from aoti_sessions.demo import compiled_decoder  # noqa: E402
    from aoti_sessions.models import SMALL  # noqa: E402

    fixtures = {
        "decoder": lambda: compiled_decoder(SMALL, device, progress=None),
        "prefill": lambda: compiled_decoder(SMALL, device, conftest.PREFILL, inductor_configs=conftest.FAST,
                                            progress=None),
        "decoder_methods": lambda: conftest.compiled_decoder_methods(device),
        "heads": lambda: conftest.compiled_heads(device),
    }
    for cls in (modeldefs.Counter, modeldefs.CounterTall, modeldefs.KwargsModel, modeldefs.CounterReseeded):
        fixtures[cls.__name__] = lambda cls=cls: conftest._compiled(cls, device)
    return f"{name} {device}: {fixtures[name]()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=["cpu"])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--llm", action="store_true", help="the LLM packages of the tested families too")
    args = parser.parse_args()
    names = ["decoder", "prefill", "decoder_methods", "heads", "Counter", "CounterTall", "KwargsModel",
             "CounterReseeded"]
    jobs: list[tuple[str, str] | tuple[str, str, dict[str, object]]] = []
    if args.llm:
        sys.path.insert(0, str(TESTS))
        from llm_models import tested  # noqa: E402

        families = sorted(tested(), key=lambda a: SLOW_FIRST.index(a) if a in SLOW_FIRST else len(SLOW_FIRST))
        for device in args.devices:
            jobs += [(arch, device, {}) for arch in families]
            jobs += [("qwen3", device, v) for v in LLM_VARIANTS]
            jobs += [(arch, device, {"window_cache": "full"}) for arch in tested(WINDOW_FULL)]
    jobs += [(n, d) for d in args.devices for n in names]
    with ProcessPoolExecutor(args.jobs) as pool:
        for line in pool.map(_compile, jobs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
