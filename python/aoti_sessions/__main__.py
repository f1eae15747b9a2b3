"""Command line: ``python -m aoti_sessions demo`` (also ``aoti-sessions demo``)
and ``aoti-sessions info MODEL``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zipfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llm._spec import LLMSpec


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

    from .cluster._cli import add_arguments as add_cluster_arguments

    serve = commands.add_parser("serve", help="serve an LLM package over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    add_cluster_arguments(serve)
    from .llm._export_cli import add_arguments as add_export_arguments, run as run_export

    add_export_arguments(commands.add_parser("export", help="compile a saved transformers causal LM into an LLM package"))
    args = parser.parse_args(argv)
    if args.command == "export":
        return run_export(args)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    from .errors import Error

    try:
        if args.command == "serve" and args.replicas is not None:
            from .cluster._cli import run as run_cluster

            return run_cluster(args)
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
    for line in _llm_lines(model):
        print(line)
    return 0


# Where aoti_sessions.llm.export writes its spec (llm/_spec.py: LLM_DIR,
# SPEC_FILE): looked for before importing aoti_sessions.llm, which is slow.
_LLM_SPEC_SUFFIX = "data/aoti_sessions/llm/llm.json"


def _llm_lines(model: str) -> list[str]:
    """What an LLM package says of itself (context, prefill, end ids, chat
    template); nothing for another package."""
    if not zipfile.is_zipfile(model):
        return []
    with zipfile.ZipFile(model) as archive:
        if not any(name.endswith(_LLM_SPEC_SUFFIX) for name in archive.namelist()):
            return []
    from .llm._spec import read_llm_package

    package = read_llm_package(model)
    spec = package.spec
    config_file = package.tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = (package.tokenizer_dir / "chat_template.jinja").is_file() or bool(config.get("chat_template"))
    return [f"LLM: {spec.name} ({spec.architecture}, {spec.dtype})",
            f"  context: {spec.max_cache_len} positions a session; prefill: up to {spec.max_prefill} tokens of "
            f"up to {spec.prefill_rows} sessions a call; vocabulary: {spec.vocab_size}",
            f"  end of sequence: {', '.join(map(str, spec.eos_token_ids)) or 'none'}; "
            f"bos: {spec.bos_token_id}; pad: {spec.pad_token_id}",
            f"  chat template: {'yes' if template else 'none (prompts are plain text)'}",
            _state_line(spec)]


def _state_line(spec: LLMSpec) -> str:
    rewinds = "rewinds only to a checkpoint kept at a turn's start or its prompt's end: a history changed before " \
              "it is fed again"
    if spec.window_ring:
        return (f"  state: window layers' ring of {spec.window_ring} positions ({rewinds}), and the global layers' "
                "KV cache if it has any")
    if spec.recurrent:
        return (f"  state: recurrent state (conv, SSM or delta-net; {rewinds}), and its attention layers' KV cache "
                "if it has any")
    return "  state: KV cache"


if __name__ == "__main__":
    sys.exit(main())
