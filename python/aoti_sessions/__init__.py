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

import torch  # loads libtorch, whose C shim the core resolves at run time

from . import errors
from ._compile import compile
from ._engine import Engine, Session
from .errors import (
    CapacityError,
    DeviceError,
    Error,
    PackageError,
    RunError,
    SessionClosedError,
)

__all__ = ["Engine", "Session", "compile", "errors", *errors.__all__]

__version__ = "0.1.0"
del torch
