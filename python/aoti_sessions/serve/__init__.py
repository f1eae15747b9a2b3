"""An OpenAI-compatible HTTP server of an LLM package's sessions.

>>> from aoti_sessions.llm import LLM
>>> from aoti_sessions.serve import create_app
>>> app = create_app(LLM("qwen3.pt2", max_sessions=64), api_key="secret")
>>> uvicorn.run(app)   # or: aoti-sessions serve qwen3.pt2 --max-sessions 64

Needs FastAPI and uvicorn (``pip install 'aoti-sessions[serve]'``), imported
when :func:`create_app` is first used: ``import aoti_sessions.serve`` and the
command line's argument parsing work without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from ._app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
