"""The README and the guide under docs/ hold together: every relative link
reaches a file (and, into a Markdown file, a heading of it), and every
command a shell block shows exists: scripts/run's jobs, aoti-sessions'
subcommands and the options given to them, the repository's own files."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Tools the pages tell a reader to have (installed beside Python), not the repository's.
EXTERNAL = {"pip", "curl", "ray"}
SHELLS = {"bash", "sh", "shell", "console"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _blocks(page: Path) -> list[tuple[str, list[str]]]:
    """Each fenced block of ``page``: its language and lines."""
    out: list[tuple[str, list[str]]] = []
    lang: str | None = None
    for line in page.read_text().split("\n"):
        fence = re.match(r"^```(\w*)", line)
        if fence:
            if lang is None:
                lang = fence.group(1) or "text"
                out.append((lang, []))
            else:
                lang = None
        elif lang is not None:
            out[-1][1].append(line)
    return out


def _prose(page: Path) -> str:
    """``page`` without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


@cache
def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(page).split("\n") if re.match(r"^#{1,6} ", line)}


def test_every_page_is_reached_from_the_guide_index() -> None:
    index = _prose(ROOT / "docs" / "README.md")
    linked = {target.partition("#")[0] for target in LINK.findall(index)}
    missing = [p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in linked]
    assert not missing, f"docs/README.md links no page {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_their_files_and_headings(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading '{anchor}' in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def _commands(page: Path) -> list[list[str]]:
    """The commands of ``page``'s shell blocks, each as its words (a line
    continued with a backslash joined to it; comments, options in brackets
    and leading VAR=value assignments dropped)."""
    out: list[list[str]] = []
    for lang, lines in _blocks(page):
        if lang not in SHELLS:
            continue
        text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
        for line in text.split("\n"):
            words = line.split("#", 1)[0].split() if not line.lstrip().startswith("#") else []
            while words and re.match(r"^\w+=", words[0]):
                words.pop(0)
            if words:
                out.append(words)
    return out


@cache
def _help(command: str) -> str:
    done = subprocess.run([sys.executable, "-m", "aoti_sessions", command, "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"aoti-sessions {command} --help failed: {done.stderr[-2000:]}"
    return done.stdout


def _jobs() -> set[str]:
    usage = re.search(r"usage: scripts/run ([\w|]+)", (ROOT / "scripts" / "run").read_text())
    assert usage is not None
    return set(usage.group(1).split("|"))


@pytest.mark.parametrize("page", [p for p in PAGES if any(lang in SHELLS for lang, _ in _blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_blocks_commands_exist(page: Path) -> None:
    wrong = []
    for words in _commands(page):
        head = words[0]
        sub = words[1] if len(words) > 1 else ""
        if head == "scripts/run":
            if sub not in _jobs():
                wrong.append(f"scripts/run has no job '{sub}'")
                continue
        elif head == "aoti-sessions":
            pass
        elif "/" in head:
            if not (ROOT / head).is_file():
                wrong.append(f"no file {head}")
            continue
        elif head not in EXTERNAL and shutil.which(head) is None:
            wrong.append(f"no command {head}")
            continue
        if head == "scripts/run" and sub == "cluster":
            sub = "serve"  # (scripts/run cluster is serve with the cluster extra)
        if head in ("scripts/run", "aoti-sessions") and sub in ("export", "serve", "info", "demo"):
            text = _help(sub)
            wrong += [f"aoti-sessions {sub} has no option {w}" for w in (w.strip("[]").split("=")[0] for w in words)
                      if w.startswith("--") and not re.search(rf"{re.escape(w)}(?![\w-])", text)]
    assert not wrong, f"{page.relative_to(ROOT)}: {wrong}"


def test_every_results_file_is_indexed() -> None:
    """docs/benchmarks.md lists every results file under bench/results/."""
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(_prose(ROOT / "docs" / "benchmarks.md"))
              if "bench/results/" in t}
    missing = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.md") if p.name not in linked)
    assert not missing, f"docs/benchmarks.md does not list {missing}"


def test_plots_are_what_their_results_draw() -> None:
    """docs/plots/ holds what bench/plots.py draws from the results files now
    (a results file changed and its plot not redrawn fails), and the guide
    shows each plot."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "plots.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    shown = {Path(t).name for t in LINK.findall(_prose(ROOT / "docs" / "benchmarks.md")) if "plots/" in t}
    drawn = {p.name for p in (ROOT / "docs" / "plots").glob("*.svg")}
    assert drawn and drawn <= shown, f"docs/benchmarks.md does not show {sorted(drawn - shown)}"
