"""Lists of names in messages and log lines."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_names", "bounded", "shown"]

MAX_MESSAGE = 1024  # characters of an error message, at most (bounded())
MAX_NAME = 80       # characters of a name quoted in one (shown())


def first_names(names: Sequence[str], shown: int) -> str:
    """The first ``shown`` of ``names``, and how many more: ``"a, b and 3 more"``."""
    text = ", ".join(names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text``, or where longer than ``limit`` its start and end around a
    note of how much was left out (a message quoting a huge input stays small)."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 4
    return f"{text[:head]}...[{len(text) - head - tail} characters left out]...{text[-tail:]}"


def shown(name: object, limit: int = MAX_NAME) -> str:
    """``repr(name)`` for a message, shortened past ``limit`` characters."""
    text = repr(name)
    if len(text) <= limit:
        return text
    return f"{text[:limit - 20]}...' ({len(str(name))} characters)"
