"""aoti_sessions: many isolated sessions from one AOTInductor-compiled model.

>>> import aoti_sessions as ais
>>> eng = ais.Engine("model.pt2", device="cpu")
>>> with eng.new_session() as s:
...     logits = s(tokens, positions)

The weights are loaded once and shared by every session and every method; each
session owns its own copy of the model's mutable buffers (KV caches, recurrent
state), bound into the model by pointer when the session runs.
"""

from __future__ import annotations

import os

import torch  # loads libtorch, whose C shim the core resolves at run time

# Packages not made by ais.compile carry no input specs to check calls against;
# their compiled code checks dtype, shape, strides and device itself when this
# is set, rather than read a wrong input as garbage. Each model library reads
# it once, at its first run, so it is set at import (AOTI_RUNTIME_CHECK_INPUTS=0
# before the import turns it off).
os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")

from . import errors
from ._compile import Method, Pool, compile
from ._engine import Engine
from ._session import Session, Snapshot
from .errors import (
    CapacityError,
    CompileError,
    CompileWarning,
    DeviceError,
    Error,
    ExportError,
    ModelMismatchError,
    OtherProcessError,
    PackageError,
    RunError,
    SessionBusyError,
    SessionClosedError,
    SessionFileError,
    SessionFileNotFoundError,
    VerifyError,
)

__all__ = ["Engine", "Method", "Pool", "Session", "Snapshot", "compile", "errors", *errors.__all__]

# The one place the version is written (pyproject.toml and CMakeLists.txt read it).
__version__ = "0.1.0"
del os, torch
