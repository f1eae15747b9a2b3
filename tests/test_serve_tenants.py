"""Tenants (issue 34, item 9): each API key owns the sessions and session
files it makes; to another key they are absent (404) on every endpoint, in
memory, parked and after a restart, and no cache is shared across keys (no
``cached_tokens`` oracle). A real uvicorn server over the tiny Qwen3 package
on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aoti_sessions.__main__ import main
from aoti_sessions.llm import LLM
from aoti_sessions.serve._tenants import Keys, read_api_keys, tenant_id
from llm_models import llm_package
from serving import client, open_served, serving, wait_until

KEY_A, KEY_B, KEY_ROOT = "tenant-a-3f9d", "tenant-b-71c2", "root-key-0b5e"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with open_served(llm_package("qwen3", max_cache_len=256), max_sessions=8) as model:
        yield model


def _as(url: str, key: str) -> httpx.Client:
    return client(url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _chat(http: httpx.Client, session: str, text: str) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 2, "temperature": 0, "session_id": session})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _ids(http: httpx.Client) -> list[str]:
    listed = http.get("/v1/sessions")
    assert listed.status_code == 200, listed.text
    return sorted(s["id"] for s in listed.json()["data"])


def _absent(http: httpx.Client, session: str) -> None:
    """Every session endpoint answers 404 for ``session``, as for an id nobody has."""
    for method, path, body in (("GET", "", None), ("POST", "/reset", None), ("POST", "/fork", {}),
                               ("POST", "/fork", {"session_id": "stolen"}), ("POST", "/save", {"name": "stolen"}),
                               ("DELETE", "", None)):
        response = http.request(method, f"/v1/sessions/{session}{path}", json=body)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "session_not_found", (method, path, response.text)


def test_each_key_sees_and_uses_only_its_own_sessions_and_files(llm: LLM, tmp_path: Path) -> None:
    secret = "My password is boats, and my bank is on Elm Street."
    with serving(llm, api_key=KEY_ROOT, api_keys=[KEY_A, KEY_B], session_dir=tmp_path) as url, _as(url, KEY_A) as a, _as(url, KEY_B) as b, _as(url, KEY_ROOT) as root:
        assert httpx.get(f"{url}/v1/sessions", headers={"Authorization": "Bearer tenant-c"}).status_code == 401
        _chat(a, "victim", secret)
        assert a.post("/v1/sessions/victim/save", json={"name": "diary"}).status_code == 200
        assert a.post("/v1/sessions/victim/fork", json={"session_id": "copy"}).status_code == 200
        tokens = a.get("/v1/sessions/victim").json()["tokens"]
        # A's sessions are absent to B and to the root key, as an id nobody has is.
        for other in (b, root):
            for session in ("victim", "copy", "nobody"):
                _absent(other, session)
            assert _ids(other) == []
            response = other.post("/v1/sessions/load", json={"name": "diary"})
            assert response.status_code == 404 and response.json()["error"]["code"] == "file_not_found"
            assert other.get("/v1/session-files").json()["data"] == []
            assert other.delete("/v1/session-files/diary").status_code == 404
        # B's chat on A's id is a session of B's own: nothing of A's cache
        # (the prefix oracle), and A's session is as it was.
        assert _cached(_chat(b, "victim", secret)) == 0
        completion = {"prompt": secret, "max_tokens": 2, "temperature": 0}
        assert _cached(b.post("/v1/completions", json=completion, headers={"X-Session-ID": "copy"}).json()) == 0
        assert _ids(b) == ["copy", "victim"] and _ids(a) == ["copy", "victim"]
        assert a.get("/v1/sessions/victim").json()["tokens"] == tokens
        again = _chat(a, "victim", secret)  # (the same prompt: A's own cache serves it)
        assert _cached(again) > 0
        tokens_after = a.get("/v1/sessions/victim").json()["tokens"]
        # Same ids, same file names, each key its own: B saves and deletes its "diary", A's stays.
        assert b.post("/v1/sessions/victim/save", json={"name": "diary"}).status_code == 200
        assert b.delete("/v1/session-files/diary").status_code == 200
        assert [f["name"] for f in a.get("/v1/session-files").json()["data"]] == ["diary"]
        loaded = a.post("/v1/sessions/load", json={"name": "diary", "session_id": "reread"})
        assert loaded.status_code == 200 and loaded.json()["tokens"] == tokens
        assert b.post("/v1/sessions/victim/fork", json={"session_id": "reread"}).status_code == 200  # B's own id
        assert b.delete("/v1/sessions/victim").status_code == 200 and a.get("/v1/sessions/victim").status_code == 200
        _chat(root, "mine", "Hello")
        assert _ids(root) == ["mine"] and "mine" not in _ids(a)
    # Parked when the server stopped: each in its key's folder (the default
    # key's at the session dir's root), named by a hash of the key, never by the key.
    home_a = tmp_path / ".tenants" / tenant_id(KEY_A)
    assert (home_a / ".live" / "victim").is_file() and (home_a / "diary").is_file()
    assert (tmp_path / ".live" / "mine").is_file() and not (tmp_path / ".live" / "victim").exists()
    on_disk = [str(p) for p in tmp_path.rglob("*")]
    assert not any(key in path for path in on_disk for key in (KEY_A, KEY_B, KEY_ROOT)), on_disk
    # After a restart, parked sessions are still their key's alone.
    with serving(llm, api_key=KEY_ROOT, api_keys=[KEY_B, KEY_A], session_dir=tmp_path) as url, _as(url, KEY_A) as a, _as(url, KEY_B) as b, _as(url, KEY_ROOT) as root:
        _absent(root, "victim")
        _absent(b, "victim")  # (B deleted its own "victim"; A's, parked, is not B's)
        assert (home_a / ".live" / "victim").is_file()
        assert a.get("/v1/sessions/victim").json()["tokens"] == tokens_after
        assert _ids(b) == [] and _ids(a) == ["victim"]
        assert b.get("/v1/sessions/reread").json()["tokens"] == tokens  # B's fork, parked in B's folder
        assert a.post("/v1/sessions/load", json={"name": "diary"}).status_code == 200
        assert root.get("/v1/sessions/mine").status_code == 200


def test_the_api_keys_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\n\n  alpha-key-1  \nbeta-key-2\n# gamma-key-3\n\t\n")
    assert read_api_keys(keys) == ["alpha-key-1", "beta-key-2"]
    for text, message in (("", "no key in the file"), ("# only a comment\n\n", "no key in the file"),
                          ("good-key\nbad key\n", "line 2: a key is one word"),
                          ("one-key\n\none-key\n", "line 3: the key of line 1 again")):
        keys.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_api_keys(keys)
    with pytest.raises(ValueError, match=r"cannot read the keys file \(No such file or directory\)"):
        read_api_keys(tmp_path / "missing")
    with pytest.raises(ValueError, match="given twice"):
        Keys("alpha-key-1", ["alpha-key-1"])
    # Tenant ids: a hash of the key, the same in every process.
    assert tenant_id("alpha-key-1") == tenant_id("alpha-key-1") != tenant_id("alpha-key-2")
    assert len(tenant_id("alpha-key-1")) == 32 and "alpha" not in tenant_id("alpha-key-1")
    headers = [(b"authorization", b"bearer  beta-key-2")]
    assert Keys(None, ["alpha-key-1", "beta-key-2"]).tenant(headers) == tenant_id("beta-key-2")
    assert Keys(None, ["alpha-key-1"]).tenant(headers) is None and Keys().tenant(headers) == ""
    # The command refuses a missing or bad file at once (before it loads the model: none at that path).
    for args, message in ((["--api-keys", str(tmp_path / "missing")], "cannot read the keys file"),
                          (["--api-keys", str(keys)], "the key of line 1 again")):
        for extra in ([], ["--replicas", "2"]):
            with pytest.raises(SystemExit) as exit:
                main(["serve", str(tmp_path / "none.pt2"), *args, *extra])
            assert exit.value.code == 2 and message in capsys.readouterr().err, extra


def test_a_keys_idle_session_is_parked_in_its_folder(llm: LLM, tmp_path: Path) -> None:
    """The idle sweep parks another key's sessions as the default key's (it
    once looked them up by their bare id, and never parked one)."""
    with serving(llm, api_keys=[KEY_A], session_dir=tmp_path, session_ttl=0.5) as url, _as(url, KEY_A) as a:
        _chat(a, "idle", "Hello there")
        tokens = a.get("/v1/sessions/idle").json()["tokens"]
        parked = tmp_path / ".tenants" / tenant_id(KEY_A) / ".live" / "idle"
        wait_until(parked.is_file, 30, "the idle session parked")
        assert a.get("/v1/sessions/idle").json()["tokens"] == tokens  # back from its file
