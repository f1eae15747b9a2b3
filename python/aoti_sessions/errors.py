"""Exceptions raised by aoti_sessions.

Every error of this library derives from :class:`Error`. Wrong arguments raise
the built-in :class:`ValueError` or :class:`TypeError` instead, always before
the model runs, and leave the engine and every session as they were.

Every exception leaving the C++ core is raised as the class :data:`CORE_ERRORS`
maps its kind to (the binding layer looks it up there; tests/test_exceptions.py
pins each row):

=================  ==========================
core error kind    Python exception
=================  ==========================
invalid_argument   ValueError
type_mismatch      TypeError
package            PackageError
capacity           CapacityError
session_closed     SessionClosedError
other_process      OtherProcessError
run                RunError
device             DeviceError
session_file       SessionFileError
file_not_found     SessionFileNotFoundError
model_mismatch     ModelMismatchError
internal           Error (a broken invariant of this library; also any
                   other C++ exception)
out_of_memory      MemoryError (host memory exhausted in C++)
=================  ==========================
"""

from __future__ import annotations

__all__ = [
    "Error",
    "PackageError",
    "CapacityError",
    "SessionClosedError",
    "OtherProcessError",
    "RunError",
    "DeviceError",
    "SessionFileError",
    "SessionFileNotFoundError",
    "ModelMismatchError",
    "CompileError",
    "ExportError",
    "VerifyError",
    "CompileWarning",
    "SessionBusyError",
]


class Error(Exception):
    """Base class of every aoti_sessions error."""


class PackageError(Error):
    """A model package or library cannot be loaded, or does not match what was declared."""


class CapacityError(Error):
    """No room for a session: ``max_sessions`` reached, or ``memory_budget`` full
    with no idle session to offload (``host_budget`` full, or every resident
    session in use). Nothing was allocated."""


class SessionClosedError(Error):
    """The session, or the engine it belongs to, has been closed."""


class OtherProcessError(Error):
    """An engine (or one of its sessions) used in a child process made by
    ``os.fork()`` after the engine was created. The parent's threads and locks
    do not exist in the child: create a new :class:`Engine` there."""


class RunError(Error):
    """The compiled model reported a failure while running."""


class DeviceError(Error):
    """The device runtime failed (allocation, copy)."""


class SessionFileError(Error):
    """A session file is truncated, corrupted, not a session file, or of another
    format version; nothing was allocated."""


class SessionFileNotFoundError(SessionFileError, FileNotFoundError):
    """A session file does not exist."""


class ModelMismatchError(SessionFileError):
    """A session file was saved from another model (other buffers, or with
    ``strict=True`` other compiled libraries or weights)."""


class CompileError(Error):
    """``ais.compile`` cannot make a correct package of the module with the
    arguments given; the message says what to pass instead."""


class VerifyError(CompileError):
    """``ais.compile(..., verify=...)``: the compiled package, run on one
    session, differs from the eager module. ``method`` and ``step`` (from 1)
    say where, ``buffers`` and ``outputs`` what differs (buffer FQNs, output
    positions in the flattened outputs)."""

    def __init__(self, message: str, method: str, step: int, buffers: list[str], outputs: list[int]) -> None:
        super().__init__(message)
        self.method = method
        self.step = step
        self.buffers = buffers
        self.outputs = outputs


class ExportError(CompileError):
    """``aoti_sessions.llm.export`` cannot make a package that serves the
    model: the message names the family, the layer and the operation that
    failed, and what is known of the family; ``details`` holds the whole
    traceback (``aoti-sessions export --verbose`` prints it)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class CompileWarning(UserWarning):
    """``ais.compile`` found a pattern AOTInductor is known to compile into a
    model that differs from the module (the message says which and what to do)."""


class EngineProcessError(Error):
    """An LLM's engine process ended (crashed, killed, or never started):
    :class:`aoti_sessions.llm.RemoteLLM`."""


class EngineUnresponsiveError(EngineProcessError):
    """An LLM's engine process does not answer (no heartbeat: stopped or
    wedged; or its step loop stuck in one step); it may answer again."""


class SessionBusyError(Error):
    """A generation is already running on this chat session (one at a time;
    close it, or wait for it to finish)."""


CORE_ERRORS: dict[str, type[BaseException]] = {
    "invalid_argument": ValueError,
    "type_mismatch": TypeError,
    "package": PackageError,
    "capacity": CapacityError,
    "session_closed": SessionClosedError,
    "other_process": OtherProcessError,
    "run": RunError,
    "device": DeviceError,
    "session_file": SessionFileError,
    "file_not_found": SessionFileNotFoundError,
    "model_mismatch": ModelMismatchError,
    "internal": Error,
    "out_of_memory": MemoryError,
}


def core_error(kind: str) -> type[BaseException]:
    """The class an exception of the core's ``kind`` is raised as."""
    return CORE_ERRORS.get(kind, Error)
