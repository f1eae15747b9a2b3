"""Engine and Session: the documented Python API over the C++ core."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from typing_extensions import Self

import torch
import torch.utils._pytree as pytree

from . import _core
from ._package import MethodFiles, open_model
from .errors import PackageError, SessionClosedError

__all__ = ["Engine", "Session"]

log = logging.getLogger("aoti_sessions")

ModelSource = str | os.PathLike[str]

# Tensors <-> owning AtenTensorHandle capsules, the only way tensors cross into
# the core (which links no torch C++ API).
_to_handles: Callable[[list[torch.Tensor]], list[Any]] = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
_from_handles: Callable[[list[Any]], list[torch.Tensor]] = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs


def _torch_leaks_bind_handles() -> bool:
    """Whether this torch leaks a tensor handle per user-managed bind.

    Every release from 2.10 through 2.14.1 does (aoti-facts.md); a torch that
    fixes it (pytorch PR #194480) would turn our reclaim into a double free, so
    versions after the last one seen leaking are not reclaimed: a leak is
    recoverable, a double free is not.
    """
    release = torch.__version__.split("+")[0]
    parts = tuple(int(x) for x in release.split(".")[:3] if x.isdigit())
    return parts <= (2, 14, 1)


class _Closable:
    """`with x:` closes x on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True)
class _Method:
    name: str
    index: int
    in_spec: pytree.TreeSpec | None
    out_spec: pytree.TreeSpec | None
    # Positional-only tensor inputs, no kwargs: inputs need no flattening.
    flat_call: bool
    # Per input: whether it must be contiguous (the container indexes it so).
    contiguous: tuple[bool, ...] | None


def _input_specs(method: MethodFiles, doc: Mapping[str, Any] | None) -> list[_core.InputSpec] | None:
    if doc is None or "inputs" not in doc:
        return None
    specs = []
    for i, entry in enumerate(doc["inputs"]):
        spec = _core.InputSpec()
        code = _core.dtype_code(entry["dtype"])
        if code < 0:
            raise PackageError(f"method '{method.name}': input {i} has unknown dtype {entry['dtype']}")
        spec.dtype = code
        spec.sizes = [-1 if s is None else int(s) for s in entry["sizes"]]
        spec.strides = [] if entry.get("strides") is None else [int(s) for s in entry["strides"]]
        if spec.strides and len(spec.strides) != len(spec.sizes):
            raise PackageError(f"method '{method.name}': input {i} has {len(spec.sizes)} sizes "
                               f"but {len(spec.strides)} strides")
        specs.append(spec)
    return specs


def _weight_entries(method: MethodFiles) -> list[tuple[str, int, list[int], list[int], int, int]]:
    out = []
    for e in method.weights:
        code = _core.dtype_code(e["dtype"])
        if code < 0:
            raise PackageError(f"method '{method.name}': weight {e['fqn']} has unknown dtype {e['dtype']}")
        out.append((str(e["fqn"]), code, [int(x) for x in e["sizes"]], [int(x) for x in e["strides"]],
                    int(e["offset"]), int(e["nbytes"])))
    return out


def _resolve_methods(model: ModelSource | Mapping[str, ModelSource]) -> list[MethodFiles]:
    if isinstance(model, Mapping):
        if not model:
            raise ValueError("model mapping is empty: give at least one method")
        methods = []
        for name, path in model.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"method names must be non-empty strings, got {name!r}")
            found = open_model(path)
            if len(found) != 1:
                raise PackageError(
                    f"method '{name}': {path} holds {len(found)} models "
                    f"({', '.join(m.name for m in found)}); give a package with one"
                )
            f = found[0]
            methods.append(MethodFiles(name, f.library, f.cubin_dir, f.device_key, f.metadata,
                                       f.weights_file, f.weights))
        return methods
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or a mapping of method names to paths, got {type(model).__name__}")
    return open_model(model)


class Engine(_Closable):
    """One compiled model loaded once, serving isolated sessions.

    Args:
        model: a ``.pt2`` package or ``.so`` library (its models become the
            methods), or a mapping of method names to such files, one model each.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; must match the packages.
        mutable: FQNs or glob patterns of the per-session state. Default: what
            ``ais.compile`` recorded in the package, else every buffer (logged).
        max_sessions: at most this many open sessions (resident or offloaded).
        memory_budget: at most this many bytes of session state on the device.
            Creating or restoring a session beyond it first offloads the least
            recently used idle session to host memory; a session in use (a
            call on it in progress) is never evicted, the caller waits for one
            to finish instead.
        host_budget: at most this many bytes of offloaded state in host memory
            (pinned on CUDA). ``None``: unlimited; ``0``: never offload, so a
            full ``memory_budget`` raises :class:`CapacityError`.
        idle_timeout: seconds after which an idle session is offloaded (or
            closed, with ``idle_action="close"``) by a background thread.
        idle_action: ``"offload"`` or ``"close"``.
        strict_weights: refuse methods that disagree on a weight (same FQN,
            other layout or content) instead of keeping both copies (logged).

    Each weight is held once, whatever the number of methods: libraries
    compiled without weights (multi-method ``ais.compile``) bind to the
    package's weights file loaded straight into the engine's memory; libraries
    with embedded weights bind to the first method's copy, and the duplicate
    copies of later methods are freed after binding.
    """

    def __init__(
        self,
        model: ModelSource | Mapping[str, ModelSource],
        device: str | torch.device = "cpu",
        mutable: Sequence[str] | None = None,
        max_sessions: int | None = None,
        memory_budget: int | None = None,
        strict_weights: bool = False,
        host_budget: int | None = None,
        idle_timeout: float | None = None,
        idle_action: str = "offload",
    ) -> None:
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None and torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
        device_str = str(self._device)
        if isinstance(mutable, str):
            raise TypeError("mutable must be a sequence of FQNs or patterns, not a single string")
        for name, value in (("max_sessions", max_sessions), ("memory_budget", memory_budget),
                            ("host_budget", host_budget)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
        if idle_timeout is not None:
            if not isinstance(idle_timeout, (int, float)) or isinstance(idle_timeout, bool):
                raise TypeError(f"idle_timeout must be a number of seconds or None, got {type(idle_timeout).__name__}")
            if not (idle_timeout > 0 and math.isfinite(idle_timeout)):
                raise ValueError(f"idle_timeout must be > 0 seconds and finite, got {idle_timeout}")
        if idle_action not in ("offload", "close"):
            raise ValueError(f"idle_action must be 'offload' or 'close', got {idle_action!r}")
        files = _resolve_methods(model)
        docs = [f.sessions_metadata() for f in files]
        for f in files:
            if f.device_key is not None and f.device_key != self._device.type:
                raise PackageError(
                    f"method '{f.name}' was compiled for {f.device_key}, "
                    f"but the engine's device is {device_str}"
                )
        known_mutated = sorted({str(fqn) for d in docs if d for fqn in d.get("mutable_buffers", [])})
        declared = all(d is not None and "mutable_buffers" in d for d in docs)
        if mutable is not None:
            patterns: list[str] | None = list(mutable)
            source = "mutable="
        elif declared:
            patterns = known_mutated
            source = "package metadata"
        else:
            patterns = None
            source = "every buffer (no declaration in the package; pass mutable= to choose)"

        sources = []
        for f, doc in zip(files, docs):
            src = _core.MethodSource()
            src.name = f.name
            src.library_path = f.library
            src.cubin_dir = f.cubin_dir
            src.inputs = _input_specs(f, doc)
            if f.weights_file is not None:
                src.set_weights_file(f.weights_file, _weight_entries(f))
            sources.append(src)
        self._core = _core.Engine(
            sources,
            device_str,
            patterns,
            known_mutated,
            -1 if max_sessions is None else max_sessions,
            -1 if memory_budget is None else memory_budget,
            _torch_leaks_bind_handles(),
            bool(strict_weights),
            -1 if host_budget is None else host_budget,
            0.0 if idle_timeout is None else float(idle_timeout),
            idle_action == "close",
        )
        for note in self._core.load_notes:
            log.warning("%s", note)
        self._buffers = self._core.mutable_buffers
        self._methods: dict[str, _Method] = {}
        for f, src in zip(files, sources):
            self._methods[f.name] = self._describe(f.name, src)
        fqns = [b["fqn"] for b in self._buffers]
        level = logging.WARNING if patterns is None or not fqns else logging.INFO
        log.log(level, "mutable state from %s: %s", source, ", ".join(fqns) or "none (stateless model)")

    def _describe(self, name: str, source: _core.MethodSource) -> _Method:
        index = self._core.method_index(name)
        in_raw, out_raw = self._core.call_spec(index)
        in_spec = pytree.treespec_loads(in_raw) if in_raw else None
        out_spec = pytree.treespec_loads(out_raw) if out_raw else None
        n = self._core.num_inputs(index)
        flat_call = in_spec is not None and in_spec == pytree.tree_structure((tuple(range(n)), {}))
        contiguous = None
        if source.inputs is not None:
            contiguous = tuple(len(s.strides) == 0 for s in source.inputs)
        return _Method(name, index, in_spec, out_spec, flat_call, contiguous)

    # -- properties ------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def methods(self) -> tuple[str, ...]:
        """Method names, in load order."""
        return tuple(self._methods)

    @property
    def mutable_fqns(self) -> tuple[str, ...]:
        """FQNs of the per-session state."""
        return tuple(b["fqn"] for b in self._buffers)

    @property
    def bytes_per_session(self) -> int:
        """Device bytes of one session's state (all buffers, 256-byte aligned)."""
        return int(self._core.bytes_per_session)

    @property
    def template_bytes(self) -> int:
        """Bytes of initial-state templates; all-zero initial values cost none."""
        return int(self._core.template_bytes)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held: each distinct weight once, whatever the methods."""
        return int(self._core.weight_bytes)

    def weights(self) -> list[dict[str, Any]]:
        """Descriptor of every held weight: fqn, dtype, sizes, strides, bytes, methods."""
        return [dict(w) for w in self._core.weights()]

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes by holder in device and host memory: weights, templates,
        sessions (resident state), containers; offloaded (state moved to the
        host) and host_spare (host blocks kept for the next offload or save).
        On a CPU engine the device is host memory: all is host."""
        here = {k: int(v) for k, v in self._core.memory_report().items()}
        zero = dict.fromkeys(here, 0)
        if self._device.type == "cpu":
            return {"device": zero, "host": here}
        host_only = ("offloaded", "host_spare")
        device = {k: (0 if k in host_only else v) for k, v in here.items()}
        host = {k: (v if k in host_only else 0) for k, v in here.items()}
        return {"device": device, "host": host}

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, double_buffer: bool = False) -> None:
        """Copy new weight values from CPU tensors (pinned or pageable) into the
        held weights; sessions' state is untouched.

        Every tensor is checked (a weight of this engine, dtype, shape, strides,
        on the CPU) before anything is written. In place (default) it waits for
        runs in flight and blocks new ones until done; ``double_buffer=True``
        fills new memory while sessions keep running and switches every method
        to it at once, so no run sees a mix. Either way a run sees the old or
        the new weights.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of FQN to Tensor, got {type(state_dict).__name__}")
        names, tensors = [], []
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weight '{name}': expected a Tensor, got {type(t).__name__}")
            names.append(str(name))
            tensors.append(t.detach())
        self._core.update_weights(names, _to_handles(tensors), bool(double_buffer))

    def buffers(self) -> list[dict[str, Any]]:
        """Descriptor of every mutable buffer: fqn, dtype, sizes, strides, bytes, methods."""
        return [dict(b) for b in self._buffers]

    def stats(self) -> dict[str, Any]:
        """Counters and where every session is; cheap (no session is waited for).

        - ``live_sessions`` = ``resident_sessions`` + ``offloaded_sessions``;
          ``live_bytes`` = ``device_bytes`` + ``host_bytes`` (state in each tier;
          ``device_bytes`` includes creations and restores in flight);
          ``host_spare_bytes``: host blocks kept for reuse.
        - ``offloads`` (every move to the host) of which ``evictions`` (to make
          room) and ``idle_offloads``; ``idle_closes``; ``restores``; ``saves``;
          ``loads``; ``sessions_created``; ``runs``; ``binds``, ``bind_seconds``,
          ``reclaim_seconds``.
        - ``sessions``: per open session ``id``, ``resident``, ``bytes`` and
          ``last_use`` (seconds of :func:`time.monotonic`).
        """
        return dict(self._core.stats())

    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    # -- sessions --------------------------------------------------------
    def _stream(self) -> int:
        if self._device.type == "cuda":
            # The raw handle of torch's current stream, without building a Stream object.
            return int(torch._C._cuda_getCurrentRawStream(self._device.index))
        return 0

    def new_session(self) -> Session:
        """A new session in the initial state. Raises CapacityError when full."""
        return Session(self, self._core.new_session(self._stream()))

    def load_session(self, path: str | os.PathLike[str], *, strict: bool = True) -> Session:
        """A new session holding the state saved by :meth:`Session.save`.

        The whole file is checked (header, every buffer's checksum, and that it
        was saved from this model) before anything is allocated. Raises
        :class:`SessionFileNotFoundError`, :class:`SessionFileError` (truncated,
        corrupted, not a session file, other format version) or
        :class:`ModelMismatchError` (other buffers; with ``strict`` also other
        compiled libraries or weights: ``strict=False`` accepts any model whose
        buffers have the same FQNs, dtypes and shapes).
        """
        return Session(self, self._core.load_session(os.fspath(path), bool(strict), self._stream()))

    def close(self) -> None:
        """Close every session (waiting for runs in flight) and release the model."""
        self._core.close()

    def __repr__(self) -> str:
        return (f"Engine(methods={list(self.methods)}, device='{self._device}', "
                f"mutable={len(self._buffers)} buffers, bytes_per_session={self.bytes_per_session})")


class Session(_Closable):
    """One conversation's state on an :class:`Engine`; made by ``Engine.new_session``.

    Every method of the engine reads and writes the same session state. A
    session may be used and closed from any thread; its calls are serialised.
    """

    def __init__(self, engine: Engine, core: _core.Session) -> None:
        self._engine = engine
        self._core = core

    @property
    def id(self) -> int:
        return int(self._core.id)

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    @property
    def resident(self) -> bool:
        """Whether the state is in device memory (False while offloaded, or closed)."""
        return bool(self._core.resident)

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

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state to ``path`` for :meth:`Engine.load_session`, in any
        process. Atomic: a temporary file is written, fsynced and renamed over
        ``path``. Every buffer is checksummed and the header fingerprints the
        model (buffer FQNs, dtypes, shapes; each method's library and weights)."""
        self._core.save(os.fspath(path), self._engine._stream())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the engine's only method."""
        methods = self._engine._methods
        if len(methods) != 1:
            raise TypeError(
                f"this engine has {len(methods)} methods ({', '.join(methods)}); use session.run(name, ...)"
            )
        return self._run(next(iter(methods.values())), args, kwargs)

    def run(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on this session's state, returning what the model returns."""
        spec = self._engine._methods.get(method)
        if spec is None:
            raise ValueError(
                f"unknown method {method!r}; this engine has: {', '.join(self._engine._methods)}"
            )
        return self._run(spec, args, kwargs)

    def _run(self, method: _Method, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = method.name
        if method.flat_call and not kwargs:
            flat = list(args)
        else:
            flat = self._flatten(method, args, kwargs)
        contiguous = method.contiguous
        for i, x in enumerate(flat):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} of method '{name}' is a {type(x).__name__}, expected a Tensor")
            if contiguous is not None and i < len(contiguous) and contiguous[i] and not x.is_contiguous():
                flat[i] = x.contiguous()
        outputs = _from_handles(self._core.run(method.index, _to_handles(flat), self._engine._stream()))
        if method.out_spec is None:
            return outputs
        return pytree.tree_unflatten(outputs, method.out_spec)

    @staticmethod
    def _flatten(method: _Method, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        name = method.name
        if method.in_spec is None:
            if kwargs:
                raise TypeError(f"method '{name}' takes no keyword inputs")
            return list(args)
        try:
            ordered = torch.export._tree_utils.reorder_kwargs(kwargs, method.in_spec)
        except ValueError as e:
            raise TypeError(f"method '{name}': {e}") from None
        leaves, spec = pytree.tree_flatten((args, ordered))
        if spec != method.in_spec:
            raise TypeError(f"method '{name}' expects inputs structured as {method.in_spec}, got {spec}")
        # Non-tensor leaves were baked into the model at export, as torch's loader assumes.
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    def reset(self) -> None:
        """Return to the initial state."""
        self._core.reset(self._engine._stream())

    def fork(self) -> Session:
        """A new session whose state is a copy of this one's (counts against capacity)."""
        return Session(self._engine, self._core.fork(self._engine._stream()))

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of every mutable buffer, by FQN, on the engine's device."""
        self._check_open()
        out = {}
        stream = self._engine._stream()
        for i, b in enumerate(self._engine._buffers):
            dst = torch.empty_strided(b["sizes"], b["strides"], dtype=getattr(torch, b["dtype"]),
                                      device=self._engine.device)
            self._core.read_buffer(i, _to_handles([dst])[0], stream)
            out[b["fqn"]] = dst
        return out

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the whole state with ``state`` (as returned by :meth:`state`).

        Every buffer must be given with its dtype and shape; nothing is written
        unless all of them are valid.
        """
        self._check_open()
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of FQN to Tensor, got {type(state).__name__}")
        buffers = self._engine._buffers
        expected = [b["fqn"] for b in buffers]
        missing = [f for f in expected if f not in state]
        extra = [f for f in state if f not in expected]
        if missing or extra:
            raise ValueError(f"state does not match the engine's buffers: missing {missing}, unexpected {extra}")
        sources = []
        for b in buffers:
            t = state[b["fqn"]]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state['{b['fqn']}'] is a {type(t).__name__}, expected a Tensor")
            if str(t.dtype).removeprefix("torch.") != b["dtype"]:
                raise TypeError(f"state['{b['fqn']}'] has dtype {t.dtype}, expected {b['dtype']}")
            if list(t.shape) != list(b["sizes"]):
                raise ValueError(f"state['{b['fqn']}'] has shape {list(t.shape)}, expected {b['sizes']}")
            if t.device != self._engine.device or list(t.stride()) != list(b["strides"]):
                staged = torch.empty_strided(b["sizes"], b["strides"], dtype=t.dtype, device=self._engine.device)
                staged.copy_(t)
                t = staged
            sources.append(t)
        self._core.write_buffers(_to_handles(sources), self._engine._stream())

    def _check_open(self) -> None:
        # The core checks again under the session's lock; this only orders errors.
        if self._core.closed:
            raise SessionClosedError(f"session {self.id} is closed")

    def close(self) -> None:
        """Release the state. Waits for a run of this session in flight; idempotent."""
        self._core.close()

    def __repr__(self) -> str:
        where = "closed" if self.closed else ("resident" if self.resident else "offloaded")
        return f"Session(id={self.id}, {where})"
