"""The part of a CUDA graph capture that only torch can do: routing its caching
allocator into a graph's memory pool while the core captures a model run.

The core (csrc/core/graphs.h) owns the graphs: it begins and ends the stream
capture, runs the model inside it, instantiates and replays the graph. But the
model allocates its intermediates and outputs through torch's caching
allocator, and that allocator's pool routing (what ``torch.cuda.graph(pool=)``
does) has no C ABI. The core calls this object for it, with the GIL taken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("aoti_sessions")

Pool = tuple[int, int]


def _torch_function(*names: str) -> Callable[..., Any]:
    """The first of torch's private functions `names` this torch has."""
    for name in names:
        fn = getattr(torch._C, name, None)
        if fn is not None:
            return fn  # type: ignore[no-any-return]
    raise RuntimeError(f"this torch lacks {' and '.join(names)}: CUDA graphs are unavailable")


class TorchGraphHost:
    """Routes torch's allocations of a capture into a graph pool (one per stream)."""

    def __init__(self, device: torch.device) -> None:
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        # By calling thread where this torch can (the model allocates on the
        # thread that runs it), else by the stream current at the call.
        self._by_stream = not hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool")
        self._begin = _torch_function("_cuda_beginAllocateCurrentThreadToPool",
                                      "_cuda_beginAllocateCurrentStreamToPool")
        self._end = _torch_function("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
        self._release = _torch_function("_cuda_releasePool")
        self._noted: set[str] = set()

    def new_pool(self) -> Pool:
        pool = torch.cuda.graph_pool_handle()
        return int(pool[0]), int(pool[1])

    def begin(self, pool: Pool, stream: int) -> None:
        if not self._by_stream:
            self._begin(self._index, pool)
            return
        # By stream: the filter is the stream current at this call.
        external = torch.cuda.ExternalStream(stream, device=self._index)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(external):
            self._begin(self._index, pool)

    def end(self, pool: Pool) -> None:
        self._end(self._index, pool)

    def release(self, pool: Pool) -> None:
        self._release(self._index, pool)

    def note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            log.warning("%s", text)
