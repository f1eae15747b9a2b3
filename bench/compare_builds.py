"""A benchmark on two builds of aoti-sessions, in one run, one table.

Builds the package at an old commit and from the working tree into separate
folders (build/compare/), then runs a benchmark of this checkout
(bench/bench_switch.py by default; any that takes --device and --json)
against each in alternating rounds, a fresh process per round, so drift on a
noisy machine hits both alike. Prints per configuration the old and new
figures (min / median / max over rounds) and new / old.

    python bench/compare_builds.py --old 59040ae [--rounds 6] [--device cpu] \
        [--bench bench_load.py] [-- BENCH ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _install(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                    "--target", str(target), str(source)], check=True)


def _build(old: str, work: Path) -> dict[str, Path]:
    source = work / "old-src"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", old], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    sites = {"old": work / "old-site", "new": work / "new-site"}
    _install(source, sites["old"])
    _install(ROOT, sites["new"])
    return sites


def _round(bench: str, site: Path, device: str, args: list[str]) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--device", device, "--json",
                        out.name, *args], check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
        return dict(json.load(open(out.name)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="commit of the old build")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bench", default="bench_switch.py", help="a script in bench/")
    parser.add_argument("--unit", choices=("us", "ms"), default="us")
    parser.add_argument("bench_args", nargs="*", help="passed to the benchmark (after --)")
    args = parser.parse_args()
    sites = _build(args.old, ROOT / "build" / "compare")
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            results[which].append(_round(args.bench, sites[which], args.device, args.bench_args))
    rows = list(results["new"][0])
    scale = 1e6 if args.unit == "us" else 1e3
    print(f"\ncompare_builds: {args.bench}, old = {args.old}, new = working tree, {args.device}, "
          f"{args.rounds} alternating rounds (a process each); {args.unit}, min / median / max over rounds")
    print(f"  {'configuration':<36} {'old':>26} {'new':>26} {'new/old':>8}")
    for name in rows:
        cells = []
        for which in ("old", "new"):
            v = sorted(x[name] * scale for x in results[which])
            cells.append((v[0], statistics.median(v), v[-1]))
        ratio = cells[1][1] / cells[0][1] if cells[0][1] else float("nan")
        fmt = [f"{a:7.2f} /{b:7.2f} /{c:7.2f}" for a, b, c in cells]
        print(f"  {name:<36} {fmt[0]:>26} {fmt[1]:>26} {ratio:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
