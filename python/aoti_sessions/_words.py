"""Lists of names in messages and log lines."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_names"]


def first_names(names: Sequence[str], shown: int) -> str:
    """The first ``shown`` of ``names``, and how many more: ``"a, b and 3 more"``."""
    text = ", ".join(names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")
