"""Session checkpoints across servers sharing a session dir (what a
cluster's replicas do, without Ray): every change is written in the
background, a server whose copy another server has moved past serves the
newer checkpoint, and a session deleted on one server is gone on the other."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import aoti_sessions as ais
from aoti_sessions.llm import LLM
from aoti_sessions.serve import create_app
from aoti_sessions.serve._checkpoints import CHECKPOINT_WRITERS
from llm_models import llm_package
from serving import metrics, running, wait_until

TOKENS = 8
TURNS = ["Hello, who are you?", "Tell me about the sea.", "And the mountains?", "Thanks, bye."]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(llm_package("qwen3", device="cpu", max_cache_len=512), "cpu", threads=1) as model:
        yield model


def turn(http: httpx.Client, messages: list[dict[str, str]], session: str) -> tuple[str, int]:
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": TOKENS,
                                                       "temperature": 0, "session_id": session})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_servers_sharing_a_session_dir_never_answer_from_a_stale_copy(llm: LLM, tmp_path: Path) -> None:
    reference: list[str] = []
    with running(create_app(llm)) as url, httpx.Client(base_url=url, timeout=60) as http:
        messages: list[dict[str, str]] = []
        for user in TURNS:
            messages.append({"role": "user", "content": user})
            reference.append(turn(http, messages, "ref")[0])
            messages.append({"role": "assistant", "content": reference[-1]})

    def written(path: Path, before: Any) -> bool:
        return path.is_file() and path.stat().st_mtime_ns != before

    checkpoint = tmp_path / ".live" / "c"
    with running(create_app(llm, session_dir=tmp_path, checkpoint_sessions=True)) as a_url, \
            running(create_app(llm, session_dir=tmp_path, checkpoint_sessions=True)) as b_url, \
            httpx.Client(base_url=a_url, timeout=60) as a, httpx.Client(base_url=b_url, timeout=60) as b:
        messages = []
        # Turns 1 and 2 on A, 3 on B, 4 on A again: each server serves the
        # newest checkpoint, its cache reused, the replies one server gives.
        for i, (server, user) in enumerate(zip((a, a, b, a), TURNS)):
            before = checkpoint.stat().st_mtime_ns if checkpoint.is_file() else None
            messages.append({"role": "user", "content": user})
            reply, cached = turn(server, messages, "c")
            assert reply == reference[i], i
            assert (cached > 0) == (i > 0), (i, cached)  # B and A again start from the other's checkpoint
            messages.append({"role": "assistant", "content": reply})
            wait_until(lambda: written(checkpoint, before), timeout=30, what="the checkpoint")
        seen_a, seen_b = metrics(a), metrics(b)
        assert seen_a["aoti_sessions_sessions_superseded_total"] == 1  # its copy after turn 2, dropped at turn 4
        assert seen_b["aoti_sessions_sessions_unparked_total"] == 1
        assert seen_a["aoti_sessions_checkpoints_total"] >= 2 and seen_b["aoti_sessions_checkpoints_total"] >= 1
        # Deleted on B: gone on A too (its copy dropped at A's next use, not brought back).
        assert b.delete("/v1/sessions/c").status_code == 200
        assert not checkpoint.exists()
        assert a.get("/v1/sessions/c").status_code == 404
        assert a.get("/v1/sessions").json()["data"] == []


def test_checkpoint_writes_hold_no_turn_and_run_a_few_at_a_time(llm: LLM, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A session is held by its checkpoint only while its state is copied
    out: its next turn goes ahead while the file is written (or waits for a
    writer), waiting for nothing; at most CHECKPOINT_WRITERS files are
    written at once; the files then hold each chat's latest turn."""
    gate, lock = threading.Event(), threading.Lock()
    inside, most = [0], [0]
    write = ais.Snapshot.write

    def gated(self: ais.Snapshot, path: object, attachment: bytes = b"") -> None:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            assert gate.wait(60), "the test never opened the gate"
            write(self, path, attachment)  # type: ignore[arg-type]
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(ais.Snapshot, "write", gated)
    n = CHECKPOINT_WRITERS + 2
    chats: dict[int, list[dict[str, str]]] = {i: [] for i in range(n)}

    def next_turn(http: httpx.Client, i: int, user: str) -> int:
        chats[i].append({"role": "user", "content": user})
        reply, cached = turn(http, chats[i], f"w{i}")
        chats[i].append({"role": "assistant", "content": reply})
        return cached

    with running(create_app(llm, session_dir=tmp_path, checkpoint_sessions=True)) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        try:
            for i in range(n):
                next_turn(http, i, TURNS[0])
            wait_until(lambda: inside[0] == CHECKPOINT_WRITERS, what="the writes at the gate")
            time.sleep(0.3)
            assert inside[0] == CHECKPOINT_WRITERS  # the other writes wait for a writer
            for i in (0, n - 1):  # (whichever waits at the gate or for a writer)
                assert next_turn(http, i, TURNS[1]) > 0  # answered from its cache, the write still under way
            assert inside[0] == CHECKPOINT_WRITERS
            assert metrics(http)["aoti_sessions_checkpoint_wait_seconds_total"] == 0
        finally:
            gate.set()
        wait_until(lambda: metrics(http)["aoti_sessions_checkpoints_total"] == n + 2, timeout=60,
                   what="every checkpoint")
        listed = {e["id"]: e["tokens"] for e in http.get("/v1/sessions").json()["data"]}
        for i in range(n):  # (read while the server runs: not what it parks when it stops)
            with llm.load_session(tmp_path / ".live" / f"w{i}") as loaded:
                assert len(loaded.tokens) == listed[f"w{i}"], i
    assert most[0] == CHECKPOINT_WRITERS
