"""Command line: ``python -m aoti_sessions demo`` (also ``aoti-sessions demo``)
and ``aoti-sessions info MODEL``."""

from __future__ import annotations

import argparse
import logging
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aoti-sessions", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="decode several sessions of the built-in decoder, check isolation")
    demo.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    demo.add_argument("--sessions", type=_positive, default=4, help="number of sessions (default 4)")
    demo.add_argument("--steps", type=_positive, default=32, help="tokens generated per session (default 32)")
    info = commands.add_parser("info", help="describe a compiled model: methods, mutable state, sizes")
    info.add_argument("model", help=".pt2 package or .so library")
    info.add_argument("--device", default="cpu")
    from .serve._cli import add_arguments as add_serve_arguments

    add_serve_arguments(commands.add_parser("serve", help="serve an LLM package over an OpenAI-compatible HTTP API"))
    from .llm._export_cli import add_arguments as add_export_arguments, run as run_export

    add_export_arguments(commands.add_parser("export", help="compile a saved transformers causal LM into an LLM package"))
    args = parser.parse_args(argv)
    if args.command == "export":
        return run_export(args)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    from .errors import Error

    try:
        if args.command == "serve":
            from .serve._cli import run as run_serve

            return run_serve(args)
        if args.command == "demo":
            from .demo import run_demo

            return 0 if run_demo(args.device, args.sessions, args.steps) else 1
        return _info(args.model, args.device)
    except (Error, ValueError, TypeError) as e:
        parser.exit(2, f"aoti-sessions: error: {e}\n")


def _info(model: str, device: str) -> int:
    from ._engine import Engine

    with Engine(model, device=device) as engine:
        print(engine)
        print("methods:")
        for method in engine.methods:
            print(f"  {engine.signature(method)}")
        print(f"weights: {engine.weight_bytes} bytes, per session: {engine.bytes_per_session} bytes")
        for b in engine.buffers():
            print(f"  {b['fqn']}: {b['dtype']}{b['sizes']} in {', '.join(b['methods'])}"
                  f"{' (zero initial)' if b['zero_initial'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
