"""A failed export said in a few lines: which family, which layer and
operation failed (the innermost frame of the model's own code, or of
export's adaptations of it), what is known of the family
(``_families.py``) and what to do; the whole traceback kept aside
(:class:`~aoti_sessions.errors.ExportError`'s ``details``, printed by
``aoti-sessions export --verbose``)."""

from __future__ import annotations

import sysconfig
import traceback
from types import TracebackType
from typing import Any

from ...errors import ExportError
from ._families import OWN_STATE, TESTED

__all__ = ["explained", "ours"]

# Frames that only pass a call on: torch's own (export, Inductor), transformers'
# wrappers and decorators, export's compile machinery; the standard library's.
_PASSING = ("/torch/", "/transformers/utils/", "/aoti_sessions/_")
_STDLIB = sysconfig.get_paths()["stdlib"].replace("\\", "/") + "/"
_LONGEST = 400  # characters of the failing operation's message


def _frames(error: BaseException) -> list[tuple[Any, int]]:
    """Every frame of ``error``'s traceback and of the errors it was raised
    from (innermost last), with their line numbers."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    frames = []
    for e in reversed(chain):  # (the first cause's frames are the deepest)
        tb: TracebackType | None = e.__traceback__
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
    return frames


def _component(error: BaseException) -> str:
    """The innermost frame of code that is not torch's, transformers'
    wrappers' or the standard library's (the model's layer, or export's
    adaptation of it): ``Class.method (file:line: `source`)``, the class its
    module's; '' if none."""
    import linecache

    for frame, line in reversed(_frames(error)):
        path = frame.f_code.co_filename.replace("\\", "/")
        if any(part in path for part in _PASSING) or path.startswith(_STDLIB):
            continue
        owner = frame.f_locals.get("self")
        name = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else frame.f_code.co_name
        source = linecache.getline(frame.f_code.co_filename, line).strip()
        return f"{name} ({path.rsplit('/', 1)[-1]}:{line}{f': `{source}`' if source else ''})"
    return ""


def _operation(error: BaseException) -> str:
    """The innermost error's type and first line (torch's own errors are long)."""
    innermost = error
    while (innermost.__cause__ or innermost.__context__) is not None:
        innermost = innermost.__cause__ or innermost.__context__  # type: ignore[assignment]
    lines = [line.strip() for line in str(innermost).strip().splitlines() if line.strip()]
    text = lines[0].rstrip(" .!") if lines else ""
    if len(text) > _LONGEST:
        text = text[:_LONGEST] + " ..."
    return f"{type(innermost).__name__}: {text}" if text else type(innermost).__name__


def _family(model_type: str) -> str:
    if model_type in TESTED or model_type in OWN_STATE:
        return (f"'{model_type}' is a family aoti-sessions runs exact in its tests: this checkpoint differs from the "
                "tested one (its config, or a transformers version other than the tested one)")
    return f"'{model_type}' is not among the families aoti-sessions tests (docs/models.md: Families)"


def ours(error: BaseException) -> bool:
    """Whether ``error`` is one of aoti_sessions' own refusals (raised by its
    code, saying what to do already)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/aoti_sessions/" in tb.tb_frame.f_code.co_filename.replace("\\", "/") \
        and isinstance(error, (ValueError, TypeError)) and error.__cause__ is None


def explained(error: BaseException, model: Any) -> ExportError:
    """``error``, raised while ``model`` was traced, compiled or checked, as
    an :class:`ExportError` saying what failed and what to do."""
    model_type = str(getattr(model.config, "model_type", "?"))
    where = _component(error)
    message = (f"export of {type(model).__name__} failed{f' in {where}' if where else ''}: {_operation(error)}. "
               f"{_family(model_type)}. The whole traceback: aoti-sessions export --verbose (or the exception's "
               "details); report it with the model's config.json.")
    return ExportError(message, "".join(traceback.format_exception(error)))
