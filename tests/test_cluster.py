"""The server on a local Ray Serve cluster (``aoti_sessions.cluster``): CPU
replicas of the tiny compiled Qwen3 package, on 127.0.0.1 only, driven over
HTTP as clients drive it, against one server's replies to the same chats."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import StreamingResponse

from aoti_sessions.llm import LLM
from aoti_sessions.serve import create_app
from llm_models import llm_package
from conftest import run_async
from serving import descendants, metrics, running, wait_until

if importlib.util.find_spec("ray") is None:  # (not imported here: the cluster imports it, on loopback)
    pytest.skip("the [cluster] extra (ray[serve]) is not installed", allow_module_level=True)

CONTEXT = 512
TOKENS = 8
TURNS = ["Hello, who are you?", "Tell me about the sea.", "And the mountains?", "Thanks, bye."]
KEY = "cluster-key-7d2e"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def package() -> Path:
    return llm_package("qwen3", device="cpu", max_cache_len=CONTEXT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A local Ray cluster with Serve's HTTP proxy on a free port; yields the port."""
    from aoti_sessions.cluster import _local

    _local.start(num_cpus=2)
    import ray
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def deploy(cluster: int, package: Path, tmp_path: Path) -> Iterator[Any]:
    """Deploys an application of ``package`` (session dir: the test's tmp
    folder) under ``/NAME``; deleted when the test ends."""
    from ray import serve

    from aoti_sessions.cluster import app

    names = set()

    def run(name: str, replicas: int, **options: Any) -> None:
        names.add(name)
        serve.run(app(package, replicas=replicas, session_dir=tmp_path, threads=1, loopback=True, api_key=KEY,
                      cpus_per_replica=0.25, **options), name=name, route_prefix=f"/{name}")

    yield run
    for name in names:
        serve.delete(name)


def client(port: int, name: str) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}/{name}", headers=AUTH, timeout=120)


def turn(http: httpx.Client, messages: list[dict[str, str]], session: str, header: bool = False) -> dict[str, Any]:
    """One greedy turn; the session named in the body (as OpenAI's
    ``extra_body`` sends it) or, with ``header``, by ``X-Session-ID``."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": TOKENS, "temperature": 0}
    headers = {"X-Session-ID": session} if header else {}
    if not header:
        body["session_id"] = session
    response = http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def converse(http: httpx.Client, session: str, turns: list[str], header: bool = False,
             history: list[dict[str, str]] | None = None) -> tuple[list[str], list[int]]:
    """Turns on ``session`` (continuing ``history``, which grows); the
    replies and each turn's cached prompt tokens."""
    messages = history if history is not None else []
    replies, cached = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        answer = turn(http, messages, session, header)
        replies.append(answer["choices"][0]["message"]["content"])
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies, cached


@pytest.fixture(scope="module")
def reference(package: Path) -> Any:
    """One server's replies (no cluster): chat index -> its turns' replies."""
    with LLM(package, "cpu", threads=1) as llm, running(create_app(llm)) as url, \
            httpx.Client(base_url=url, timeout=120) as http:
        # Chat i opens with its own line, so the chats differ.
        return [converse(http, f"ref-{i}", [f"Chat number {i}.", *TURNS])[0] for i in range(40)]


def open_chats(http: httpx.Client, prefix: str, count: int, reference: Any) -> dict[int, list[dict[str, str]]]:
    """``count`` chats (``prefix-i``) of their first two turns, each reply
    equal to one server's; their histories, by chat."""
    histories: dict[int, list[dict[str, str]]] = {i: [] for i in range(count)}
    for i, history in histories.items():
        replies, _ = converse(http, f"{prefix}-{i}", [f"Chat number {i}.", TURNS[0]], history=history)
        assert replies == reference[i][:2], i
    return histories


def _checkpointed_chats(http: httpx.Client, prefix: str, count: int, reference: Any,
                        tmp_path: Path) -> tuple[dict[int, list[dict[str, str]]], str, list[int]]:
    """``open_chats``, once each chat's last turn is checkpointed (it is,
    once left alone a moment); with the replica holding chat 0 (the victim)
    and the chats it holds."""
    histories = open_chats(http, prefix, count, reference)
    wait_until(lambda: all((tmp_path / ".live" / f"{prefix}-{i}").is_file() for i in histories), timeout=30,
               what="the checkpoints")
    holders = _replica_of(http)
    victim = holders[f"{prefix}-0"]
    return histories, victim, [i for i in histories if holders[f"{prefix}-{i}"] == victim]


def _engine_of(app: str, replica: str) -> int:
    """The engine process of ``app``'s replica ``replica`` (its unique id)."""
    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{app}#engine#{replica}", namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    (engine,) = descendants(pid) & _engine_processes()
    return engine


def _replica_of(http: httpx.Client) -> dict[str, str]:
    listed = http.get("/v1/sessions")
    assert listed.status_code == 200, listed.text
    return {s["id"]: s["replica"] for s in listed.json()["data"]}


def test_affinity_40_chats_reuse_their_cache(cluster: int, deploy: Any, tmp_path: Path, reference: Any) -> None:
    deploy("affinity", replicas=2, api_keys=[OTHER_KEY])
    with client(cluster, "affinity") as http:
        def chat(i: int) -> tuple[list[str], list[int]]:
            return converse(http, f"chat-{i}", [f"Chat number {i}.", *TURNS[:2]], header=i % 2 == 1)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(chat, range(40)))
        for i, (replies, cached) in enumerate(results):
            assert replies == reference[i][:3], i
            assert cached[0] == 0 and all(c > 0 for c in cached[1:]), (i, cached)  # every follow-up reused its cache
        holders = _replica_of(http)
        assert set(holders) == {f"chat-{i}" for i in range(40)}
        counts = sorted(list(holders.values()).count(r) for r in set(holders.values()))
        assert len(counts) == 2 and counts[0] >= 12, counts  # both replicas hold chats
        seen = metrics(http)
        assert seen['aoti_sessions_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 120
        assert seen["aoti_sessions_cluster_replicas"] == 2
        per_replica = [v for k, v in seen.items() if k.startswith("aoti_sessions_checkpoints_total{replica=")]
        assert len(per_replica) == 2 and sum(per_replica) == seen["aoti_sessions_checkpoints_total"] > 0
        assert http.get("/v1/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/health", headers={"Authorization": ""}).json() == {"status": "ok", "replicas": 2}
        _other_key_sees_none_of(http, results, tmp_path)


OTHER_KEY = "cluster-tenant-b-51a0"


def _other_key_sees_none_of(http: httpx.Client, results: list[tuple[list[str], list[int]]], tmp_path: Path) -> None:
    """Another key of the cluster (item 9 of issue 34): the ingress lists
    none of the first key's sessions to it and routes its ids apart; the
    replicas answer 404 for them on every endpoint; its chat on one of those
    ids is a session of its own, without that cache."""
    from aoti_sessions.serve._tenants import tenant_id

    other = {"Authorization": f"Bearer {OTHER_KEY}"}

    def listed(headers: dict[str, str]) -> list[str]:
        return sorted(s["id"] for s in http.get("/v1/sessions", headers=headers).json()["data"])

    assert listed(other) == []
    for i in range(4):
        for method, path, body in (("GET", "", None), ("POST", "/fork", {}), ("POST", "/reset", None),
                                   ("POST", "/save", {"name": "x"}), ("DELETE", "", None)):
            response = http.request(method, f"/v1/sessions/chat-{i}{path}", json=body, headers=other)
            assert response.status_code == 404, (i, method, path, response.text)
    first = [{"role": "user", "content": "Chat number 0."}]
    mine = http.post("/v1/chat/completions", headers=other,
                     json={"messages": first, "max_tokens": TOKENS, "temperature": 0, "session_id": "chat-0"})
    assert mine.status_code == 200 and mine.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert mine.json()["choices"][0]["message"]["content"] == results[0][0][0]
    assert listed(other) == ["chat-0"] and len(listed(AUTH)) == 40
    assert http.get("/v1/sessions/chat-0").json()["tokens"] > \
        http.get("/v1/sessions/chat-0", headers=other).json()["tokens"]
    wait_until(lambda: (tmp_path / ".tenants" / tenant_id(OTHER_KEY) / ".live" / "chat-0").is_file(), timeout=30,
               what="its checkpoint, in its own folder")


def test_killed_replica_loses_no_completed_turn(cluster: int, deploy: Any, tmp_path: Path,
                                                reference: Any) -> None:
    deploy("failover", replicas=2)
    with client(cluster, "failover") as http:
        histories, victim, moved = _checkpointed_chats(http, "f", 8, reference, tmp_path)
        engines = _engine_processes()
        assert len(engines) == 2, engines  # each replica's engine in a process of its own
        import ray

        # A stream of the victim's, cut midway (its engine paused at its
        # first event: it cannot end first), ends with an error event.
        engine = _engine_of("failover", victim)
        body = {"messages": [*histories[0], {"role": "user", "content": "Count to a thousand."}], "stream": True,
                "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": "f-0"}) as stream:
            assert stream.status_code == 200
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(events)
            os.kill(engine, signal.SIGSTOP)
            try:
                ray.kill(ray.get_actor(f"SERVE_REPLICA::failover#engine#{victim}", namespace="serve"),
                         no_restart=True)
                rest = list(events)  # to the stream's end (a cut connection raises)
            finally:
                with contextlib.suppress(ProcessLookupError):  # (gone with its replica, where Ray killed it too)
                    os.kill(engine, signal.SIGCONT)
        assert rest and rest[-1] != "data: [DONE]", rest[-3:]
        assert json.loads(rest[-1][6:])["error"]["code"] == "engine_unavailable", rest[-1]
        assert all("error" not in json.loads(e[6:]) for e in rest[:-1])
        # The victim's engine process goes with it (its pipe ends); the other replica's stays.
        wait_until(lambda: len(engines - _engine_processes()) == 1, timeout=30, what="the victim's engine to end")
        for i, history in histories.items():  # every chat goes on, the victim's from their checkpoints
            replies, cached = converse(http, f"f-{i}", TURNS[1:3], history=history)
            assert replies == reference[i][2:4], i
            assert cached[0] > 0, (i, cached)  # the checkpoint's cache, not the history prefilled again
        after = _replica_of(http)
        assert all(after[f"f-{i}"] != victim for i in moved) and moved
        seen = metrics(http)
        assert seen["aoti_sessions_sessions_unparked_total"] >= len(moved)


def test_replica_whose_engine_died_sends_its_turns_to_another(cluster: int, deploy: Any, tmp_path: Path,
                                                              reference: Any) -> None:
    deploy("engineless", replicas=2)
    with client(cluster, "engineless") as http:
        histories, victim, moved = _checkpointed_chats(http, "e", 4, reference, tmp_path)
        engine = _engine_of("engineless", victim)
        os.kill(engine, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{engine}"), what="its replica to see it end (and reap it)")
        for i, history in histories.items():  # e-0 first: before Serve's health check replaces the victim
            replies, cached = converse(http, f"e-{i}", [TURNS[1]], history=history)
            assert replies == reference[i][2:3] and cached[0] > 0, (i, cached)
        after = _replica_of(http)
        assert all(after[f"e-{i}"] != victim for i in moved) and moved


# The ingress alone, in front of a deployment handle whose replicas answer as
# told (a replica whose engine ended, one lost mid-stream).
_REQUEST = {"method": "POST", "path": "/v1/chat/completions", "query": b"", "headers": [], "body": b"{}"}


@pytest.fixture
def ingress() -> Any:
    """The ingress's class, imported as the cluster imports it (Serve's
    settings first: Serve reads them as it loads)."""
    from aoti_sessions.cluster import _env

    _env.apply()
    from aoti_sessions.cluster._ingress import Ingress

    return Ingress


class _Replicas:
    """A deployment handle: its calls answered in turn."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.answer = self.call = self

    def options(self, **options: Any) -> _Replicas:
        return self

    def remote(self, request: dict[str, Any]) -> Any:
        return self.answers.pop(0)


class _Answer:
    """A replica's whole answer (awaited as Serve's response is)."""

    def __init__(self, replica: str, status: int, **marks: Any) -> None:
        from aoti_sessions.cluster._replica import REPLICA_HEADER

        self.value = {"status": status, "body": json.dumps({"from": replica}).encode(), **marks,
                      "headers": [(b"content-type", b"application/json"), (REPLICA_HEADER, replica.encode())]}

    def __await__(self) -> Generator[None, None, dict[str, Any]]:
        return self.value
        yield


class _Cut:
    """A replica's streamed answer: its head and chunks, then ``error``."""

    def __init__(self, chunks: list[bytes], error: Exception) -> None:
        self.items: list[Any] = [{"status": 200, "headers": [(b"content-type", b"text/event-stream")]}, *chunks]
        self.error, self.cancelled = error, False

    def __aiter__(self) -> _Cut:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        raise self.error

    def cancel(self) -> None:
        self.cancelled = True


def test_ingress_sends_again_only_what_a_replica_did_not_run(ingress: Any) -> None:
    """A replica's 503 is sent to another replica only when marked as its
    engine having ended before the request came; an engine that ends while
    a request runs answers the client (the request may have run in part)."""
    from aoti_sessions.cluster._affinity import AFFINITY
    from aoti_sessions.cluster._replica import ENGINE_GONE

    replicas = _Replicas(_Answer("r-1", 503, **{ENGINE_GONE: True}), _Answer("r-2", 200))
    sent = run_async(ingress(replicas)._forward(_REQUEST, "x-1", False))
    assert (sent.status_code, json.loads(sent.body)) == (200, {"from": "r-2"}) and not replicas.answers
    assert AFFINITY.is_gone("r-1") and AFFINITY.owner("x-1") == "r-2"
    replicas = _Replicas(_Answer("r-3", 503), _Answer("r-4", 200))
    sent = run_async(ingress(replicas)._forward(_REQUEST, "x-2", False))
    assert (sent.status_code, json.loads(sent.body)) == (503, {"from": "r-3"}) and len(replicas.answers) == 1


def test_streams_cut_by_a_lost_replica_end_with_an_error_event_and_one_log_line(
        ingress: Any, caplog: pytest.LogCaptureFixture) -> None:
    from ray.exceptions import ActorUnavailableError

    async def cut() -> tuple[bytes, bool]:
        stream = _Cut([b"data: {}\n\n"], ActorUnavailableError("the replica is gone", None))
        response = await ingress(_Replicas(stream))._forward(_REQUEST, "x-3", True)
        assert isinstance(response, StreamingResponse)
        return b"".join([bytes(c) async for c in response.body_iterator]), stream.cancelled

    with caplog.at_level(logging.WARNING, "aoti_sessions.cluster"):
        cuts = [run_async(cut()) for _ in range(3)]
    for body, cancelled in cuts:
        first, last = body.split(b"\n\n", 1)
        assert first == b"data: {}" and last.startswith(b"data: ") and last.endswith(b"\n\n") and cancelled, body
        assert json.loads(last[6:])["error"]["code"] == "engine_unavailable", body
    logged = [r for r in caplog.records if r.name == "aoti_sessions.cluster"]
    assert len(logged) == 1 and logged[0].exc_info is None, logged  # one line, not a traceback each


def test_full_cluster_parks_idle_sessions_to_make_room(cluster: int, deploy: Any, tmp_path: Path) -> None:
    """Replicas of two sessions each: placement fills the one with room; a
    new session on a full cluster parks an idle one (to its checkpoint, whence
    it comes back with its cache). The ingress answers CORS preflights without
    the key, and every answer has one X-Request-Id (Serve's proxy's: the
    client's, or one it made); the replicas serve the model's names."""
    origin = "https://app.example"
    deploy("full", replicas=2, engine={"max_sessions": 2}, allowed_origins=[origin],
           server={"model_name": ["full-model"]})
    with client(cluster, "full") as http:
        for i in range(4):  # two per replica: placement fills the one with room
            turn(http, [{"role": "user", "content": "Hi"}], f"p-{i}")
        assert sorted(list(_replica_of(http).values()).count(r) for r in set(_replica_of(http).values())) == [2, 2]
        fifth = turn(http, [{"role": "user", "content": "Hi"}], "p-4")  # its replica parks its least recent
        assert fifth["model"] == "full-model"
        assert metrics(http)["aoti_sessions_sessions_parked_for_room_total"] == 1
        (gone,) = {f"p-{i}" for i in range(5)} - set(_replica_of(http))
        assert (tmp_path / ".live" / gone).is_file()
        back = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                       "session_id": gone, "temperature": 0})
        assert back.status_code == 200 and back.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert http.delete(f"/v1/sessions/{gone}").status_code == 200
        assert not (tmp_path / ".live" / gone).exists()  # (else another replica would bring it back)
        # (A 429 here would need every session a replica holds busy: this model's generations end too soon.)
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2, "bogus": 1}, headers={"X-Request-Id": "full-1"})
        assert refused.status_code == 400 and refused.headers.get_list("x-request-id") == ["full-1"]
        preflight = httpx.options(f"{http.base_url}v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
        unkeyed = httpx.get(f"{http.base_url}v1/models", headers={"Origin": origin, "X-Request-Id": "full-2"})
        assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == origin
        assert unkeyed.headers.get_list("x-request-id") == ["full-2"]
        listed = http.get("/v1/models", headers={"Origin": origin})
        assert [m["id"] for m in listed.json()["data"]] == ["full-model"]
        assert listed.headers["access-control-allow-origin"] == origin and len(listed.headers.get_list("x-request-id")) == 1


def test_scale_down_moves_the_leaving_replicas_sessions(cluster: int, deploy: Any, tmp_path: Path,
                                                        reference: Any) -> None:
    deploy("scale", replicas=2)
    with client(cluster, "scale") as http:
        histories = open_chats(http, "s", 6, reference)
        assert len(set(_replica_of(http).values())) == 2
        deploy("scale", replicas=1)
        wait_until(lambda: http.get("/health").json().get("replicas") == 1, timeout=120, what="one replica")
        for i, history in histories.items():
            replies, cached = converse(http, f"s-{i}", [TURNS[1]], history=history)
            assert replies == reference[i][2:3] and cached[0] > 0, (i, cached)
        assert len(set(_replica_of(http).values())) == 1


def _engine_processes() -> set[int]:
    """The engine processes (RemoteLLM's children) this test's cluster runs."""
    found = set()
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"aoti_sessions.llm.process._engine_main" in f.read():
                    found.add(pid)
        except OSError:
            continue
    return found


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def _on_loopback(address: str, remote: bool) -> bool:
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    if remote and port == "0" and host in ("0.0.0.0", "::"):
        return True  # not connected
    return host.startswith("127.") or host == "::1" or host.startswith("::ffff:127.")


def test_every_cluster_socket_is_on_loopback(cluster: int, package: Path, tmp_path: Path) -> None:
    """Every socket the cluster's processes (this one and all it started:
    Ray's, Serve's, the replicas') hold listens on, or connects to, 127.0.0.1.
    Deployed as ``serve run aoti_sessions.cluster:build_app`` does, from text."""
    from ray import serve

    from aoti_sessions.cluster import build_app

    serve.run(build_app({"package": str(package), "session_dir": str(tmp_path), "replicas": "2", "threads": "1",
                         "cpus_per_replica": "0.25", "api_key": KEY, "loopback": True,
                         "engine_process": "false"}),
              name="loopback", route_prefix="/loopback")
    with client(cluster, "loopback") as http:
        converse(http, "l-0", TURNS[:2])
        pids = descendants(os.getpid())
        inodes = _socket_inodes(pids)
        assert len(pids) > 5 and inodes  # Ray's processes, with their sockets
        checked, wrong = 0, []
        for table in ("tcp", "tcp6", "udp", "udp6"):
            with open(f"/proc/net/{table}") as f:
                for row in f.read().splitlines()[1:]:
                    fields = row.split()
                    if fields[9] not in inodes:
                        continue
                    local, remote = _address(fields[1]), _address(fields[2])
                    checked += 1
                    if not (_on_loopback(local, False) and _on_loopback(remote, True)):
                        wrong.append(f"{table} {local} -> {remote}")
        assert checked > 10 and not wrong, wrong
    serve.delete("loopback")


def test_build_app_refuses_a_flag_that_is_neither_true_nor_false(package: Path, tmp_path: Path) -> None:
    from aoti_sessions.cluster import build_app

    with pytest.raises(ValueError, match="engine_process must be true or false, got 'maybe'"):
        build_app({"package": str(package), "session_dir": str(tmp_path), "engine_process": "maybe"})


def test_a_wedged_replica_is_replaced(cluster: int, deploy: Any, tmp_path: Path, reference: Any) -> None:
    """A replica whose engine process stops answering (SIGSTOP) fails Serve's
    health check once its engine's deadline passed (3 s here) and is
    replaced; its chats go on, from their checkpoints, on the new one."""
    deploy("wedged", replicas=1, engine={"engine_timeout": 3})
    with client(cluster, "wedged") as http:
        histories = open_chats(http, "w", 2, reference)
        wait_until(lambda: all((tmp_path / ".live" / f"w-{i}").is_file() for i in histories), timeout=30,
                   what="the checkpoints")
        engines = _engine_processes()
        assert len(engines) == 1, engines
        stopped = engines.pop()
        os.kill(stopped, signal.SIGSTOP)
        try:
            wait_until(lambda: bool(_engine_processes() - {stopped}), timeout=180, what="a new replica's engine")
            wait_until(lambda: http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "session_id": "probe"}
                ).status_code == 200, timeout=120, what="the new replica to answer")
            for i, history in histories.items():
                replies, cached = converse(http, f"w-{i}", TURNS[1:2], history=history)
                assert replies == reference[i][2:3] and cached[0] > 0, (i, cached)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)  # (a stopped process never sees its pipe end)
