"""The server spread over many replicas on Ray Serve: one engine per GPU (or
CPU), a session's requests always at the replica that holds it, and every
session checkpointed to a shared session directory after each change, so a
replica's loss (or its removal) loses no completed turn.

>>> from ray import serve
>>> from aoti_sessions.cluster import app
>>> serve.run(app("qwen3.pt2", replicas=4, session_dir="/shared/sessions", device="cuda"))

or ``aoti-sessions serve qwen3.pt2 --replicas 4 --device cuda``; for ``serve
run`` / ``serve deploy``: ``aoti_sessions.cluster:build_app`` with the same
arguments. Needs the ``[cluster]`` extra (``ray[serve]``), imported only when
an application is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import app, build_app

__all__ = ["app", "build_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _app

        return getattr(_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
