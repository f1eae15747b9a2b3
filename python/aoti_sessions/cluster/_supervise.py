"""A local cluster's command as two processes, so that a signal to its
process group stops it in order.

A terminal's Ctrl-C, or ``kill -- -PGID``, signals every process of the
command's group, and the Ray processes a local cluster starts are in it: Serve's
controller and the replicas would die at once, and the command's shutdown would
wait 30 s for the controller (docs/limits.md). So the command runs again in a
session of its own, where it starts the cluster, and the first process stays
in the caller's group and forwards SIGINT, SIGTERM and SIGHUP to that process
alone, which stops Serve (every replica parking its sessions) and then Ray. The
second process is told to stop (SIGTERM) should the first one die.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

CHILD_ENV = "AOTI_SESSIONS_CLUSTER_CHILD"  # set in the process that runs the cluster
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def in_child() -> bool:
    """Whether this process is the one that runs the cluster (started by :func:`supervised`)."""
    return os.environ.get(CHILD_ENV) == "1"


def supervised(argv: list[str]) -> int:
    """Runs ``aoti-sessions ARGV`` in a session of its own and forwards the
    signals above to it until it ends; its exit status."""
    child = subprocess.Popen([sys.executable, "-m", "aoti_sessions", *argv], env={**os.environ, CHILD_ENV: "1"},
                             start_new_session=True)

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:  # (a hangup stops it as SIGTERM does: Serve's own handlers are for those two)
            child.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        return child.wait()  # (a signal runs its handler, then the wait goes on)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_with_parent() -> None:
    """In the cluster's process: SIGTERM when the process that started it
    ends (Linux; elsewhere nothing). Its main thread made the child and
    waits for it, so the signal comes only when that process is gone."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1:  # (it ended before the call: nobody to stop with)
        os.kill(os.getpid(), signal.SIGTERM)
