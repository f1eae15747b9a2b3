"""The LLM a serving process answers from: ``aoti-sessions serve`` and each
replica of a cluster open it the same way."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..llm.interface import SWITCH_INTERVAL_S  # (the engine process's own, too)


def open_llm(package: str | os.PathLike[str], *, device: str, threads: int | None, engine_process: bool,
             engine_options: dict[str, Any]) -> Any:
    """An :class:`~aoti_sessions.llm.LLM` of ``package`` in this process, or
    (``engine_process``) a :class:`~aoti_sessions.llm.RemoteLLM` driving one
    in a child process, so that the step loop shares no GIL with HTTP,
    templates, tokenizing (and, in a replica, Ray's own threads).

    Either way this process's GIL switch interval is shortened: when the
    device ends a step, the thread that queues the next one (or reads the
    child's tokens) waits for the others to let go, up to the switch
    interval (5 ms by default, several steps' worth)."""
    from ..llm import LLM, RemoteLLM

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return (RemoteLLM if engine_process else LLM)(package, device=device, threads=threads, **engine_options)
