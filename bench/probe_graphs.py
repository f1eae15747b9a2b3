"""Diagnostics for per-session CUDA graphs on a GPU, each case in a process of
its own (an illegal address kills the CUDA context): prints OK or the error.

    python bench/probe_graphs.py [small|large] [case ...]
"""

from __future__ import annotations

import subprocess
import sys

CASES = {
    "graphs": "e = ais.Engine(path, device='cuda'); ss = [e.new_session(), e.new_session()]\n"
              "for i in range(40): ss[i % 2](tok, pos[i]); torch.cuda.synchronize()\n"
              "print(e.stats()['graph_replays'], 'replays')",
    "graphs_stream": "e = ais.Engine(path, device='cuda'); s = e.new_session(); st = torch.cuda.Stream()\n"
                     "with torch.cuda.stream(st):\n"
                     "    for i in range(20): s(tok, pos[i]); torch.cuda.synchronize()\n"
                     "print(e.stats()['graph_replays'], 'replays')",
    "eager_lanes": "e = ais.Engine(path, device='cuda', cuda_graphs=False); ss = [e.new_session() for _ in range(4)]\n"
                   "for i in range(40): ss[i % 4](tok, pos[i]); torch.cuda.synchronize()",
    "eager_one_lane": "e = ais.Engine(path, device='cuda', cuda_graphs=False, lanes=1); s = e.new_session()\n"
                      "for i in range(20): s(tok, pos[i]); torch.cuda.synchronize()",
    "torch_graph": "sys.path.insert(0, 'bench'); from bench_sessions import torch_runner_graph\n"
                   "f = torch_runner_graph(path, tok, pos[0])\n"
                   "for i in range(20): f(pos[i]); torch.cuda.synchronize()",
    "compile_ro": "m = torch.compile(models.TinyDecoder(cfg).cuda().eval(), mode='reduce-overhead')\n"
                  "with torch.no_grad():\n"
                  "    for i in range(20): torch.compiler.cudagraph_mark_step_begin(); m(tok, pos[i]); torch.cuda.synchronize()",
}

PRELUDE = """
import sys, torch
import aoti_sessions as ais
from aoti_sessions import models
from aoti_sessions.demo import compiled_decoder
cfg = models.{cfg}
path = compiled_decoder(cfg, 'cuda')
tok = torch.tensor([[7]], device='cuda')
pos = [torch.tensor([p], device='cuda') for p in range(64)]
"""

if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else "small"
    for name in sys.argv[2:] or list(CASES):
        code = PRELUDE.format(cfg=model.upper()) + CASES[name] + "\nprint('OK')\n"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
        lines = (run.stdout + run.stderr).strip().splitlines()
        tail = [ln for ln in lines if "INFO" not in ln][-3:]
        print(f"{model} {name}: rc={run.returncode} | " + " | ".join(tail), flush=True)
