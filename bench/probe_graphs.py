"""Diagnostics for per-session CUDA graphs on a GPU: one engine with graphs,
one without, a few interleaved steps, every figure printed as it comes."""

from __future__ import annotations

import faulthandler
import logging
import sys

import torch

import aoti_sessions as ais
from aoti_sessions.demo import compiled_decoder
from aoti_sessions.models import SMALL

faulthandler.enable()
logging.basicConfig(level=logging.INFO)
print("torch", torch.__version__, {n: hasattr(torch._C, n) for n in (
    "_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateCurrentStreamToPool",
    "_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool")}, flush=True)
path = compiled_decoder(SMALL, "cuda")
views = len(sys.argv) > 1 and sys.argv[1] == "views"
g = ais.Engine(path, device="cuda", graph_output_views=views)
e = ais.Engine(path, device="cuda", cuda_graphs=False)
sg, se = g.new_session(), e.new_session()
tok = torch.tensor([[3]], device="cuda")
for p in range(8):
    pos = torch.tensor([p], device="cuda")
    a = sg(tok, pos)
    torch.cuda.synchronize()
    b = se(tok, pos)
    torch.cuda.synchronize()
    print(p, "equal", torch.equal(a, b), "stats", {k: v for k, v in g.stats().items()
                                                  if k.startswith("graph") or k in ("runs", "binds")}, flush=True)
print("done", flush=True)
