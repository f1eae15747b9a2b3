"""Command line: ``python -m aoti_sessions demo`` (also ``aoti-sessions demo``)
and ``aoti-sessions info MODEL``."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._package import MethodFiles
    from .llm._spec import LLMSpec


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _version() -> str:
    """This aoti-sessions, the torch it runs on, and whether its core was built with CUDA."""
    import torch

    from . import __version__, _core

    cuda = "with CUDA" if _core.built_with_cuda() else "CPU only"
    return f"aoti-sessions {__version__} ({cuda}; torch {torch.__version__}, Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aoti-sessions", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="decode several sessions of the built-in decoder, check isolation")
    demo.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    demo.add_argument("--sessions", type=_positive, default=4, help="number of sessions (default 4)")
    demo.add_argument("--steps", type=_positive, default=32, help="tokens generated per session (default 32)")
    info = commands.add_parser("info", help="describe a compiled model from its files (runs none of its code)")
    info.add_argument("model", help=".pt2 package or .so library")
    info.add_argument("--load", action="store_true",
                      help="load the model to show its state's shapes and sizes too: runs the package's libraries "
                           "(only for a package you trust)")
    info.add_argument("--device", default="cpu", help="with --load: cpu, cuda or cuda:N (default cpu)")
    from .serve._cli import TRUST_HELP, add_arguments as add_serve_arguments, trusted_modules

    info.add_argument("--trust-op-modules", type=trusted_modules, default=False, metavar="MODULES",
                      help=f"with --load: {TRUST_HELP}")

    from .cluster._cli import add_arguments as add_cluster_arguments

    serve = commands.add_parser("serve", help="serve an LLM package over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    add_cluster_arguments(serve)
    from .llm.exporting._export_cli import add_arguments as add_export_arguments, run as run_export

    add_export_arguments(commands.add_parser("export", help="compile a saved transformers causal LM into an LLM package"))
    args = parser.parse_args(argv)
    if args.command == "export":
        return run_export(args)
    from ._logs import configure

    configure(logging.INFO)  # (time, level, logger, and the request's id where there is one)

    from .errors import Error

    try:
        if args.command == "serve" and args.replicas is not None:
            from .cluster._cli import run as run_cluster

            return run_cluster(args, sys.argv[1:] if argv is None else list(argv))
        if args.command == "serve":
            from .serve._cli import run as run_serve

            return run_serve(args)
        if args.command == "demo":
            from .demo import run_demo

            return 0 if run_demo(args.device, args.sessions, args.steps) else 1
        if args.load:
            return _info_loaded(args.model, args.device, args.trust_op_modules)
        return _info(args.model)
    except (Error, ValueError, TypeError) as e:
        parser.exit(2, f"aoti-sessions: error: {e}\n")


def _info(model: str) -> int:
    """What a model's files say of it, read without loading a library or
    importing a module the package names: none of its code runs."""
    from ._package import open_model
    from ._proxy import trusted_by_default
    from ._signature import signature

    files = open_model(model)  # extracted (sizes checked first) and its documents read
    if Path(model).suffix == ".so":
        print(f"{model}: a library without its package: what it takes and holds is known only by loading it "
              "(--load runs its code)")
        return 0
    devices = sorted({f.device_key or "an unrecorded device" for f in files})
    print(f"{model}: {len(files)} method{'s' if len(files) != 1 else ''} compiled for {', '.join(devices)}, read from "
          "its files (none of its code was loaded or run)")
    print("methods:")
    for f in files:
        in_spec, out_spec, count = _call_spec(f)
        if f.metadata is not None and f.metadata.pool is not None:
            in_spec = None  # a pooled method is called with its inputs flat (Engine.signature shows it so)
        print(f"  {signature(f.name, in_spec, out_spec, count, f.metadata)}")
    if files[0].weights_file is not None:
        held = {(w.offset, w.nbytes) for f in files for w in f.weights}
        print(f"weights: {len(held)} tensors, {sum(n for _, n in held)} bytes in {Path(files[0].weights_file).name}")
    else:
        print("weights: inside each method's library")
    docs = [f.metadata for f in files if f.metadata is not None]
    pool = next((d.pool for d in docs if d.pool is not None), None)
    declared = list(dict.fromkeys(b for d in docs for b in d.mutable_buffers or []))
    if pool is not None:
        print(f"pooled state: {', '.join(f'{name} ({kind})' for _, name, kind in pool.tensors)}")
    elif declared:
        print(f"per-session state (declared): {', '.join(declared)}")
    else:
        print("per-session state: not declared (loading takes every buffer)")
    for module in files[0].op_modules:
        allowed = "allowed" if trusted_by_default(module) else "only with --trust-op-modules"
        print(f"op module: {module} (imported at load where its ops are not registered: {allowed})")
    print("not read without loading (which runs the libraries' code): each buffer's shape and initial value, the "
          "bytes a session takes; --load shows them (only for a package you trust)")
    for line in _llm_lines(model):
        print(line)
    return 0


def _call_spec(f: MethodFiles) -> tuple[Any, Any, int]:
    """A method's call structure (pytree specs) and input count, as its
    library would report them, from the C++ source AOTInductor packages
    beside it (``in_spec_ = R"(...)";``); None for a spec it lacks or that
    cannot be read (the signature then shows the recorded inputs only)."""
    import torch.utils._pytree as pytree

    recorded = len(f.metadata.inputs) if f.metadata is not None and f.metadata.inputs is not None else 0
    source = Path(f.library).with_suffix(".cpp")
    try:
        text = source.read_text(errors="replace")
    except OSError:
        return None, None, recorded
    specs: list[Any] = []
    for name in ("in_spec_", "out_spec_"):
        m = re.search(rf'^\s*{name} = R"\((.*)\)";\s*$', text, re.M)
        try:
            specs.append(pytree.treespec_loads(m.group(1)) if m else None)
        except Exception:  # noqa: BLE001 - an unreadable spec is shown as none
            specs.append(None)
    indices = [int(i) for i in re.findall(r"^\s*inputs_info_\[(\d+)\]\.name = ", text, re.M)]
    return specs[0], specs[1], max(indices) + 1 if indices else recorded


def _info_loaded(model: str, device: str, trust_op_modules: bool | tuple[str, ...]) -> int:
    from ._engine import Engine

    with Engine(model, device=device, trust_op_modules=trust_op_modules) as engine:
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
    weights = f", weights {spec.quantization}" if spec.quantization else ""
    return [f"LLM: {spec.name} ({spec.architecture}, {spec.dtype}{weights})",
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
