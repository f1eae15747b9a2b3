"""os.fork() while other threads use an engine (and its idle reaper runs): in
the child, the parent's engine and sessions raise OtherProcessError instead
of hanging on a lock a vanished thread held, exiting never hangs, and a new
engine made in the child works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

FORKS = 30

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time, torch
    import aoti_sessions as ais

    package, forks = sys.argv[1], int(sys.argv[2])
    engine = ais.Engine(package, idle_timeout=0.005)
    kept = engine.new_session()
    x, slot = torch.ones(1, 8), torch.tensor([1])
    stop = threading.Event()

    def hammer():
        # Every lock of the engine changes hands all the time: runs (session
        # and run locks), creates, forks and closes (registry), stats, the
        # idle reaper offloading the sessions left idle.
        while not stop.is_set():
            s = engine.new_session()
            s(x, slot)
            f = s.fork()
            engine.stats()
            f.close()
            s.close()
            kept.offload() if kept.resident else kept(x, slot)

    workers = [threading.Thread(target=hammer, daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    time.sleep(0.2)

    def child():
        outcome = {}
        for name, call in [("new_session", engine.new_session), ("run", lambda: kept(x, slot)),
                           ("stats", engine.stats), ("close", kept.close), ("engine.close", engine.close)]:
            try:
                call()
                outcome[name] = "no error"
            except ais.OtherProcessError:
                outcome[name] = "OtherProcessError"
            except BaseException as e:
                outcome[name] = type(e).__name__ + ": " + str(e)
        fresh = ais.Engine(package)  # a new engine serves the child
        with fresh.new_session() as s:
            s(x, slot)
            outcome["fresh"] = int(s.state()["hits"][1])
        print(json.dumps(outcome), flush=True)
        # Normal interpreter exit: every object of the parent's engine is
        # destroyed here, and must not wait on a lock.
        sys.exit(0)

    results = {"hangs": 0, "exits": [], "outcomes": []}
    for _ in range(forks):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)
            child()
        os.close(w)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                results["exits"].append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                results["hangs"] += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        with os.fdopen(r) as f:
            results["outcomes"].append(f.read().strip())
    stop.set()
    for w in workers:
        w.join()
    print(json.dumps(results))
""")


def test_fork_while_threads_use_the_engine(counter_cpu_pkg: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(counter_cpu_pkg), str(FORKS)],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results["hangs"] == 0, results
    assert results["exits"] == [0] * FORKS, results
    for line in results["outcomes"]:
        outcome = json.loads(line)
        assert outcome == {"new_session": "OtherProcessError", "run": "OtherProcessError",
                           "stats": "OtherProcessError", "close": "OtherProcessError",
                           "engine.close": "OtherProcessError", "fresh": 1}, outcome
