"""Exceptions raised by aoti_sessions.

Every error of this library derives from :class:`Error`. Wrong arguments raise
the built-in :class:`ValueError` or :class:`TypeError` instead, always before
the model runs, and leave the engine and every session as they were.

C++ core errors map to these classes (csrc/python/module.cc):

==================  ==========================
core ErrorKind      Python exception
==================  ==========================
kInvalidArgument    ValueError
kTypeMismatch       TypeError
kPackage            PackageError
kCapacity           CapacityError
kSessionClosed      SessionClosedError
kRun                RunError
kDevice             DeviceError
kSessionFile        SessionFileError
kFileNotFound       SessionFileNotFoundError
kModelMismatch      ModelMismatchError
kInternal           Error
==================  ==========================
"""

from __future__ import annotations

__all__ = [
    "Error",
    "PackageError",
    "CapacityError",
    "SessionClosedError",
    "RunError",
    "DeviceError",
    "SessionFileError",
    "SessionFileNotFoundError",
    "ModelMismatchError",
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
