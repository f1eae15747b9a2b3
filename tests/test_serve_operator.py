"""What an operator needs of the server (issue 36, item 7): CORS for
browsers, X-Request-Id, served model names, OpenAI's no-op fields, the
Prometheus exposition, the stats log line, and idle named sessions parked
to make room. Each test holds in every server mode (in this process, with
an engine process, two front ends over one), on a tiny Qwen3 whose engine
takes two sessions at most."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aoti_sessions.llm import LLM, RemoteLLM
from aoti_sessions.serve import create_app
from serving import package  # noqa: F401 (a fixture)
from serving import metrics, running, running_front_ends, transport_for, wait_until

KEY = "operator-key-90b3"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
MADE_ID = re.compile(r"[0-9a-f]{32}")  # a request id the server made
TOKENS = 6


@pytest.fixture(scope="module", params=["one-process", "engine-process", "two-front-ends"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def served(mode: str, package: Path, device: str) -> Iterator[LLM | RemoteLLM]:
    """The model, with room for two sessions: in this process, or in an engine process."""
    kind = LLM if mode == "one-process" else RemoteLLM
    with kind(package, device, threads=1, max_sessions=2) as llm:
        yield llm


@contextlib.contextmanager
def serving(served: LLM | RemoteLLM, mode: str, **options: Any) -> Iterator[str]:
    """A server of ``served`` with create_app's ``options``, as ``mode`` runs it; its URL."""
    if mode == "two-front-ends":
        with running_front_ends(served, 2, **options) as url:
            yield url
        return
    with running(create_app(served, **options)) as url:
        yield url


def client(url: str, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers=headers, timeout=60, transport=transport_for(url))


@pytest.fixture(scope="module")
def server(served: LLM | RemoteLLM, mode: str) -> Iterator[str]:
    with serving(served, mode, api_key=KEY, allowed_origins=[ORIGIN], model_name=["alias", served.name],
                 stats_interval=0.2) as url:
        yield url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with client(server, **AUTH) as c:
        yield c


def ask(content: str = "Hello there", **fields: Any) -> dict[str, Any]:
    return {"model": "alias", "messages": [{"role": "user", "content": content}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, **fields}


def reply_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_cors_preflight_needs_no_key_and_every_request_still_does(server: str, served: LLM | RemoteLLM,
                                                                 mode: str) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-session-id"}
    with client(server) as anonymous:
        answer = anonymous.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert "authorization" in answer.headers["access-control-allow-headers"]
        assert MADE_ID.fullmatch(answer.headers["x-request-id"])
        # Another origin's preflight is refused; a request without the key is still a 401 (the
        # browser may read it: it carries the CORS headers), an OPTIONS that is no preflight too.
        refused = anonymous.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        unkeyed = anonymous.post("/v1/chat/completions", json=ask(), headers={"Origin": ORIGIN})
        assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == ORIGIN
        assert anonymous.options("/v1/models", headers={"Origin": ORIGIN}).status_code == 401
    with client(server, **AUTH) as http:
        answered = http.post("/v1/chat/completions", json=ask(), headers={"Origin": ORIGIN})
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == ORIGIN
        assert "X-Request-Id" in answered.headers["access-control-expose-headers"]
        assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": "https://evil.example"}).headers
    # No origins by default: a preflight is a request like any other (401 without the key).
    with serving(served, mode, api_key=KEY) as plain, client(plain) as anonymous:
        answer = anonymous.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 401 and "access-control-allow-origin" not in answer.headers
    with pytest.raises(ValueError, match="not an origin"):
        create_app(served, allowed_origins=["app.example"])


def test_request_ids_are_echoed_checked_or_made(http: httpx.Client) -> None:
    sent = {"X-Request-Id": "req_7f3A.b:c/d+e=f-1"}
    answers = [http.get("/v1/models", headers=sent), http.post("/v1/chat/completions", json=ask(), headers=sent),
               http.post("/v1/chat/completions", json=ask(bogus=1), headers=sent),  # 400
               http.get("/v1/nowhere", headers=sent),  # 404
               http.get("/v1/models", headers={**sent, "Authorization": "Bearer wrong"})]  # 401
    assert [a.status_code for a in answers] == [200, 200, 400, 404, 401]
    assert all(a.headers["x-request-id"] == sent["X-Request-Id"] for a in answers), [a.headers for a in answers]
    with http.stream("POST", "/v1/chat/completions", json=ask(stream=True), headers=sent) as streamed:
        assert streamed.headers["x-request-id"] == sent["X-Request-Id"]
        assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
    # One a log could not hold safely is replaced, as is one too long; none sent: one made, each its own.
    for bad in ("two words", "quote\"d", "x" * 129, "tab\tbed", ""):
        made = http.get("/v1/models", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert MADE_ID.fullmatch(made), (bad, made)
    made = {http.get("/v1/models").headers["x-request-id"] for _ in range(3)}
    assert len(made) == 3 and all(MADE_ID.fullmatch(m) for m in made)


def test_served_model_names(http: httpx.Client, served: LLM | RemoteLLM, server: str) -> None:
    names = ["alias", served.name]
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == names
    assert all(http.get(f"/v1/models/{name}").json()["id"] == name for name in names)
    missing = http.get("/v1/models/other")
    assert missing.status_code == 404 and all(repr(name) in missing.json()["error"]["message"] for name in names)
    # Either name is served; answers report the first.
    for name in names:
        answer = http.post("/v1/chat/completions", json=ask(model=name))
        assert answer.status_code == 200 and answer.json()["model"] == "alias", answer.text
    chunks = http.post("/v1/completions", json={"model": served.name, "prompt": "Hi", "max_tokens": 2,
                                                "stream": True}).text
    assert '"model":"alias"' in chunks
    refused = http.post("/v1/chat/completions", json=ask(model="other"))
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    with httpx.Client(transport=transport_for(server), timeout=60) as transport, \
            openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, http_client=transport) as sdk:
        assert [m.id for m in sdk.models.list()] == names


def test_openai_fields_that_ask_for_nothing_change_nothing(http: httpx.Client, server: str) -> None:
    plain = reply_of(http.post("/v1/chat/completions", json=ask()))
    no_ops = {"metadata": {"team": "search", "run": "7"}, "store": True, "user": "user-1", "service_tier": "auto",
              "safety_identifier": "hash-4d1e", "modalities": ["text"]}
    assert reply_of(http.post("/v1/chat/completions", json=ask(**no_ops))) == plain
    streamed = http.post("/v1/chat/completions", json=ask(**no_ops, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False})).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == plain
    with httpx.Client(transport=transport_for(server), timeout=60) as transport, \
            openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, http_client=transport) as sdk:
        answer = sdk.chat.completions.create(
            model="alias", messages=[{"role": "user", "content": "Hello there"}], max_tokens=TOKENS, temperature=0,
            metadata={"team": "search"}, store=False, user="user-1", service_tier="default",
            safety_identifier="hash-4d1e", extra_body={"ignore_eos": True})
        assert answer.choices[0].message.content == plain
    # Unknown fields stay a 400, and so do values these fields cannot take.
    for extra, param in (({"bogus": 1}, "bogus"), ({"modalities": ["audio"]}, "modalities[0]"),
                         ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                         ({"metadata": {"k": "v" * 513}}, "metadata.k"), ({"service_tier": 5}, "service_tier"),
                         ({"store": "yes"}, "store"), ({"stream_options": {"obfuscate": True}},
                                                       "stream_options.obfuscate")):
        refused = http.post("/v1/chat/completions", json=ask(**extra))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (extra, refused.text)
    completion = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "metadata": {"a": "b"}})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "metadata"  # (as OpenAI's)


def test_metrics_are_prometheus_exposition(http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json=ask())
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {"aoti_sessions_requests": "counter", "aoti_sessions_generated_tokens": "counter",
             "aoti_sessions_active_generations": "gauge", "aoti_sessions_time_to_first_token_seconds": "histogram",
             "aoti_sessions_sessions": "gauge", "aoti_sessions_evictions": "counter",
             "aoti_sessions_sessions_parked_for_room": "counter", "aoti_sessions_step_seconds": "counter"}
    assert {name: families[name].type for name in kinds} == kinds
    assert {tuple(sorted(s.labels)) for s in families["aoti_sessions_requests"].samples} == {("endpoint", "status")}
    assert {s.labels["state"] for s in families["aoti_sessions_sessions"].samples} == {"resident", "offloaded"}
    assert "# TYPE aoti_sessions_requests_total counter" in text
    assert not re.search(r"^\w+_created[ {]", text, re.M), text  # (no creation times: a sum over front ends has none)
    assert metrics(http)['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1


_STATS = re.compile(r"stats: (\d+) requests \([\d.]+/s\), \d+ generating \(\d+ reading its prompt\), prompt "
                    r"[\d.]+ tokens/s( \(\d+% from cache\))?, generated ([\d.]+) tokens/s; sessions: \d+ named, "
                    r"\d+ throwaway, \d+ on the device, \d+ offloaded; KV pages \d+/\d+ \(\d+%\); state [\d.]+ MiB on "
                    r"the device, [\d.]+ MiB offloaded")


def test_stats_log_line(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aoti_sessions.serve")

    def lines() -> list[re.Match[str]]:
        return [m for r in caplog.records if r.name == "aoti_sessions.serve" and (m := _STATS.fullmatch(r.getMessage()))]

    assert all(_STATS.fullmatch(r.getMessage()) for r in caplog.records if r.getMessage().startswith("stats: "))
    reply_of(http.post("/v1/chat/completions", json=ask(max_tokens=40)))
    wait_until(lambda: any(float(m.group(3)) > 0 for m in lines()), timeout=30, what="a stats line of the generation")
    # Idle, it goes quiet (after one line saying so).
    wait_until(lambda: lines() and lines()[-1].group(1) == "0", timeout=30, what="a line of an idle interval")
    count = len(lines())
    time.sleep(1.0)
    assert len(lines()) <= count + 1


def test_idle_named_sessions_are_parked_to_make_room(served: LLM | RemoteLLM, mode: str, tmp_path: Path) -> None:
    """Two idle named sessions fill the engine (max_sessions 2): with a
    session dir, the least recently used is parked to make room for another
    request and comes back, with its cache, when named; without, 429 says why."""
    def turn(http: httpx.Client, session: str | None, content: str = "Hello there",
             history: tuple[dict[str, str], ...] = ()) -> httpx.Response:
        body = {**ask(), "messages": [*history, {"role": "user", "content": content}]}
        del body["model"]  # (these servers have the package's name only)
        return http.post("/v1/chat/completions", json={**body, **({"session_id": session} if session else {})})

    parked = tmp_path / ".live"
    with serving(served, mode, session_dir=tmp_path) as url, client(url) as http:
        first = {sid: reply_of(turn(http, sid)) for sid in ("a", "b")}
        assert reply_of(turn(http, None)) == first["a"]  # a stateless request finds room: "a" parked
        seen = metrics(http)
        assert seen["aoti_sessions_sessions_parked_for_room_total"] == 1 and (parked / "a").is_file()
        assert {s["id"] for s in http.get("/v1/sessions").json()["data"]} == {"b"}
        reply_of(turn(http, "c"))  # (the stateless one's room, free again)
        history = ({"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first["a"]})
        back = turn(http, "a", "Go on", history)  # "a" comes back from its file, parking "b"
        assert back.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, back.json()
        seen = metrics(http)
        assert seen["aoti_sessions_sessions_parked_for_room_total"] == 2
        assert seen["aoti_sessions_sessions_unparked_total"] == 1
        assert (parked / "b").is_file() and not (parked / "a").exists()
        assert {s["id"] for s in http.get("/v1/sessions").json()["data"]} == {"a", "c"}
        assert reply_of(back) == reply_of(turn(http, None, "Go on", history))  # (as from scratch; parks "c")
    with serving(served, mode) as url, client(url) as http:  # no session dir: nowhere to park them
        for sid in ("x", "y"):
            reply_of(turn(http, sid))
        for session in (None, "z"):
            refused = turn(http, session)
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
            error = refused.json()["error"]
            assert error["code"] == "capacity" and "--session-dir" in error["message"], error
