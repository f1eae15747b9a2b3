"""
C++ core of aoti_sessions (private; use the aoti_sessions package)
"""
from __future__ import annotations
import collections.abc
import typing
import typing_extensions
__all__: list[str] = ['BufferInfo', 'Engine', 'EngineOptions', 'EngineStats', 'GraphMode', 'IdleAction', 'InputSpec', 'MemoryReport', 'MethodSource', 'PoolKind', 'PoolLayout', 'PoolSource', 'PooledInput', 'PooledTensor', 'Session', 'SessionSnapshot', 'SessionStats', 'WeightEntry', 'WeightInfo', 'WeightsFile', 'built_with_cuda', 'dtype_code', 'error_kinds']
class InputSpec:
    def __init__(self) -> None:
        ...
    @property
    def dtype(self) -> int:
        ...
    @dtype.setter
    def dtype(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def sizes(self) -> list[int]:
        ...
    @sizes.setter
    def sizes(self, arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        ...
    @property
    def strides(self) -> list[int]:
        ...
    @strides.setter
    def strides(self, arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        ...
class WeightEntry:
    """
    One tensor of a weights file.
    """
    def __init__(self, fqn: str, dtype: typing.SupportsInt | typing.SupportsIndex, sizes: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], strides: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], offset: typing.SupportsInt | typing.SupportsIndex, bytes: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def bytes(self) -> int:
        ...
    @property
    def fqn(self) -> str:
        ...
    @property
    def offset(self) -> int:
        ...
class WeightsFile:
    """
    A weights file and the entries one method reads.
    """
    path: str
    def __init__(self) -> None:
        ...
    @property
    def entries(self) -> list[WeightEntry]:
        ...
    @entries.setter
    def entries(self, arg0: collections.abc.Sequence[WeightEntry]) -> None:
        ...
class PoolKind:
    """
    What a unit of a pooled tensor is.
    
    Members:
    
      PAGES
    
      SLOTS
    """
    PAGES: typing.ClassVar[PoolKind]
    SLOTS: typing.ClassVar[PoolKind]
    __members__: typing.ClassVar[dict[str, PoolKind]]
    @typing.overload
    def __eq__(self, other: PoolKind) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: PoolKind) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class PooledInput:
    """
    An input of a method that is a pooled tensor.
    """
    def __init__(self, input: typing.SupportsInt | typing.SupportsIndex, name: str, kind: PoolKind) -> None:
        ...
    @property
    def input(self) -> int:
        ...
    @property
    def kind(self) -> PoolKind:
        ...
    @property
    def name(self) -> str:
        ...
class PoolSource:
    """
    How a method addresses the pooled state (input positions).
    """
    def __init__(self) -> None:
        ...
    @property
    def max_pages(self) -> int:
        ...
    @max_pages.setter
    def max_pages(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def max_rows(self) -> int:
        ...
    @max_rows.setter
    def max_rows(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def min_rows(self) -> int:
        ...
    @min_rows.setter
    def min_rows(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def page_size(self) -> int:
        ...
    @page_size.setter
    def page_size(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def page_table(self) -> int | None:
        ...
    @page_table.setter
    def page_table(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def positions(self) -> int | None:
        ...
    @positions.setter
    def positions(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def slot_ids(self) -> int | None:
        ...
    @slot_ids.setter
    def slot_ids(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def tensors(self) -> list[PooledInput]:
        ...
    @tensors.setter
    def tensors(self, arg0: collections.abc.Sequence[PooledInput]) -> None:
        ...
    @property
    def tokens(self) -> int:
        ...
    @tokens.setter
    def tokens(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class MethodSource:
    cubin_dir: str
    library_path: str
    name: str
    pool: PoolSource | None
    weights: WeightsFile | None
    def __init__(self) -> None:
        ...
    def set_proxy(self, call: collections.abc.Callable[[int, list[int], list[typing_extensions.CapsuleType]], list[tuple[typing.SupportsInt | typing.SupportsIndex, typing_extensions.CapsuleType]]]) -> None:
        """
        Runs the ops the library calls through AOTInductor's proxy executor with call(node, ints, tensors) -> [(argument index, result)] (aoti_sessions._proxy).
        """
    @property
    def inputs(self) -> list[InputSpec] | None:
        ...
    @inputs.setter
    def inputs(self, arg0: collections.abc.Sequence[InputSpec] | None) -> None:
        ...
class IdleAction:
    """
    Members:
    
      OFFLOAD
    
      CLOSE
    """
    CLOSE: typing.ClassVar[IdleAction]
    OFFLOAD: typing.ClassVar[IdleAction]
    __members__: typing.ClassVar[dict[str, IdleAction]]
    @typing.overload
    def __eq__(self, other: IdleAction) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: IdleAction) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class GraphMode:
    """
    Members:
    
      AUTO
    
      ON
    
      OFF
    """
    AUTO: typing.ClassVar[GraphMode]
    OFF: typing.ClassVar[GraphMode]
    ON: typing.ClassVar[GraphMode]
    __members__: typing.ClassVar[dict[str, GraphMode]]
    @typing.overload
    def __eq__(self, other: GraphMode) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: GraphMode) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class EngineOptions:
    """
    Options of an engine (checked by the core).
    """
    cuda_graphs: GraphMode
    device: str
    graph_output_views: bool
    idle_action: IdleAction
    reclaim_bind_handles: bool
    strict_weights: bool
    def __init__(self) -> None:
        ...
    @property
    def host_budget(self) -> int | None:
        ...
    @host_budget.setter
    def host_budget(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def idle_timeout(self) -> float | None:
        ...
    @idle_timeout.setter
    def idle_timeout(self, arg0: typing.SupportsFloat | typing.SupportsIndex | None) -> None:
        ...
    @property
    def known_mutated(self) -> list[str]:
        ...
    @known_mutated.setter
    def known_mutated(self, arg0: collections.abc.Sequence[str]) -> None:
        ...
    @property
    def lanes(self) -> int | None:
        ...
    @lanes.setter
    def lanes(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def max_sessions(self) -> int | None:
        ...
    @max_sessions.setter
    def max_sessions(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def memory_budget(self) -> int | None:
        ...
    @memory_budget.setter
    def memory_budget(self, arg0: typing.SupportsInt | typing.SupportsIndex | None) -> None:
        ...
    @property
    def mutable_patterns(self) -> list[str] | None:
        ...
    @mutable_patterns.setter
    def mutable_patterns(self, arg0: collections.abc.Sequence[str] | None) -> None:
        ...
class BufferInfo:
    """
    A mutable buffer (per-session state).
    """
    @property
    def bytes(self) -> int:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def fqn(self) -> str:
        ...
    @property
    def methods(self) -> list[str]:
        ...
    @property
    def sizes(self) -> list[int]:
        ...
    @property
    def strides(self) -> list[int]:
        ...
    @property
    def zero_initial(self) -> bool:
        ...
class PooledTensor:
    """
    A pooled tensor: [units, ...unit sizes].
    """
    @property
    def dtype(self) -> str:
        ...
    @property
    def kind(self) -> PoolKind:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def unit_bytes(self) -> int:
        ...
    @property
    def unit_sizes(self) -> list[int]:
        ...
class PoolLayout:
    """
    The pooled state every pooled method shares.
    """
    @property
    def max_pages(self) -> int:
        ...
    @property
    def max_positions(self) -> int:
        ...
    @property
    def max_rows(self) -> int:
        ...
    @property
    def page_bytes(self) -> int:
        ...
    @property
    def page_size(self) -> int:
        ...
    @property
    def slot_bytes(self) -> int:
        ...
    @property
    def tensors(self) -> list[PooledTensor]:
        ...
class WeightInfo:
    """
    A weight held by the engine.
    """
    @property
    def bytes(self) -> int:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def fqn(self) -> str:
        ...
    @property
    def methods(self) -> list[str]:
        ...
    @property
    def sizes(self) -> list[int]:
        ...
    @property
    def strides(self) -> list[int]:
        ...
class MemoryReport:
    """
    Bytes by holder.
    """
    @property
    def containers(self) -> int:
        ...
    @property
    def host_spare(self) -> int:
        ...
    @property
    def offloaded(self) -> int:
        ...
    @property
    def pool(self) -> int:
        ...
    @property
    def sessions(self) -> int:
        ...
    @property
    def templates(self) -> int:
        ...
    @property
    def weights(self) -> int:
        ...
class SessionStats:
    """
    Where one session is.
    """
    @property
    def bytes(self) -> int:
        ...
    @property
    def id(self) -> int:
        ...
    @property
    def last_use(self) -> float:
        ...
    @property
    def resident(self) -> bool:
        ...
class EngineStats:
    """
    Counters of an engine.
    """
    @property
    def batch_rows(self) -> int:
        ...
    @property
    def batch_runs(self) -> int:
        ...
    @property
    def batch_seconds(self) -> float:
        ...
    @property
    def bind_seconds(self) -> float:
        ...
    @property
    def binds(self) -> int:
        ...
    @property
    def device_bytes(self) -> int:
        ...
    @property
    def discards(self) -> int:
        ...
    @property
    def evictions(self) -> int:
        ...
    @property
    def graph_captures(self) -> int:
        ...
    @property
    def graph_pools(self) -> int:
        ...
    @property
    def graph_replays(self) -> int:
        ...
    @property
    def graphs(self) -> int:
        ...
    @property
    def host_bytes(self) -> int:
        ...
    @property
    def host_spare_bytes(self) -> int:
        ...
    @property
    def idle_closes(self) -> int:
        ...
    @property
    def idle_offloads(self) -> int:
        ...
    @property
    def lanes(self) -> int:
        ...
    @property
    def live_bytes(self) -> int:
        ...
    @property
    def live_sessions(self) -> int:
        ...
    @property
    def loads(self) -> int:
        ...
    @property
    def offloaded_sessions(self) -> int:
        ...
    @property
    def offloads(self) -> int:
        ...
    @property
    def pages_copied(self) -> int:
        ...
    @property
    def pool_grows(self) -> int:
        ...
    @property
    def pool_pages(self) -> int:
        ...
    @property
    def pool_pages_used(self) -> int:
        ...
    @property
    def pool_slots(self) -> int:
        ...
    @property
    def pool_slots_used(self) -> int:
        ...
    @property
    def reclaim_seconds(self) -> float:
        ...
    @property
    def resident_sessions(self) -> int:
        ...
    @property
    def restores(self) -> int:
        ...
    @property
    def runs(self) -> int:
        ...
    @property
    def saves(self) -> int:
        ...
    @property
    def sessions(self) -> list[SessionStats]:
        ...
    @property
    def sessions_created(self) -> int:
        ...
class SessionSnapshot:
    """
    A host copy of a session's state at one moment, written to a file later.
    """
    def write(self, path: str, attachment: bytes = b'') -> None:
        """
        Writes the copy, and the attachment's bytes with it, to a session file.
        """
    @property
    def nbytes(self) -> int:
        """
        Bytes of state it holds.
        """
class Session:
    def checkpoint(self, keep: typing.SupportsInt | typing.SupportsIndex, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        Keeps a copy of the slot state at the session's length (Truncate rewinds there).
        """
    def close(self) -> None:
        ...
    def fork(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> Session:
        ...
    def offload(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def read_buffers(self, dsts: list[typing_extensions.CapsuleType], stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        Copies every buffer at once into `dsts` (one snapshot).
        """
    def read_pool(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[list[typing_extensions.CapsuleType], int]:
        """
        (handles, length): the session's part of every pooled tensor, one snapshot.
        """
    def reset(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def restore(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def run(self, method: typing.SupportsInt | typing.SupportsIndex, inputs: list[typing_extensions.CapsuleType], stream: typing.SupportsInt | typing.SupportsIndex = 0) -> list[typing_extensions.CapsuleType]:
        ...
    def save(self, path: str, attachment: bytes = b'', stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        Writes the state, and the attachment's bytes with it, to a session file.
        """
    def snapshot(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> SessionSnapshot:
        """
        A host copy of the state now (the session locked only while it is copied out).
        """
    def truncate(self, length: typing.SupportsInt | typing.SupportsIndex, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def write_buffers(self, fqns: collections.abc.Sequence[str], sources: list[typing_extensions.CapsuleType], stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        Replaces every buffer at once: sources[i] is the new value of fqns[i].
        """
    def write_pool(self, names: collections.abc.Sequence[str], sources: list[typing_extensions.CapsuleType], length: typing.SupportsInt | typing.SupportsIndex, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        Replaces the session's pooled state (as read_pool gives it) and its length.
        """
    @property
    def address(self) -> int:
        """
        Device address of the session's state block (0 once closed or offloaded).
        """
    @property
    def checkpoints(self) -> list[int]:
        """
        The lengths the session has checkpoints at, ascending.
        """
    @property
    def closed(self) -> bool:
        ...
    @property
    def discardable(self) -> bool:
        """
        Whether the engine may close the session when it needs room (before offloading any session, instead of refusing one at max_sessions) and at idle_timeout.
        """
    @discardable.setter
    def discardable(self, arg1: bool) -> None:
        ...
    @property
    def id(self) -> int:
        ...
    @property
    def last_use(self) -> float:
        """
        Last use, in seconds of time.monotonic().
        """
    @property
    def length(self) -> int:
        """
        Positions the session holds (pooled state; 0 without).
        """
    @property
    def resident(self) -> bool:
        ...
class Engine:
    def __init__(self, methods: collections.abc.Sequence[MethodSource], options: EngineOptions, graph_host: typing.Any = None) -> None:
        """
        graph_host: an object with new_pool(), begin(pool, stream), end(pool), release(pool) and note(text), routing torch's allocations during CUDA graph captures (aoti_sessions._graphs); None: CUDA engines run eagerly.
        """
    def call_spec(self, method: typing.SupportsInt | typing.SupportsIndex) -> tuple[str, str]:
        ...
    def captures(self, method: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Whether the method's runs are captured into CUDA graphs.
        """
    def close(self) -> None:
        ...
    def load_session(self, path: str, strict: bool = True, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> Session:
        ...
    def load_session_attached(self, path: str, strict: bool = True, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[Session, bytes]:
        """
        (session, attachment): a loaded session and the bytes saved with it (b'' for none).
        """
    def memory_report(self) -> MemoryReport:
        ...
    def method_index(self, name: str) -> int:
        ...
    def new_session(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> Session:
        ...
    def num_inputs(self, method: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def run_batch(self, rows: collections.abc.Sequence[Session], method: typing.SupportsInt | typing.SupportsIndex, inputs: list[typing_extensions.CapsuleType], stream: typing.SupportsInt | typing.SupportsIndex = 0) -> list[typing_extensions.CapsuleType]:
        """
        Runs pooled `method` once over `rows` (one session each, in order).
        """
    def stats(self) -> EngineStats:
        ...
    def update_weights(self, names: collections.abc.Sequence[str], sources: list[typing_extensions.CapsuleType], double_buffer: bool = False) -> None:
        ...
    def weights(self) -> list[WeightInfo]:
        ...
    @property
    def bytes_per_session(self) -> int:
        ...
    @property
    def closed(self) -> bool:
        ...
    @property
    def device(self) -> str:
        ...
    @property
    def load_notes(self) -> list[str]:
        ...
    @property
    def method_names(self) -> list[str]:
        ...
    @property
    def mutable_buffers(self) -> list[BufferInfo]:
        ...
    @property
    def pool(self) -> PoolLayout | None:
        """
        The pooled state's layout, or None.
        """
    @property
    def template_bytes(self) -> int:
        ...
    @property
    def weight_bytes(self) -> int:
        ...
def _throw_for_test(kind: str, message: str) -> None:
    """
    Throws a C++ exception of `kind` (tests of the exception table).
    """
def built_with_cuda() -> bool:
    """
    Whether this build serves CUDA engines.
    """
def dtype_code(name: str) -> int:
    """
    Shim dtype code of a torch dtype name ('float32'), -1 if unknown.
    """
def error_kinds() -> list[str]:
    """
    Names of every error kind the core raises (keys of aoti_sessions.errors.CORE_ERRORS).
    """
