"""Host memory stays flat over many session switches (torch leaks a tensor
handle per constant per user-managed bind; the engine reclaims them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SWITCHES = 200_000

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import aoti_sessions as ais
    from aoti_sessions import _engine
    if sys.argv[2] == "off":
        _engine._torch_leaks_bind_handles = lambda: False
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    # One lane and no graphs: every switch binds.
    eng = ais.Engine(sys.argv[1], device=sys.argv[4], lanes=1, cuda_graphs=False)
    a, b = eng.new_session(), eng.new_session()
    x, slot = torch.ones(1, 8, device=sys.argv[4]), torch.tensor([0], device=sys.argv[4])
    def switch(n):
        for _ in range(n):
            a(x, slot)
            b(x, slot)
    switch(20_000)  # warm up allocator caches
    start = rss()
    switch(int(sys.argv[3]) // 2)
    print(rss() - start, eng.stats()["binds"])
    """
)


def _growth(package, mode: str, device: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(package), mode, str(SWITCHES), device],
                         capture_output=True, text=True, check=True)
    growth, binds = out.stdout.split()
    return int(growth), int(binds)


def test_rss_flat_over_200k_switches(counter_pkg, device: str) -> None:
    growth, binds = _growth(counter_pkg, "on", device)
    assert binds >= SWITCHES
    assert growth < 1 << 20, f"RSS grew {growth} bytes over {SWITCHES} switches"


def test_without_reclaim_this_torch_leaks(counter_cpu_pkg) -> None:
    """The leak the reclaim fixes is real on this torch (2 constants per bind, ~32 B
    each): if this fails, torch stopped leaking and the reclaim must be turned off
    for it, or it would double free."""
    growth, binds = _growth(counter_cpu_pkg, "off", "cpu")
    assert growth > 4 << 20, f"only {growth} bytes grew over {binds} binds without reclaim"
