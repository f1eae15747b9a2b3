"""``python -m aoti_sessions.llm.process._engine_main FD``: a RemoteLLM's engine
process (_remote_engine.py). A module of its own, imported by nothing: run
with -m, the engine's module is imported under its own name (what it pickles
names its classes there), not as __main__."""

import sys

from aoti_sessions._logs import configure_here
from aoti_sessions.llm.process._remote_engine import main

if __name__ == "__main__":
    configure_here()  # (its lines as the server's, where a server started it)
    main(sys.argv[1:])
