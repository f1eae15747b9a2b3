"""
C++ core of aoti_sessions (private; use the aoti_sessions package)
"""
from __future__ import annotations
import collections.abc
import typing
import typing_extensions
__all__: list[str] = ['Engine', 'InputSpec', 'MethodSource', 'Session', 'built_with_cuda', 'dtype_code']
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
class MethodSource:
    cubin_dir: str
    library_path: str
    name: str
    def __init__(self) -> None:
        ...
    def set_weights_file(self, path: str, entries: collections.abc.Sequence[tuple[str, typing.SupportsInt | typing.SupportsIndex, collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]]) -> None:
        """
        Weights of a library compiled without them: (fqn, dtype code, sizes, strides, offset, bytes) per tensor of the file at `path`.
        """
    @property
    def inputs(self) -> list[InputSpec] | None:
        ...
    @inputs.setter
    def inputs(self, arg0: collections.abc.Sequence[InputSpec] | None) -> None:
        ...
class Session:
    def close(self) -> None:
        ...
    def fork(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> Session:
        ...
    def offload(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def read_buffer(self, buffer: typing.SupportsInt | typing.SupportsIndex, dst: typing_extensions.CapsuleType, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def reset(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def restore(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def run(self, method: typing.SupportsInt | typing.SupportsIndex, inputs: list[typing_extensions.CapsuleType], stream: typing.SupportsInt | typing.SupportsIndex = 0) -> list[typing_extensions.CapsuleType]:
        ...
    def save(self, path: str, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def write_buffers(self, sources: list[typing_extensions.CapsuleType], stream: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    @property
    def address(self) -> int:
        """
        Device address of the session's state block (0 once closed or offloaded).
        """
    @property
    def closed(self) -> bool:
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
    def resident(self) -> bool:
        ...
class Engine:
    def __init__(self, methods: collections.abc.Sequence[MethodSource], device: str, mutable_patterns: collections.abc.Sequence[str] | None, known_mutated: collections.abc.Sequence[str], max_sessions: typing.SupportsInt | typing.SupportsIndex = -1, memory_budget: typing.SupportsInt | typing.SupportsIndex = -1, reclaim_bind_handles: bool = True, strict_weights: bool = False, host_budget: typing.SupportsInt | typing.SupportsIndex = -1, idle_timeout: typing.SupportsFloat | typing.SupportsIndex = 0.0, idle_close: bool = False) -> None:
        ...
    def call_spec(self, method: typing.SupportsInt | typing.SupportsIndex) -> tuple[str, str]:
        ...
    def close(self) -> None:
        ...
    def load_session(self, path: str, strict: bool = True, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> Session:
        ...
    def memory_report(self) -> dict[str, typing.Any]:
        ...
    def method_index(self, name: str) -> int:
        ...
    def new_session(self, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> Session:
        ...
    def num_inputs(self, method: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def stats(self) -> dict[str, typing.Any]:
        ...
    def update_weights(self, names: collections.abc.Sequence[str], sources: list[typing_extensions.CapsuleType], double_buffer: bool = False) -> None:
        ...
    def weights(self) -> list[dict[str, typing.Any]]:
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
    def mutable_buffers(self) -> list[dict[str, typing.Any]]:
        ...
    @property
    def template_bytes(self) -> int:
        ...
    @property
    def weight_bytes(self) -> int:
        ...
def built_with_cuda() -> bool:
    """
    Whether this build serves CUDA engines.
    """
def dtype_code(name: str) -> int:
    """
    Shim dtype code of a torch dtype name ('float32'), -1 if unknown.
    """
