"""Engine load time: creating an engine (and closing it) over one package,
repeated; the first save of a session after the load. One line each.

    python bench/bench_load.py PACKAGE [--device cpu] [--loads 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aoti_sessions as ais


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--json", help="also write the figures (seconds) to this file")
    args = parser.parse_args()
    ais.Engine(args.package, device=args.device).close()  # extraction and page cache warm
    loads, saves = [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.loads):
            start = time.perf_counter()
            engine = ais.Engine(args.package, device=args.device)
            loads.append(time.perf_counter() - start)
            with engine.new_session() as s:
                start = time.perf_counter()
                s.save(Path(folder) / "s.ais")
                saves.append(time.perf_counter() - start)
            engine.close()
    rows = {"engine load": statistics.median(loads), "first save after load": statistics.median(saves)}
    print(f"\nbench_load: {args.package} on {args.device}, {args.loads} loads")
    for name, seconds in rows.items():
        print(f"  {name:<36} {seconds * 1e3:10.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
