"""The session dir under pressure (issue 34, items 5 and 6): a full disk
loses no session (a park that fails keeps the session in memory, retried
later, logged once), a save finding it full is a 507 that says so; each key's
saved files are bounded and can be listed and deleted; a fork or a load never
replaces a parked session. A real uvicorn server over the tiny Qwen3 package
on the CPU."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aoti_sessions import _session
from aoti_sessions.errors import SessionFileError
from aoti_sessions.llm import LLM
from aoti_sessions.serve import create_app
from llm_models import llm_package
from serving import FRONT_ENDS, client, metrics, open_served, running, serving, wait_until

KEY_A, KEY_B = "files-a-5e1d", "files-b-9a0c"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with open_served(llm_package("qwen3", max_cache_len=256), max_sessions=8) as model:
        yield model


@pytest.fixture(scope="module")
def local(llm: LLM) -> Iterator[LLM]:
    """An LLM in this process, for tests that patch the runtime here (its
    session writes): ``llm``, unless that one runs in an engine process."""
    if FRONT_ENDS == 1:
        yield llm
        return
    with LLM(llm_package("qwen3", max_cache_len=256), threads=1, max_sessions=8) as model:
        yield model


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """A POST, sent again while its session is busy (409): the sweep holds a
    session while it tries to park it."""
    for _ in range(100):
        response = http.post(path, json=body)
        if response.status_code != 409:
            break
        time.sleep(0.01)
    return response


def _chat(http: httpx.Client, session: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = _post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0,
                                                    "session_id": session})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.json()["error"]["code"] == code, response.text
    return str(response.json()["error"]["message"])


@pytest.fixture(params=["tmpfs", "simulated"])
def full_disk(request: pytest.FixtureRequest, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Callable[[bool], None], bool]]:
    """A session dir, a switch that fills it (True) or makes room again
    (False), and whether the fill is simulated in this process: a real 256
    KiB tmpfs filled by a file (mounting one needs root), or every session
    write of this process failing as the runtime's writer fails on a full
    disk (its message, its temporary file's name)."""
    folder = tmp_path / "sessions"
    folder.mkdir()
    if request.param == "simulated":
        real, full = _session.Snapshot.write, [False]

        def write(self: Any, path: str | os.PathLike[str], attachment: bytes = b"") -> None:
            if full[0]:
                target = Path(path)
                raise SessionFileError(f"writing {target.parent}/.{target.name}.aoti-tmp-{os.getpid()}-7 failed: "
                                       f"{os.strerror(errno.ENOSPC)}")
            real(self, path, attachment)

        monkeypatch.setattr(_session.Snapshot, "write", write)
        yield folder, lambda on: full.__setitem__(0, on), True
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}; the simulated "
                    "full disk runs instead")
    filler = folder / "filler"

    def fill(on: bool) -> None:
        if not on:
            filler.unlink()
            return
        with filler.open("wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e

    try:
        yield folder, fill, False
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_session_dir_loses_no_session(llm: LLM, local: LLM, caplog: pytest.LogCaptureFixture,
                                             full_disk: tuple[Path, Callable[[bool], None], bool]) -> None:
    folder, fill, simulated = full_disk
    # (A fill simulated in this process: the server and its LLM in this process.)
    server = running(create_app(local, session_dir=folder, session_ttl=0.2)) if simulated \
        else serving(llm, session_dir=folder, session_ttl=0.2)
    with caplog.at_level(logging.INFO, logger="aoti_sessions.serve"), server as url, \
            client(url, timeout=60) as http:
        fill(True)
        chats = {f"chat-{i}": [{"role": "user", "content": f"Chat number {i}, hello."}] for i in range(4)}
        for session, messages in chats.items():
            messages.append({"role": "assistant", "content": _chat(http, session, messages)["choices"][0]
                             ["message"]["content"]})
            messages.append({"role": "user", "content": "And then?"})
        # Their TTL passes many times over: every park fails, each session
        # stays in memory with its cache, and one line says so.
        wait_until(lambda: any("could not be parked" in r.getMessage() for r in caplog.records),
                   what="a park to fail")
        time.sleep(0.5)  # (10 sweeps more)
        assert sorted(s["id"] for s in http.get("/v1/sessions").json()["data"]) == sorted(chats)
        assert metrics(http)["aoti_sessions_session_park_failures_total"] >= 3 * len(chats)
        assert _chat(http, "chat-0", chats["chat-0"])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        failed = [r.getMessage() for r in caplog.records if "could not be parked" in r.getMessage()]
        assert len(failed) == 1 and "No space left on device" in failed[0], failed
        # A save: 507, the server's fault, said without server paths, temporary names or pids.
        message = _error(_post(http, "/v1/sessions/chat-1/save", {"name": "keep"}), 507, "out_of_space")
        assert message == "cannot save the session as 'keep': the server is out of space for session files; " \
                          "try again later", message
        assert not (folder / "keep").exists()
        # Room again: the next sweeps park them all, and one line says parking works again.
        fill(False)
        wait_until(lambda: http.get("/v1/sessions").json()["data"] == [], what="the sessions to be parked")
        assert sorted(p.name for p in (folder / ".live").iterdir()) == sorted(chats)
        assert [r.getMessage() for r in caplog.records if "works again" in r.getMessage()] == \
               [f"parking sessions works again, after {metrics(http)['aoti_sessions_session_park_failures_total']:.0f} "
                "failures"]
        assert _chat(http, "chat-2", chats["chat-2"])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert http.post("/v1/sessions/chat-2/save", json={"name": "keep"}).status_code == 200
    assert len([r for r in caplog.records if "could not be parked" in r.getMessage()]) == 1


def test_saved_files_are_bounded_per_key_listed_and_deleted(llm: LLM, tmp_path: Path) -> None:
    hello = [{"role": "user", "content": "Hello"}]
    for folder in ("count", "bytes"):
        (tmp_path / folder).mkdir()
    options = dict(api_keys=[KEY_A, KEY_B], session_dir=tmp_path / "count", max_session_files=2)
    with serving(llm, **options) as url, client(url, headers={"Authorization": f"Bearer {KEY_A}"}) as a, \
            client(url, headers={"Authorization": f"Bearer {KEY_B}"}) as b:
        for http in (a, b):
            _chat(http, "s", hello)
        for name in ("one", "two"):
            assert a.post("/v1/sessions/s/save", json={"name": name}).status_code == 200
        message = _error(a.post("/v1/sessions/s/save", json={"name": "three"}), 403, "session_files_limit")
        assert "your saved sessions are 2 files, the server's limit" in message and "DELETE" in message
        assert a.post("/v1/sessions/s/save", json={"name": "two"}).status_code == 200  # (over one: no more files)
        for name in ("one", "two", "three"):  # B's limit is B's own
            response = b.post("/v1/sessions/s/save", json={"name": name})
            assert response.status_code == (200 if name != "three" else 403), response.text
        listed = a.get("/v1/session-files").json()
        assert [f["name"] for f in listed["data"]] == ["one", "two"] and listed["max_files"] == 2
        assert all(f["bytes"] > 0 for f in listed["data"])
        assert a.delete("/v1/session-files/one").json() == {"name": "one", "object": "session_file.deleted",
                                                            "deleted": True}
        _error(a.delete("/v1/session-files/one"), 404, "file_not_found")
        _error(a.delete("/v1/session-files/.live"), 400, "invalid_name")
        assert a.post("/v1/sessions/s/save", json={"name": "three"}).status_code == 200
        assert [f["name"] for f in a.get("/v1/session-files").json()["data"]] == ["three", "two"]
        assert [f["name"] for f in b.get("/v1/session-files").json()["data"]] == ["one", "two"]
    # The bytes: a save is refused once the key's files hold the limit.
    with serving(llm, session_dir=tmp_path / "bytes", max_session_files_bytes=1) as url, client(url) as http:
        _chat(http, "s", hello)
        assert http.post("/v1/sessions/s/save", json={"name": "one"}).status_code == 200
        size = (tmp_path / "bytes" / "one").stat().st_size
        message = _error(http.post("/v1/sessions/s/save", json={"name": "two"}), 403, "session_files_limit")
        assert f"your saved sessions hold {size} bytes, the server's limit is 1" in message
        assert http.post("/v1/sessions/s/save", json={"name": "one"}).status_code == 200  # (replacing itself)
    with pytest.raises(ValueError, match="max_session_files must be an int >= 1, got 0"):
        create_app(llm, max_session_files=0)


def test_a_fork_or_a_load_never_replaces_a_parked_session(llm: LLM, tmp_path: Path) -> None:
    with serving(llm, session_dir=tmp_path) as url, client(url, timeout=60) as http:
        _chat(http, "parked", [{"role": "user", "content": "Hello there, keep this."}])
        tokens = http.get("/v1/sessions/parked").json()["tokens"]
    assert (tmp_path / ".live" / "parked").is_file()  # (parked as the server stopped)
    with serving(llm, session_dir=tmp_path) as url, client(url, timeout=60) as http:
        _chat(http, "other", [{"role": "user", "content": "Some other words, a longer chat than that one."}])
        assert http.post("/v1/sessions/other/save", json={"name": "other"}).status_code == 200
        _error(http.post("/v1/sessions/other/fork", json={"session_id": "parked"}), 409, "session_exists")
        _error(http.post("/v1/sessions/load", json={"name": "other", "session_id": "parked"}), 409, "session_exists")
        assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == ["other"]  # (nothing made)
        assert http.get("/v1/sessions/parked").json()["tokens"] == tokens


def test_a_failed_save_names_no_temporary_file(local: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's error names its temporary file (with the server's pid):
    the answer says "a temporary file" instead."""
    def write(self: Any, path: str | os.PathLike[str], attachment: bytes = b"") -> None:
        raise SessionFileError(f"writing {Path(path).parent}/.{Path(path).name}.aoti-tmp-{os.getpid()}-3 failed: "
                               f"{os.strerror(errno.EIO)}")

    monkeypatch.setattr(_session.Snapshot, "write", write)  # (in this process: its server and LLM here)
    with running(create_app(local, session_dir=tmp_path)) as url, httpx.Client(base_url=url, timeout=60) as http:
        _chat(http, "s", [{"role": "user", "content": "Hello"}])
        message = _error(http.post("/v1/sessions/s/save", json={"name": "f"}), 400, "invalid_session_file")
        assert message == f"cannot save the session as 'f': writing a temporary file failed: {os.strerror(errno.EIO)}"
