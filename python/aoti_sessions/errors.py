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
]


class Error(Exception):
    """Base class of every aoti_sessions error."""


class PackageError(Error):
    """A model package or library cannot be loaded, or does not match what was declared."""


class CapacityError(Error):
    """A new session would exceed ``max_sessions`` or ``memory_budget``; nothing was allocated."""


class SessionClosedError(Error):
    """The session, or the engine it belongs to, has been closed."""


class RunError(Error):
    """The compiled model reported a failure while running."""


class DeviceError(Error):
    """The device runtime failed (allocation, copy)."""
