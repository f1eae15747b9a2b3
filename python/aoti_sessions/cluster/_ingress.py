"""The cluster's front door: Ray Serve's HTTP proxy hands it every request;
it finds the session a request is for and passes the request whole to the
replica the session router picks, answering with that replica's answer.

A request names its session as one server reads it: an ``X-Session-ID``
header, ``session_id`` in a generation's or a load's JSON body, or the path
of a ``/v1/sessions/{id}`` endpoint. ``GET /v1/sessions`` and ``/metrics``
are the whole cluster's (every replica asked); ``/health`` is the
ingress's own. The request's ``X-Request-Id`` is checked or made as one
server does it, and the replica is handed the same; the answer carries it
(with ``answer_request_ids``: the command's HTTP front; Serve's HTTP proxy
adds its own, the client's as sent or one it made). With
``allowed_origins``, the CORS headers (a browser's preflight is answered
here, before the API key is asked for). When a replica dies with a request
on its way, or its engine process had ended before the request came, the
request goes to another replica (which brings the session back from its
checkpoint); a stream cut midway ends with an error event, as one server's
does when its engine ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .._logs import REQUEST_ID
from ..serve.interface import APIError, Cors, error_response, request_id, sse_error, unauthorized, unexpected
from ..serve.interface import CONTENT_TYPE, DEFAULT_TENANT, Keys, MetricsRegistry, OnceAMinute, scoped
from . import _local
from ._metrics import merge
from ._replica import ENGINE_GONE, REPLICA_HEADER
from ._affinity import AFFINITY
from ._router import TARGET

log = logging.getLogger("aoti_sessions.cluster")
_BODY_NAMES_SESSION = ("/v1/chat/completions", "/v1/completions", "/v1/sessions/load")
_SESSIONS = "/v1/sessions/"
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}
# A lost replica fails every request it had: one line a minute, not one each.
_SENT_AGAIN, _CUT = "sent a request to another replica", "streams cut by a lost replica"
log.addFilter(OnceAMinute(_SENT_AGAIN, _CUT))


def session_of(method: str, path: str, headers: list[tuple[bytes, bytes]], body: dict[str, Any] | None) -> str | None:
    """The session a request is for, as the server that answers it reads it
    (None: any replica may answer); ``body``: its JSON object, if one."""
    header = next((v for k, v in headers if k == b"x-session-id"), None)
    if header is not None:
        return header.decode("latin-1")
    if path.startswith(_SESSIONS) and path != "/v1/sessions/load":
        return path[len(_SESSIONS):].split("/", 1)[0] or None
    if method == "POST" and path in _BODY_NAMES_SESSION and body is not None:
        value = body.get("session_id")
        return value if isinstance(value, str) else None
    return None


def json_object(body: bytes) -> dict[str, Any] | None:
    """A request body's JSON object; None for anything else (the replica
    says what is wrong with it)."""
    if not body:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _replica_gone(error: BaseException) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(error, (RayActorError, ActorUnavailableError))


class Ingress:
    def __init__(self, replicas: Any, *, api_key: str | None = None, retry_for: float = 60.0,
                 max_body_bytes: int = 64 << 20, loopback: bool = False, api_keys: Sequence[str] = (),
                 allowed_origins: Sequence[str] = (), answer_request_ids: bool = False) -> None:
        if loopback:
            _local.keep_replica_on_loopback()
        self.replicas = replicas  # the engine replicas' deployment handle
        # A request's tenant (its key's): sessions are routed by their id
        # within it, and it lists only its own; each replica checks the key
        # again, and serves the tenant's sessions only.
        self.keys = Keys(api_key, api_keys)
        self.retry_for, self.max_body_bytes = retry_for, max_body_bytes
        self.cors = Cors(allowed_origins) if allowed_origins else None
        self.answer_request_ids = answer_request_ids
        self.metrics = MetricsRegistry()
        self.requests = self.metrics.counter("aoti_sessions_cluster_requests_total",
                                             "Requests the ingress answered, by status.", ("status",))
        self.retries = self.metrics.counter("aoti_sessions_cluster_retries_total",
                                            "Requests sent again because their replica was gone.")
        self.metrics.gauge("aoti_sessions_cluster_replicas", "Engine replicas the router sees.",
                           lambda: float(len(AFFINITY.replicas())))

    async def __call__(self, request: Request) -> Response:
        rid = request_id(request.headers.raw)
        token = REQUEST_ID.set(rid)
        try:
            preflight = self.cors.preflight(request.method, request.headers) if self.cors is not None else None
            response = preflight or await self._answer(request, rid)
        finally:
            REQUEST_ID.reset(token)
        # (The replica's answer has the id too: one header, or none where Serve's proxy adds its own.)
        headers = [h for h in response.raw_headers if h[0] != b"x-request-id"]
        if self.answer_request_ids:
            headers.append((b"x-request-id", rid.encode()))
        if self.cors is not None and preflight is None:
            headers = await self.cors.answer_headers(request.headers, headers)
        response.raw_headers = headers
        self.requests.labels(status=str(response.status_code)).inc()
        return response

    async def _answer(self, request: Request, rid: str) -> Response:
        method, path = request.method, request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):  # (an application under a route prefix)
            path = path[len(root):] or "/"
        # (The replica is handed the request's id as checked here: it answers and logs with the same.)
        headers = [(k.lower(), v) for k, v in request.headers.raw if k.lower() != b"x-request-id"]
        headers.append((b"x-request-id", rid.encode()))
        if path == "/health":
            return await self._health()
        tenant = self.keys.tenant(headers)
        if tenant is None:
            return unauthorized(headers)
        body = await self._body(request)
        if body is None:
            return error_response(413, f"the request body is over the cluster's limit of {self.max_body_bytes} "
                                       "bytes", "request_too_large", headers={"Connection": "close"})
        forwarded = {"method": method, "path": path, "query": request.url.query.encode(), "headers": headers,
                     "body": body}
        if method == "GET" and path == "/metrics":
            return await self._metrics()
        if method == "GET" and path == "/v1/sessions":
            return await self._sessions(tenant)
        parsed = json_object(body) if method == "POST" else None
        streamed = parsed is not None and parsed.get("stream") is True
        session_id = session_of(method, path, headers, parsed)
        return await self._forward(forwarded, scoped(tenant, session_id) if session_id else None, streamed)

    async def _body(self, request: Request) -> bytes | None:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _replica_ids(self) -> tuple[str, ...]:
        """The replicas alive (the router learns them with its first request)."""
        if not AFFINITY.replicas():
            await self.replicas.options(stream=False).record_routing_stats.remote()
        return AFFINITY.replicas()

    async def _health(self) -> Response:
        replicas = await self._replica_ids()
        status = 200 if replicas else 503
        return JSONResponse({"status": "ok" if replicas else "unavailable", "replicas": len(replicas)},
                            status_code=status)

    async def _send(self, request: dict[str, Any], session_id: str | None, streamed: bool) -> tuple[Any, Any]:
        """A replica's answer: its head, and its body, or (``streamed``) the
        stream of its chunks. A replica that dies before answering, or
        whose engine had ended before the request came (it ran none of it),
        is forgotten and the request sent again."""
        deadline, attempt = time.monotonic() + self.retry_for, 0
        options: dict[str, Any] = {"stream": streamed}
        if session_id:
            options["session_id"] = session_id
        while True:
            try:
                if streamed:
                    stream = self.replicas.options(**options).call.remote(request)
                    head, rest = await stream.__anext__(), stream
                else:
                    answer = await self.replicas.options(**options).answer.remote(request)
                    head, rest = answer, answer["body"]
            except Exception as e:
                if not _replica_gone(e) or time.monotonic() > deadline:
                    raise
                owner, why = AFFINITY.owner(session_id) if session_id else None, type(e).__name__
            else:
                if not head.get(ENGINE_GONE) or time.monotonic() > deadline:
                    return head, rest
                if streamed:
                    rest.cancel()
                owner = next((v.decode() for k, v in head["headers"] if k == REPLICA_HEADER), None)
                why = "its engine process ended"
            log.warning("%s: replica %s was gone (%s)", _SENT_AGAIN, owner or "?", why)
            if owner is not None:
                AFFINITY.gone(owner)
            self.retries.inc()
            await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
            attempt += 1

    async def _forward(self, request: dict[str, Any], session_id: str | None, streamed: bool) -> Response:
        try:
            head, rest = await self._send(request, session_id, streamed)
        except Exception as e:  # noqa: BLE001 - every request gets an answer
            log.error("no replica could answer %s %s", request["method"], request["path"], exc_info=e)
            if _replica_gone(e):
                return error_response(503, "no replica of the model is available now", "engine_unavailable")
            return error_response(500, f"the replica failed: {type(e).__name__}", "internal_error")
        status, headers = head["status"], [h for h in head["headers"] if h[0] not in _HOP_HEADERS]
        replica = next((v.decode() for k, v in headers if k == REPLICA_HEADER), None)
        if session_id and replica and 200 <= status < 300:
            AFFINITY.pin(session_id, replica)
        elif session_id and status == 429:
            AFFINITY.forget(session_id)  # (placed on a full replica: the next try is placed again)
        if streamed and any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers):
            response: Response = StreamingResponse(_chunks(rest), status_code=status)
            response.raw_headers = headers
            return response
        body = b"".join([chunk async for chunk in rest]) if streamed else rest
        self._learn(request, session_id, status, body, replica)
        response = Response(body, status_code=status)
        response.raw_headers = headers + [(b"content-length", str(len(body)).encode())]
        return response

    def _learn(self, request: dict[str, Any], session_id: str | None, status: int, body: bytes,
               replica: str | None) -> None:
        """Sessions an answer made or ended: a fork's or a load's new id is
        pinned to the replica that holds it; a deleted one is forgotten."""
        if status != 200 or replica is None:
            return
        method, path = request["method"], request["path"]
        if method == "DELETE" and session_id:
            AFFINITY.forget(session_id)
        elif method == "POST" and (path == "/v1/sessions/load" or path.endswith("/fork")):
            made = json.loads(body).get("id")
            if isinstance(made, str):
                AFFINITY.pin(scoped(self.keys.tenant(request["headers"]) or DEFAULT_TENANT, made), replica)

    async def _each_replica(self, method: str, **arguments: Any) -> dict[str, Any]:
        """``method()`` of every replica: replica id -> result (a replica gone
        meanwhile is left out). One at a time: the calls of one request share
        its id, by which Serve's router matches a choice to its request."""
        out = {}
        for rid in await self._replica_ids():
            try:
                out[rid] = await getattr(self.replicas.options(stream=False), method).remote(**arguments,
                                                                                            **{TARGET: rid})
            except Exception as e:  # noqa: BLE001 - the others still answer
                log.warning("replica %s did not answer %s: %s", rid, method, e)
        return out

    async def _sessions(self, tenant: str) -> Response:
        answers = await self._each_replica("listing", tenant=tenant)
        newest: dict[str, dict[str, Any]] = {}
        for rid, listed in answers.items():
            for entry in listed:
                entry["replica"] = rid
                known = newest.get(entry["id"])
                if known is None or entry["last_used"] >= known["last_used"]:
                    newest[entry["id"]] = entry  # (a stale copy elsewhere is dropped at its next use)
        return JSONResponse({"object": "list", "data": sorted(newest.values(), key=lambda e: e["created"])})

    async def _metrics(self) -> Response:
        texts = await self._each_replica("metrics")
        return Response(merge(texts) + self.metrics.render(), media_type=CONTENT_TYPE)


async def _chunks(stream: Any) -> AsyncIterator[bytes]:
    """A replica's stream passed on; cut by the replica's loss, it ends as
    one server's stream does when its engine process ends: with an error
    event (503 ``engine_unavailable``)."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:  # noqa: BLE001 - the stream has begun: the error goes in it
        if _replica_gone(e):
            log.warning("%s: %s", _CUT, type(e).__name__)
            error = APIError(503, "the model is unavailable: its replica was lost mid-stream", "engine_unavailable")
        else:
            error = unexpected("in a replica's stream", e)
        yield sse_error(error)
    finally:
        stream.cancel()  # the client hung up: the replica's generation stops
