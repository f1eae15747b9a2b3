"""The benchmark plots in docs/plots/, drawn from the results files (bench/results/), so a figure
is never typed twice:

    python bench/plots.py [--check]

- ``serve_cuda.svg``: generated tokens/s against concurrent chats, the server (sessions) and
  transformers' compiled ``generate`` at B = chats (bench/results/serve_cuda.md);
- ``decode_cuda.svg``: ms a token against the HBM roofline, per model shape and export variant
  (bench/results/decode_cuda.md: the wall's and the device's median, the roofline).

``--check``: exits 1, naming them, where a plot differs from what the results draw (a results file
changed and its plot was not redrawn). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS, PLOTS = ROOT / "bench" / "results", ROOT / "docs" / "plots"


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in ``text``: its rows (the header first), cells stripped."""
    out: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            out.append(rows)
            rows = []
    return out


def table(path: Path, *header: str) -> list[dict[str, str]]:
    """The first table of ``path`` whose header starts with ``header``, as dicts."""
    for rows in tables(path.read_text()):
        if tuple(rows[0][:len(header)]) == header:
            return [dict(zip(rows[0], r)) for r in rows[1:]]
    raise SystemExit(f"{path.relative_to(ROOT)}: no table whose header starts {' | '.join(header)}")


def number(cell: str) -> float:
    """The first number of a cell (a median before its ``(min / max)``, or the ``min / median / max``'s middle)."""
    found = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell.replace(",", ""))]
    return found[1] if re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+", cell) else found[0]


def serve_plot(plt: object) -> object:
    ours = [r for r in table(RESULTS / "serve_cuda.md", "chats", "mode") if r["mode"] == "sessions"]
    anchor = table(RESULTS / "serve_cuda.md", "B", "generated tokens/s: median (min / max)")
    fig, ax = plt.subplots(figsize=(6, 4))  # type: ignore[attr-defined]
    for rows, key, what, label in ((ours, "chats", "generated tokens/s: median (min / max)", "aoti-sessions serve"),
                                   (anchor, "B", "generated tokens/s: median (min / max)",
                                    "transformers generate (compiled, B = chats)")):
        xs, ys = [number(r[key]) for r in rows], [number(r[what]) for r in rows]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent chats")
    ax.set_ylabel("generated tokens/s (median)")
    ax.set_title("Chat serving, H200 (bench/results/serve_cuda.md)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def decode_plot(plt: object) -> object:
    rows = table(RESULTS / "decode_cuda.md", "shape", "variant", "ms a token")
    rows = [r for r in rows if "not measured" not in r["ms a token"]]
    # ("transformers compiled, B = 1" cut at its comma; a decode_one package's batched decode named so)
    labels = [f"{r['shape']} {r['variant'].replace(', decode at B = 1', ' (batched)').split(',')[0]}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.5 * len(rows)))  # type: ignore[attr-defined]
    at = range(len(rows))
    for offset, key, label in ((-0.25, "ms a token", "ms a token (wall)"), (0.0, "device ms a step", "device ms a step"),
                               (0.25, "roofline ms", "HBM roofline")):
        drawn_at = [i for i in at if rows[i][key]]  # (an anchor's row has the wall's time alone)
        ax.barh([i + offset for i in drawn_at], [number(rows[i][key]) for i in drawn_at], height=0.25, label=label)
    ax.set_yticks(list(at), labels)
    ax.set_xscale("log")  # (an int8 batched step of 14 ms beside the others' 0.2-2)
    ax.set_xlabel("ms a decode step, one chat (median, log scale)")
    ax.set_title("One chat's decode against the roofline, H200 (bench/results/decode_cuda.md)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


PLOTTED = {"serve_cuda.svg": serve_plot, "decode_cuda.svg": decode_plot}


def drawn(plot: object) -> bytes:
    """The plot's SVG, the same bytes for the same figures (no date, fixed ids)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "aoti-sessions"
    fig = plot(plt)  # type: ignore[operator]
    out = io.BytesIO()
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a plot is not what its results draw")
    args = parser.parse_args()
    stale = []
    for name, plot in PLOTTED.items():
        svg = drawn(plot)
        path = PLOTS / name
        if args.check:
            if not path.is_file() or path.read_bytes() != svg:
                stale.append(str(path.relative_to(ROOT)))
        else:
            PLOTS.mkdir(parents=True, exist_ok=True)
            path.write_bytes(svg)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"not what their results draw: {', '.join(stale)} (python bench/plots.py redraws them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
