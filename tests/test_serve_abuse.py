"""The server under abuse (issue 20): bodies past the limit, prompts that
cannot fit, answered cleanly and cheaply, the server left serving. A real
uvicorn server over the tiny Qwen3 package on the CPU."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aoti_sessions.llm import LLM
from aoti_sessions.serve import create_app
from aoti_sessions.serve._app import MIN_BODY_LIMIT, default_body_limit
from llm_models import llm_package
from serving import running

CONTEXT = 256
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(llm_package("qwen3", max_cache_len=CONTEXT), threads=1, max_sessions=8) as model:
        yield model


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[str]:
    with running(create_app(llm, max_body_bytes=LIMIT)) as url:
        yield url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


def _chat(text: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["code"] == code, error
    return str(error["message"])


def _serves(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_chat("Hello"))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_body_over_the_limit_is_413_unread(http: httpx.Client, server: str) -> None:
    """Declared too long (Content-Length), or found too long as it arrives
    (chunked, no length): 413 naming the limit, the rest never read; the
    server goes on serving."""
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (2 * LIMIT) + b'"}]}'
    message = _error(http.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"}),
                     413, "request_too_large")
    assert f"limit of {LIMIT} bytes" in message and "--max-body-bytes" in message

    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b" " * 4096  # (whitespace: valid JSON padding, were it read)

    _error(http.post("/v1/chat/completions", content=chunks()), 413, "request_too_large")
    # A client that declares 100 MB and sends 12 bytes is answered at once, not held.
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000000\r\n\r\n{\"messages\":")
        assert raw.recv(4096).startswith(b"HTTP/1.1 413 ")
    _serves(http)
    # Just under the limit is read whole, as usual (and refused for what it
    # says: its short messages pass the character bound, their tokens do not fit).
    under = _chat("x")
    under["messages"] = [{"role": "user", "content": "h"}] * ((LIMIT - 200) // 30)
    assert LIMIT - 400 < len(httpx.Request("POST", "/", json=under).content) < LIMIT
    message = _error(http.post("/v1/chat/completions", json=under), 400, "context_length_exceeded")
    assert f"tokens; the context holds {CONTEXT}" in message


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(http: httpx.Client, llm: LLM) -> None:
    """Text longer than the context's tokens times the longest piece any
    token stands for: 400 context_length_exceeded from its length alone."""
    limit = CONTEXT * llm._piece_chars
    for body in (_chat("word " * (limit // 5 + 1)),
                 {"prompt": "x" * (limit + 1), "max_tokens": 2},
                 {**_chat("a"), "messages": [{"role": "user", "content": "b" * 600}] * (limit // 600 + 1)}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        message = _error(http.post(path, json=body), 400, "context_length_exceeded")
        assert "characters: at least" in message and f"the context holds {CONTEXT}" in message
    # Token ids: counted before each is checked.
    message = _error(http.post("/v1/completions", json={"prompt": [1] * (CONTEXT + 1), "max_tokens": 2}), 400,
                     "context_length_exceeded")
    assert f"has {CONTEXT + 1} tokens" in message
    _serves(http)


def test_the_default_body_limit_follows_the_context() -> None:
    assert default_body_limit(128) == MIN_BODY_LIMIT == 1 << 20
    assert default_body_limit(128 * 1024) == 4 << 20
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1, got 0"):
        create_app(None, max_body_bytes=0)  # type: ignore[arg-type]


def test_cli_takes_a_body_limit(tmp_path: Path) -> None:
    import argparse

    from aoti_sessions.serve._cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["p.pt2", "--max-body-bytes", "2MiB"]).max_body_bytes == 2 << 20
    assert parser.parse_args(["p.pt2"]).max_body_bytes is None
