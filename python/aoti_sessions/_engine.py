"""Engine: the documented Python API over the C++ core's engine. This layer
turns Python arguments into the core's typed options (types and 64-bit range
here; every rule on the values is the core's) and the core's typed results
into the dictionaries docs/python-api.md documents."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import aoti_sessions._core as _core
from ._graphs import TorchGraphHost
from ._methods import ModelSource, describe, method_source, resolve_methods, trust_option
from ._session import Closable, MethodCall, Session, from_handles, to_handles
from ._signature import signature
from ._words import first_names, shown
from .errors import PackageError

__all__ = ["Engine", "Session"]

log = logging.getLogger("aoti_sessions")
_NAMES_LOGGED = 8  # a log line lists this many names, then how many more


def _names(names: list[str]) -> str:
    """``names`` for a log line: all of a few, else the first ones and a count."""
    if len(names) <= _NAMES_LOGGED:
        return ", ".join(names)
    return f"{len(names)} buffers: {first_names(names, _NAMES_LOGGED)} (Engine.mutable_fqns lists all)"


_INT64 = (-(2**63), 2**63 - 1)
_IDLE_ACTIONS = {"offload": _core.IdleAction.OFFLOAD, "close": _core.IdleAction.CLOSE}


def _torch_leaks_bind_handles() -> bool:
    """Whether this torch leaks a tensor handle per user-managed bind.

    Every release from 2.10 through 2.14.1 does (docs/aoti-runtime.md); a
    torch that fixes it (pytorch PR #194480) would turn our reclaim into a
    double free, so versions after the last one seen leaking are not reclaimed:
    a leak is recoverable, a double free is not.
    """
    release = torch.__version__.split("+")[0]
    parts = tuple(int(x) for x in release.split(".")[:3] if x.isdigit())
    return parts <= (2, 14, 1)


def _int_option(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{name}={value} does not fit a 64-bit integer")
    return value


def _seconds_option(name: str, value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(value).__name__}")
    return float(value)


_GRAPH_MODES = {"auto": _core.GraphMode.AUTO, True: _core.GraphMode.ON, False: _core.GraphMode.OFF}


def _graph_mode(value: object) -> _core.GraphMode:
    if isinstance(value, bool) or value == "auto":
        return _GRAPH_MODES[value]
    raise ValueError(f"cuda_graphs must be 'auto', True or False, got {value!r}")


def _device(device: object) -> torch.device:
    """The engine's device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
    torch.device of those kinds (ValueError / TypeError otherwise, before
    torch is asked)."""
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {shown(device)}") from None
    else:
        raise TypeError(f"device must be a str ('cpu', 'cuda', 'cuda:N') or a torch.device, got "
                        f"{type(device).__name__}")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"aoti_sessions runs models on 'cpu' or 'cuda', not {parsed.type!r}")
    return parsed


def _options(device: str, mutable: Sequence[str] | None, max_sessions: object, memory_budget: object,
             host_budget: object, idle_timeout: object, idle_action: str,
             strict_weights: bool, lanes: object = None, cuda_graphs: object = "auto",
             graph_output_views: bool = False) -> _core.EngineOptions:
    options = _core.EngineOptions()
    options.device = device
    if isinstance(mutable, str):
        raise TypeError("mutable must be a sequence of FQNs or patterns, not a single string")
    options.mutable_patterns = None if mutable is None else [str(m) for m in mutable]
    options.max_sessions = _int_option("max_sessions", max_sessions)
    options.memory_budget = _int_option("memory_budget", memory_budget)
    options.host_budget = _int_option("host_budget", host_budget)
    options.idle_timeout = _seconds_option("idle_timeout", idle_timeout)
    if idle_action not in _IDLE_ACTIONS:
        raise ValueError(f"idle_action must be 'offload' or 'close', got {idle_action!r}")
    options.idle_action = _IDLE_ACTIONS[idle_action]
    options.strict_weights = bool(strict_weights)
    options.reclaim_bind_handles = _torch_leaks_bind_handles()
    options.lanes = _int_option("lanes", lanes)
    options.cuda_graphs = _graph_mode(cuda_graphs)
    options.graph_output_views = bool(graph_output_views)
    return options


def _as_dict(obj: Any, fields: Sequence[str]) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in fields}


_LAYOUT = ("fqn", "dtype", "sizes", "strides", "bytes")
_MEMORY = ("weights", "templates", "sessions", "containers", "offloaded", "host_spare", "pool")
_STATS = ("live_sessions", "live_bytes", "resident_sessions", "offloaded_sessions", "device_bytes", "host_bytes",
          "host_spare_bytes", "sessions_created", "offloads", "evictions", "idle_offloads", "idle_closes", "discards",
          "restores", "saves", "loads", "runs", "binds", "bind_seconds", "reclaim_seconds", "lanes", "graph_replays",
          "graph_captures", "graphs", "graph_pools", "pool_pages", "pool_pages_used", "pool_slots", "pool_slots_used",
          "pool_grows", "pages_copied", "batch_runs", "batch_rows", "batch_seconds")


class Engine(Closable):
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
        lanes: containers per method, all sharing the weights (default 4). A session keeps the lane it last ran on bound to
            its state until another session needs it (least recently used
            first), so switching among up to ``lanes`` sessions binds nothing,
            and up to ``lanes`` sessions run at once (on their own streams).
        cuda_graphs: ``"auto"`` (default): on CUDA, a session's run of a
            method is captured into a CUDA graph of its own (after 3 eager
            warm-up runs of the method on that stream, one of them on the
            capturing thread: torch makes cuBLAS and cuDNN state lazily per
            thread, which a capture cannot contain) and replayed from then
            on; a method that cannot be captured (dynamic input shapes, a host
            synchronisation inside) runs eagerly, logged once. ``True``: the
            same, but such a method raises. ``False``: always eager. A graph
            is recaptured after its session moved (restore, eviction), after a
            double-buffered weight update, or when run on another stream.
        graph_output_views: with CUDA graphs, return the graph's own output
            tensors (no copy) instead of fresh copies. Graphs replayed on one
            stream share their memory: such a view is valid until the next
            graph run on that stream, of any session.
        trust_op_modules: op modules (``op_modules.json``) the package may have imported: by default only
            installed transformers' and aoti_sessions' (docs/safety.md: "A package is code"); names: those too; True: any.

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
        lanes: int | None = None,
        cuda_graphs: bool | str = "auto",
        graph_output_views: bool = False,
        trust_op_modules: bool | Sequence[str] = False,
    ) -> None:
        self._device = _device(device)
        if self._device.type == "cuda" and self._device.index is None and torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
        options = _options(str(self._device), mutable, max_sessions, memory_budget, host_budget, idle_timeout,
                           idle_action, strict_weights, lanes, cuda_graphs, graph_output_views)
        files = resolve_methods(model)
        for f in files:
            if f.device_key is not None and f.device_key != self._device.type:
                raise PackageError(
                    f"method '{f.name}' was compiled for {f.device_key}, but the engine's device is {self._device}"
                )
        docs = [f.metadata for f in files]
        options.known_mutated = sorted({fqn for d in docs if d and d.mutable_buffers for fqn in d.mutable_buffers})
        declared = all(d is not None and d.mutable_buffers is not None for d in docs)
        if mutable is not None:
            source = "mutable="
        elif declared:
            options.mutable_patterns = options.known_mutated
            source = "package metadata"
        else:
            source = "every buffer (no declaration in the package; pass mutable= to choose)"
        sources = [method_source(f, self._device, trust_option(trust_op_modules)) for f in files]
        # The raw handle of torch's current stream (0 on the CPU), without
        # building a Stream object: what every call into the core passes.
        if self._device.type == "cuda":
            self._stream: Callable[[], int] = functools.partial(
                torch._C._cuda_getCurrentRawStream, self._device.index)
        else:
            self._stream = int  # int() == 0: no stream
        host = TorchGraphHost(self._device) if self._device.type == "cuda" and cuda_graphs is not False else None
        self._core = _core.Engine(sources, options, host)
        for note in self._core.load_notes:
            log.warning("%s", note)
        self._buffers = self._core.mutable_buffers
        self._methods = {f.name: describe(self._core, f, src) for f, src in zip(files, sources)}
        self._files = {f.name: f for f in files}
        # What `session(...)` calls: the only method (None with several).
        self._only: MethodCall | None = next(iter(self._methods.values())) if len(self._methods) == 1 else None
        fqns = [b.fqn for b in self._buffers]
        pool = self.pool
        if pool is not None:
            log.info("pooled state: %s", ", ".join(f"{t['name']} ({t['kind']})" for t in pool["tensors"]))
            return
        level = logging.WARNING if options.mutable_patterns is None or not fqns else logging.INFO
        log.log(level, "mutable state from %s: %s", source, _names(fqns) or "none (stateless model)")

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
        """FQNs of the per-session state (none with pooled state: see :attr:`pool`)."""
        return tuple(b.fqn for b in self._buffers)

    @property
    def pool(self) -> dict[str, Any] | None:
        """The pooled state (docs/batching.md), if the package keeps one:
        ``page_size``, ``max_pages``, ``max_positions`` (positions a session
        holds at most), ``max_rows`` (sessions one batched call takes at
        most), ``page_bytes``, ``slot_bytes`` and ``tensors`` (name, kind,
        dtype, unit_sizes, unit_bytes each)."""
        layout = self._core.pool
        if layout is None:
            return None
        out = _as_dict(layout, ("page_size", "max_pages", "max_positions", "max_rows", "page_bytes", "slot_bytes"))
        out["tensors"] = [{**_as_dict(t, ("name", "dtype", "unit_sizes", "unit_bytes")),
                           "kind": "pages" if t.kind == _core.PoolKind.PAGES else "slots"} for t in layout.tensors]
        return out

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

    def signature(self, method: str | None = None) -> str:
        """``method``'s call signature (default: the only method) as one line:
        input names, dtypes and shapes (dynamic dimensions by symbol, with
        their bounds), outputs, e.g. ``decode(input_ids: int64[1, 1],
        cache_position: int64[1]) -> float32[1, 128]``. Inputs before ``/``
        are positional only; keyword inputs may also be given by position."""
        if method is None:
            if self._only is None:
                raise TypeError(f"this engine has {len(self._methods)} methods ({', '.join(self._methods)}); "
                                "name one")
            method = self._only.name
        call = self._call(method)
        return signature(method, call.in_spec, call.out_spec, self._core.num_inputs(call.index),
                         self._files[method].metadata)

    def output_sizes(self, method: str) -> list[list[int | None]] | None:
        """The sizes of each tensor ``method`` returns, as the package
        recorded them (``None``: a dynamic dimension), or None where the
        package recorded none (made by other tools)."""
        self._call(method)
        metadata = self._files[method].metadata
        outputs = metadata.outputs if metadata is not None else None
        return None if outputs is None else [list(o.sizes) for o in outputs]

    def captures(self, method: str) -> bool:
        """Whether runs of ``method`` are captured into CUDA graphs (replayed
        after that); False on the CPU, with ``cuda_graphs=False``, or once a
        capture failed under ``"auto"``. A pooled method's batches are
        captured per padded row count and shape: a caller feeding varying
        lengths pads them to a few sizes (the LLM scheduler: powers of two)."""
        return bool(self._core.captures(self._call(method).index))

    def _call(self, method: str) -> MethodCall:
        call = self._methods.get(method)
        if call is None:
            raise ValueError(f"unknown method {shown(method)}; this engine has: {', '.join(self._methods)}")
        return call

    def weights(self) -> list[dict[str, Any]]:
        """Descriptor of every held weight: fqn, dtype, sizes, strides, bytes, methods."""
        return [_as_dict(w, (*_LAYOUT, "methods")) for w in self._core.weights()]

    def buffers(self) -> list[dict[str, Any]]:
        """Descriptor of every mutable buffer: fqn, dtype, sizes, strides, bytes,
        zero_initial, methods."""
        return [_as_dict(b, (*_LAYOUT, "zero_initial", "methods")) for b in self._buffers]

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes by holder in device and host memory: weights, templates,
        sessions (resident state), containers; offloaded (state moved to the
        host) and host_spare (host blocks kept for the next offload or save).
        On a CPU engine the device is host memory: all is host."""
        here = _as_dict(self._core.memory_report(), _MEMORY)
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
        self._core.update_weights(names, to_handles(tensors), bool(double_buffer))

    def stats(self) -> dict[str, Any]:
        """Counters and where every session is; cheap (no session is waited for).

        - ``live_sessions`` = ``resident_sessions`` + ``offloaded_sessions``;
          ``live_bytes`` = ``device_bytes`` + ``host_bytes`` (state in each tier;
          ``device_bytes`` includes creations and restores in flight);
          ``host_spare_bytes``: host blocks kept for reuse.
        - ``offloads`` (every move to the host) of which ``evictions`` (to make room) and
          ``idle_offloads``; ``idle_closes``; ``discards`` (discardable sessions closed); ``restores``;
          ``saves``; ``loads``; ``sessions_created``; ``runs``; ``binds``, ``bind_seconds``, ``reclaim_seconds``.
        - ``lanes`` (containers per method); CUDA graphs: ``graph_captures``,
          ``graph_replays`` (runs served by a replay), ``graphs`` (alive now)
          and ``graph_pools`` (activation pools, one per capture stream).
        - Pooled state: ``pool_*``, ``pages_copied``; ``batch_runs``, ``batch_rows``, ``batch_seconds`` (no GIL).
        - ``sessions``: per open session ``id``, ``resident``, ``bytes`` and
          ``last_use`` (seconds of :func:`time.monotonic`).
        """
        stats = self._core.stats()
        out = _as_dict(stats, _STATS)
        out["sessions"] = [_as_dict(s, ("id", "resident", "bytes", "last_use")) for s in stats.sessions]
        return out

    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    # -- sessions --------------------------------------------------------
    def new_session(self) -> Session:
        """A new session in the initial state. Raises CapacityError when full."""
        return Session(self, self._core.new_session(self._stream()))

    def run_batch(self, method: str, sessions: Sequence[Session], /, *args: Any, **kwargs: Any) -> Any:
        """Run pooled ``method`` once over ``sessions``, one row each, in order:
        the weights are read once for all of them, each row reads and writes
        only its own session's state. The inputs have the rows first (say
        ``input_ids[len(sessions), 1]``); so do the outputs. Each session is
        restored first if offloaded and holds the positions fed afterwards."""
        call = self._call(method)
        if isinstance(sessions, Session) or not isinstance(sessions, Sequence) \
                or not all(isinstance(s, Session) for s in sessions):
            raise TypeError("sessions must be a sequence of Session")
        # The core checks that the method is pooled and the sessions this engine's.
        cores = [s._core for s in sessions]
        flat = call.flatten(args, kwargs)
        outputs = from_handles(self._core.run_batch(cores, call.index, to_handles(flat), self._stream()))
        return outputs[0] if call.single_output else call.outputs(outputs)

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

    def load_session_attached(self, path: str | os.PathLike[str], *, strict: bool = True) -> tuple[Session, bytes]:
        """:meth:`load_session`, and the attachment saved with the state
        (:meth:`Session.save`; ``b""`` where none was), read from the same
        file: the two always belong together."""
        core, attachment = self._core.load_session_attached(os.fspath(path), bool(strict), self._stream())
        return Session(self, core), bytes(attachment)

    def close(self) -> None:
        """Close every session (waiting for runs in flight) and release the model."""
        self._core.close()

    def __repr__(self) -> str:
        return (f"Engine(methods={list(self.methods)}, device='{self._device}', "
                f"mutable={len(self._buffers)} buffers, bytes_per_session={self.bytes_per_session})")
