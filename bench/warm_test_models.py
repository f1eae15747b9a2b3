"""Compiles every model the test suite uses, for the given devices, in parallel
processes, into the cache the tests read (tests/conftest.py's). A fresh GPU
machine has many cores and no cache: this turns the suite's sequential
compiles (a minute each) into about one minute overall.

    python bench/warm_test_models.py [--devices cpu cuda] [--jobs 8]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _compile(job: tuple[str, str]) -> str:
    name, device = job
    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: E402  (sets the test cache folder)
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
    args = parser.parse_args()
    names = ["decoder", "prefill", "decoder_methods", "heads", "Counter", "CounterTall", "KwargsModel",
             "CounterReseeded"]
    jobs = [(n, d) for d in args.devices for n in names]
    with ProcessPoolExecutor(args.jobs) as pool:
        for line in pool.map(_compile, jobs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
