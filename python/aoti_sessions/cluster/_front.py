"""The command line's HTTP front: the ingress run in the command's own
process, behind the single server's uvicorn (its connection limits and
deadlines), calling the engine replicas through a deployment handle.

Ray Serve's HTTP proxy costs a process hop per request (on a 2-core machine
about 9 ms, and a ceiling near 190 requests/s; see bench/results/cluster_*);
a handle call from here costs one hop fewer. ``serve run`` / ``serve
deploy`` users get the same ingress as a Serve deployment
(:func:`aoti_sessions.cluster.app`) instead.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._ingress import Ingress

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def front_app(ingress: Ingress) -> Starlette:
    """Every request, any path, answered by ``ingress``."""

    async def answer(request: Request) -> Response:
        return await ingress(request)

    return Starlette(routes=[Route("/{path:path}", answer, methods=METHODS)])


def serve_front(replicas: Any, host: str, port: int, *, api_key: str | None, max_body_bytes: int,
                max_connections: int, header_timeout: float, api_keys: Sequence[str] = (),
                allowed_origins: Sequence[str] = ()) -> None:
    """Serves the cluster on ``host:port`` until SIGINT or SIGTERM."""
    import uvicorn

    from ..llm.interface import SWITCH_INTERVAL_S
    from ..serve.interface import server_config

    # uvicorn's loop hands each request to the handle's router on a thread
    # of its own and takes the answer back: each hand-over waits for the
    # GIL, up to the switch interval (5 ms by default) while the other runs.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    app = front_app(Ingress(replicas, api_key=api_key, api_keys=api_keys, max_body_bytes=max_body_bytes,
                            allowed_origins=allowed_origins, answer_request_ids=True))
    server = uvicorn.Server(server_config(app, host, port, max_connections=max_connections,
                                          header_timeout=header_timeout, log_level="warning", log_config=None))
    # uvicorn stops on SIGINT or SIGTERM, then raises the signal again for
    # the handler it found: here that ends the wait, and the caller goes on
    # to stop the cluster.
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run()
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Stop(Exception):
    pass


def _stopped(signum: int, frame: object) -> None:
    raise _Stop
