"""``aoti-sessions serve PACKAGE --replicas N``: the real command, starting
its own local Ray cluster (after test_cluster's has stopped)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from llm_models import llm_package
from serving import wait_until

KEY = "cli-cluster-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _serve(package: Path, tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with (tmp_path / f"{name}.log").open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--replicas", "2",
                                    "--port", str(port), "--session-dir", str(tmp_path / "sessions"), "--threads",
                                    "1", "--max-sessions", "4", *extra],
                                   env={**os.environ, "AOTI_SESSIONS_API_KEY": KEY}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return process, port


def _up(process: subprocess.Popen[bytes], http: httpx.Client, log: Path) -> bool:
    assert process.poll() is None, log.read_text()
    try:
        return bool(http.get("/health").json().get("replicas") == 2)
    except (httpx.TransportError, ValueError):
        return False


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [cluster] extra (ray[serve]) is not installed")
def test_cli_replicas_serve_and_keep_sessions_across_restarts(tmp_path: Path) -> None:
    package = llm_package("qwen3", device="cpu", max_cache_len=512)
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0,
            "session_id": "cli"}
    reply = None
    for name, stop in (("first", signal.SIGINT), ("second", signal.SIGTERM)):
        process, port = _serve(package, tmp_path, name)
        log = tmp_path / f"{name}.log"
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=120) as http:
                wait_until(lambda: _up(process, http, log), timeout=240, what="the cluster to start")
                if reply is None:
                    reply = http.post("/v1/chat/completions", json=body).json()
                    assert reply["usage"]["completion_tokens"] <= 4, reply
                else:  # a new cluster on the same session dir: the chat goes on from its checkpoint
                    follow = {**body, "messages": [*body["messages"], reply["choices"][0]["message"],
                                                   {"role": "user", "content": "Go on"}]}
                    again = http.post("/v1/chat/completions", json=follow).json()
                    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
                assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == ["cli"]
                refused = http.get("/v1/models", headers={"Authorization": "Bearer no", "X-Request-Id": "cli-1"})
                assert refused.status_code == 401 and refused.headers.get_list("x-request-id") == ["cli-1"]
                made = http.get("/v1/models", headers={"X-Request-Id": "bad id"}).headers.get_list("x-request-id")
                assert len(made) == 1 and len(made[0]) == 32 and made[0] != "bad id", made
        finally:
            stopping = time.monotonic()
            os.killpg(process.pid, stop)  # (a terminal's Ctrl-C, kill -- -PGID: every process of the group)
            assert process.wait(120) == 0, log.read_text()
            took = time.monotonic() - stopping
        text = log.read_text()
        assert "2 replicas of" in text and "Traceback" not in text, text
        # The group's signal reached the command alone, which stopped Serve in order: its controller was
        # not killed with the group, so nobody waited 30 s for it (cluster/_supervise.py; 42-44 s before).
        assert "Controller failed to shut down" not in text and took < 30, (took, text[-3000:])
        assert (tmp_path / "sessions" / ".live" / "cli").is_file()


def test_cli_replicas_refusals(tmp_path: Path) -> None:
    package = llm_package("qwen3", device="cpu", max_cache_len=512)
    blocked = ("import sys; sys.modules['ray'] = None; from aoti_sessions.__main__ import main; "
               f"sys.exit(main(['serve', {str(package)!r}, '--replicas', '2']))")
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert result.returncode == 2 and "aoti-sessions[cluster]" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--replicas", "2",
                             "--ray-address", "auto"], capture_output=True, text=True)
    assert result.returncode == 2 and "--ray-address needs --session-dir" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--replicas", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "must be at least 1" in result.stderr, result.stderr
    if not torch.cuda.is_available():  # (on a GPU machine: more replicas than GPUs)
        result = subprocess.run([sys.executable, "-m", "aoti_sessions", "serve", str(package), "--replicas", "2",
                                 "--device", "cuda"], capture_output=True, text=True)
        assert result.returncode == 2 and "2 replicas need 2 GPUs (one each); this machine has 0" in result.stderr, \
            result.stderr


def test_the_cluster_process_stops_when_its_supervisor_dies(tmp_path: Path) -> None:
    """The process that runs a local cluster asks for SIGTERM when the one
    that started it (and forwards it the group's signals) ends, even by
    SIGKILL: it then stops Serve and Ray in order instead of living on."""
    marker = tmp_path / "stopped"
    child = ("import signal, sys, time; from aoti_sessions.cluster import _supervise; "
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(0))); "
             "_supervise.stop_with_parent(); print('ready', flush=True); time.sleep(60)")
    parent = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True); "
              "print(p.stdout.readline().strip(), p.pid, flush=True); time.sleep(60)")
    supervisor = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        said, pid = supervisor.stdout.readline().split()  # type: ignore[union-attr]
        assert said == "ready" and not marker.exists()
    finally:
        supervisor.kill()
        supervisor.wait()
        supervisor.stdout.close()  # type: ignore[union-attr]
    wait_until(marker.exists, timeout=20, what="the orphaned child to be told to stop")
    def ended() -> bool:
        try:
            return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()  # (ended, not reaped)
        except FileNotFoundError:
            return True

    wait_until(ended, timeout=20, what="the child to end")

