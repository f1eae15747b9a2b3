"""Session: one conversation's state on an Engine, and how Python calls turn
into the flat tensor lists the compiled methods take."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from typing_extensions import Self

import torch
import torch.utils._pytree as pytree

import aoti_sessions._core as _core
from ._core import BufferInfo, Engine as CoreEngine
from ._words import shown

__all__ = ["Session", "SessionsEngine", "PooledState", "MethodCall", "to_handles", "from_handles", "Closable"]

# Tensors <-> owning AtenTensorHandle capsules, the only way tensors cross into
# the core (which links no torch C++ API).
to_handles: Callable[[list[torch.Tensor]], list[Any]] = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
from_handles: Callable[[list[Any]], list[torch.Tensor]] = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs


class Closable:
    """`with x:` closes x on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _dense(x: torch.Tensor) -> bool:
    """Whether `x` has strides (sparse and nested tensors do not); the core
    refuses the others with its own message."""
    return x.layout == torch.strided and not x.is_nested


@dataclass(frozen=True)
class MethodCall:
    """How to call one method: its index in the core and its pytree specs."""

    name: str
    index: int
    in_spec: pytree.TreeSpec | None
    out_spec: pytree.TreeSpec | None
    # Positional-only tensor inputs, no kwargs: inputs need no flattening.
    flat_call: bool
    # Per input: whether it must be contiguous (the container indexes it so).
    contiguous: tuple[bool, ...] | None
    # The model returns one tensor (out_spec is a leaf): no unflattening.
    single_output: bool = False
    # The exported call (args, kwargs): how many positional inputs, the
    # keywords in their exported order (positions beyond the positional
    # inputs fill them in that order), and the positional inputs' exported
    # names where known (for messages). positional is -1 for other specs.
    positional: int = -1
    keywords: tuple[str, ...] = ()
    positional_names: tuple[str, ...] = ()
    # Over pooled state: the inputs are the caller's only (the engine fills
    # the rest), by position or by name.
    pooled: bool = False

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor inputs of a call, in the container's order."""
        if self.pooled and kwargs:
            args, kwargs = self._pooled_by_name(args, kwargs), {}
        if self.flat_call and not kwargs:
            # The common case: contiguous tensors, nothing to convert.
            try:
                if all(type(x) is torch.Tensor and x.is_contiguous() for x in args):
                    return list(args)
            except RuntimeError:
                pass  # a sparse or nested tensor: the checks below and the core's name it
            flat = list(args)
        elif self.in_spec is None:
            if kwargs:
                raise TypeError(f"method '{self.name}' takes no keyword inputs")
            flat = list(args)
        else:
            if self.positional >= 0:
                args, kwargs = self._name_inputs(args, kwargs)
            try:
                ordered = torch.export._tree_utils.reorder_kwargs(kwargs, self.in_spec)
            except ValueError as e:
                raise TypeError(f"method '{self.name}': {e}") from None
            leaves, spec = pytree.tree_flatten((args, ordered))
            if spec != self.in_spec:
                raise TypeError(f"method '{self.name}' expects inputs structured as {self.in_spec}, got {spec}")
            # Non-tensor leaves were baked into the model at export, as torch's loader assumes.
            flat = [x for x in leaves if isinstance(x, torch.Tensor)]
        contiguous = self.contiguous
        for i, x in enumerate(flat):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} of method '{self.name}' is a {type(x).__name__}, expected a Tensor")
            if contiguous is not None and i < len(contiguous) and contiguous[i] and _dense(x) \
                    and not x.is_contiguous():
                flat[i] = x.contiguous()
        return flat

    def _pooled_by_name(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        names = self.positional_names
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise TypeError(f"method '{self.name}' got unexpected keyword input {unknown[0]!r}; it takes "
                            f"{', '.join(names)}")
        given = dict(zip(names, args))
        twice = [k for k in kwargs if k in given]
        if twice:
            raise TypeError(f"method '{self.name}': input '{twice[0]}' given by position and by keyword")
        given.update(kwargs)
        missing = [n for n in names if n not in given]
        if missing:
            raise TypeError(f"method '{self.name}' is missing input {missing[0]!r}; it takes {', '.join(names)}")
        return tuple(given[n] for n in names)

    def _name_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positions beyond the positional inputs given to the keywords in
        their exported order; a TypeError naming what the method takes when
        the call does not fit it."""
        extra = args[self.positional:]
        if len(extra) > len(self.keywords):
            raise TypeError(f"method '{self.name}' takes {self.positional + len(self.keywords)} inputs "
                            f"({self._expects()}), got {len(args)} by position")
        named = dict(zip(self.keywords, extra))
        twice = [k for k in named if k in kwargs]
        if twice:
            raise TypeError(f"method '{self.name}': input '{twice[0]}' given by position and by keyword")
        kwargs = {**named, **kwargs}
        unknown = [k for k in kwargs if k not in self.keywords]
        missing = [k for k in self.keywords if k not in kwargs]
        if unknown or missing or len(args) < self.positional:
            what = (f"got unexpected keyword input{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"
                    if unknown else f"is missing input{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"
                    if missing else f"got {len(args)} positional inputs")
            raise TypeError(f"method '{self.name}' {what}; it takes {self._expects()}")
        return args[:self.positional], kwargs

    def _expects(self) -> str:
        parts = []
        if self.positional:
            names = f" ({', '.join(self.positional_names)})" if self.positional_names else ""
            parts.append(f"{self.positional} positional input{'s' if self.positional > 1 else ''}{names}")
        if self.keywords:
            parts.append(f"{', '.join(self.keywords)} by keyword or by position in this order")
        return " then ".join(parts) or "no inputs"

    def outputs(self, flat: list[torch.Tensor]) -> Any:
        if self.single_output:
            return flat[0]
        return flat if self.out_spec is None else pytree.tree_unflatten(flat, self.out_spec)


class PooledState(dict[str, torch.Tensor]):
    """A session's pooled state (``Session.state()`` of a pooled engine): each
    pooled tensor's units by name, and the positions the session holds."""

    def __init__(self, items: Any = (), *, length: int) -> None:
        super().__init__(items)
        self.length = length


class SessionsEngine(Protocol):
    """What a :class:`Session` holds of the engine that made it
    (:class:`aoti_sessions.Engine` is one): the device and methods, its
    counters, and what runs a call (the core, the method calls, the buffers'
    layout, the stream the calls are ordered on). A protocol, so that
    sessions never import the engine that imports them."""

    @property
    def device(self) -> torch.device: ...

    @property
    def methods(self) -> tuple[str, ...]: ...

    def stats(self) -> dict[str, Any]: ...

    def captures(self, method: str) -> bool: ...

    @property
    def _core(self) -> CoreEngine: ...

    @property
    def _only(self) -> MethodCall | None: ...

    @property
    def _methods(self) -> Mapping[str, MethodCall]: ...

    @property
    def _buffers(self) -> Sequence[BufferInfo]: ...

    @property
    def _stream(self) -> Callable[[], int]: ...


class Session(Closable):
    """One conversation's state on an :class:`Engine`; made by ``Engine.new_session``.

    Every method of the engine reads and writes the same session state. A
    session may be used and closed from any thread; its calls are serialised.
    """

    def __init__(self, engine: SessionsEngine, core: _core.Session) -> None:
        self._engine = engine
        self._core = core

    @property
    def id(self) -> int:
        return int(self._core.id)

    @property
    def engine(self) -> SessionsEngine:
        """The engine that made this session (an :class:`aoti_sessions.Engine`)."""
        return self._engine

    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    @property
    def resident(self) -> bool:
        """Whether the state is in device memory (False while offloaded, or closed)."""
        return bool(self._core.resident)

    @property
    def discardable(self) -> bool:
        """Whether the engine may close this session when it needs room: the
        least recently used idle discardable session is closed before any
        session is offloaded under ``memory_budget``, instead of refusing a
        new session at ``max_sessions``, and at ``idle_timeout`` (a prefix
        cache's copies, which nobody's conversation holds). Never while a
        call holds it; forks are not discardable."""
        return bool(self._core.discardable)

    @discardable.setter
    def discardable(self, value: bool) -> None:
        self._core.discardable = bool(value)

    @property
    def last_use(self) -> float:
        """When the session was last used (created, run, reset, written,
        restored), in seconds of :func:`time.monotonic`."""
        return float(self._core.last_use)

    def offload(self) -> None:
        """Move the state to host memory (pinned on CUDA) and release its
        device memory. The next run, or :meth:`restore`, brings it back
        bit-identical. Raises CapacityError if ``host_budget`` is full."""
        self._core.offload(self._engine._stream())

    def restore(self) -> None:
        """Bring an offloaded state back to device memory (offloading idle
        sessions first if ``memory_budget`` requires it). No-op if resident."""
        self._core.restore(self._engine._stream())

    def save(self, path: str | os.PathLike[str], attachment: bytes = b"") -> None:
        """Write the state to ``path`` for :meth:`Engine.load_session`, in any
        process. Atomic: a temporary file is written, fsynced and renamed over
        ``path`` (a folder, device or FIFO there is refused, never replaced).
        Every buffer is checksummed and the header fingerprints the model
        (buffer FQNs, dtypes, shapes; each method's library and weights).
        ``attachment`` (up to 16 MiB) is written inside the same file, under
        the header's checksum: what the caller keeps with the state (an LLM
        chat's tokens), given back by :meth:`Engine.load_session_attached`."""
        _check_attachment(attachment)
        self._core.save(os.fspath(path), attachment, self._engine._stream())

    def snapshot(self) -> Snapshot:
        """A host copy of the state as it is now, to be written later with
        :meth:`Snapshot.write` (on any thread): the session is held only
        while its state is copied out, and runs on while the file is
        written (a checkpoint off its path). ``save`` is ``snapshot`` then
        ``write``. The copy takes host memory of the state's size (pinned
        on CUDA) until the snapshot is dropped."""
        return Snapshot(self._core.snapshot(self._engine._stream()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the engine's only method."""
        call = self._engine._only
        if call is None:
            methods = self._engine._methods
            raise TypeError(
                f"this engine has {len(methods)} methods ({', '.join(methods)}); use session.run(name, ...)"
            )
        return self._run(call, args, kwargs)

    def run(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on this session's state, returning what the model returns."""
        call = self._engine._methods.get(method)
        if call is None:
            raise ValueError(
                f"unknown method {shown(method)}; this engine has: {', '.join(self._engine._methods)}"
            )
        return self._run(call, args, kwargs)

    def _run(self, call: MethodCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The per-step path: one call into the core, the handles made and
        # taken by torch's own C functions.
        flat = call.flatten(args, kwargs)
        outputs = from_handles(self._core.run(call.index, to_handles(flat), self._engine._stream()))
        return outputs[0] if call.single_output else call.outputs(outputs)

    def reset(self) -> None:
        """Return to the initial state."""
        self._core.reset(self._engine._stream())

    def fork(self) -> Session:
        """A new session whose state is a copy of this one's (counts against capacity)."""
        return Session(self._engine, self._core.fork(self._engine._stream()))

    @property
    def length(self) -> int:
        """Positions the session holds (pooled state; 0 without)."""
        return int(self._core.length)

    def truncate(self, length: int) -> None:
        """Pooled state: forget the positions from ``length`` on (a rewind:
        nothing is copied; pages wholly past it are released). A session
        with a slot (recurrent state, which every position went into)
        rewinds only to one of its :attr:`checkpoints` (its slot copy comes
        back; later checkpoints go); to any other length: ValueError."""
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        self._core.truncate(length, self._engine._stream())

    def checkpoint(self, keep: int = 2) -> None:
        """Slot state (recurrent): keep a copy of it at the session's current
        length, so :meth:`truncate` can rewind there; at most ``keep``
        checkpoints stay, the oldest going first. Each costs one slot of
        device memory, counted as the session's; an offload, a reset or
        :meth:`load_state` drops them, and forks and saves do not carry
        them. ValueError on an engine without slot state."""
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise TypeError(f"keep must be an int, got {type(keep).__name__}")
        self._core.checkpoint(keep, self._engine._stream())

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """The lengths the session has checkpoints at, ascending."""
        return tuple(self._core.checkpoints)

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of every mutable buffer, by FQN, on the engine's device: one
        consistent snapshot, even while other threads run this session. With
        pooled state: the session's part of each pooled tensor by name
        (``[units, ...]``), as a :class:`PooledState` that also says the
        session's ``length``."""
        if self._engine._core.pool is not None:
            handles, length = self._core.read_pool(self._engine._stream())
            names = [t.name for t in self._engine._core.pool.tensors]
            return PooledState(zip(names, from_handles(handles)), length=int(length))
        buffers = self._engine._buffers
        out = {b.fqn: torch.empty_strided(b.sizes, b.strides, dtype=getattr(torch, b.dtype),
                                          device=self._engine.device) for b in buffers}
        self._core.read_buffers(to_handles(list(out.values())), self._engine._stream())
        return out

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the whole state with ``state`` (as returned by :meth:`state`).

        Every buffer must be given with its dtype and shape; nothing is written
        unless all of them are valid. Tensors on the host or with other strides
        are copied to the engine's layout first.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of FQN to Tensor, got {type(state).__name__}")
        if self._engine._core.pool is not None:
            return self._load_pooled(state)
        layouts = {b.fqn: b for b in self._engine._buffers}
        device = self._engine.device
        names, sources = [], []
        for fqn, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state['{fqn}'] is a {type(t).__name__}, expected a Tensor")
            b = layouts.get(fqn)
            # Copied to the engine's layout only where that is a plain copy;
            # anything else goes to the core as it is, which says what is wrong.
            if b is not None and _dense(t) and str(t.dtype).removeprefix("torch.") == b.dtype \
                    and list(t.shape) == b.sizes and t.device.type in ("cpu", device.type) \
                    and (t.device != device or list(t.stride()) != b.strides):
                t = torch.empty_strided(b.sizes, b.strides, dtype=t.dtype, device=device).copy_(t)
            names.append(str(fqn))
            sources.append(t)
        self._core.write_buffers(names, to_handles(sources), self._engine._stream())

    def _load_pooled(self, state: Mapping[str, torch.Tensor]) -> None:
        length = getattr(state, "length", None)
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError("the state of a pooled engine is a PooledState (as state() returns it), which says "
                            "the session's length")
        names, sources = [], []
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state['{name}'] is a {type(t).__name__}, expected a Tensor")
            names.append(str(name))
            sources.append(t.contiguous() if _dense(t) else t)
        self._core.write_pool(names, to_handles(sources), length, self._engine._stream())

    def close(self) -> None:
        """Release the state. Waits for a run of this session in flight; idempotent."""
        self._core.close()

    def __repr__(self) -> str:
        where = "closed" if self.closed else ("resident" if self.resident else "offloaded")
        return f"Session(id={self.id}, {where})"


class Snapshot:
    """A host copy of a session's state at one moment (:meth:`Session.snapshot`)."""

    def __init__(self, core: _core.SessionSnapshot) -> None:
        self._core = core

    @property
    def nbytes(self) -> int:
        """Bytes of state it holds."""
        return int(self._core.nbytes)

    def write(self, path: str | os.PathLike[str], attachment: bytes = b"") -> None:
        """Write it to ``path`` as :meth:`Session.save` writes the state
        (atomically, checksummed, with ``attachment``), for
        :meth:`Engine.load_session`. May be called again, for another file."""
        _check_attachment(attachment)
        self._core.write(os.fspath(path), attachment)


def _check_attachment(attachment: object) -> None:
    if not isinstance(attachment, bytes):
        raise TypeError(f"attachment must be bytes, got {type(attachment).__name__}")
