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

import torch

log = logging.getLogger("aoti_sessions")

Pool = tuple[int, int]


class TorchGraphHost:
    """Routes torch's allocations of a capture into a graph pool (one per stream).

    The routing is by calling thread (the model allocates on the thread that
    runs it, whichever stream the capture uses): torch 2.11 through 2.14 have
    ``_cuda_beginAllocateCurrentThreadToPool``."""

    def __init__(self, device: torch.device) -> None:
        self._index = device.index if device.index is not None else torch.cuda.current_device()

    def new_pool(self) -> Pool:
        pool = torch.cuda.graph_pool_handle()
        return int(pool[0]), int(pool[1])

    def begin(self, pool: Pool, stream: int) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self._index, pool)

    def end(self, pool: Pool) -> None:
        torch._C._cuda_endAllocateToPool(self._index, pool)

    def release(self, pool: Pool) -> None:
        torch._C._cuda_releasePool(self._index, pool)

    def note(self, text: str) -> None:
        log.warning("%s", text)  # the core notes each decision once
