"""``aoti-sessions serve PACKAGE``: the server's command line. Importing this
needs nothing beyond aoti_sessions; FastAPI and uvicorn (the ``[serve]``
extra) are imported when the server starts, with a clear message if missing."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..llm.interface import ENGINE_TIMEOUT_S, HUB_ID, STEP_TIMEOUT_S
from ._limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_SESSION_FILES,
                      DEFAULT_MAX_SESSION_FILES_BYTES, DEFAULT_SESSION_TTL, DEFAULT_STATS_INTERVAL, available_memory,
                      default_budgets)
from ._tenants import Keys, read_api_keys

log = logging.getLogger("aoti_sessions.serve")

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
API_KEY_ENV = "AOTI_SESSIONS_API_KEY"


def byte_size(text: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1000000"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a unit: 512MiB, 2G)")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _seconds_or_none(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "never") else _seconds(text)


def trusted_modules(text: str) -> bool | tuple[str, ...]:
    """``--trust-op-modules``: ``all``, or module names separated by commas."""
    from .._proxy import trust_option

    if text.strip() == "all":
        return True
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give module names separated by commas, or 'all'")
    try:
        return trust_option(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


TRUST_HELP = ("Python modules the package may have imported for custom ops this process lacks (module names "
              "separated by commas, or 'all'); importing one runs its code. Default: only modules of installed "
              "transformers and aoti_sessions, never one in the current directory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("package", help="LLM package made by aoti_sessions.llm.export")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                             f"(default: ${API_KEY_ENV}, else none)")
    parser.add_argument("--api-keys", metavar="FILE",
                        help="API keys, one a line (empty lines and lines starting with '#' skipped), each a tenant: "
                             "a key sees and uses only the sessions and session files it made (another key's are "
                             "a 404, as absent), kept in SESSION_DIR/.tenants/HASH (a hash of the key); with "
                             "--api-key, that key is one tenant more (its files in SESSION_DIR)")
    parser.add_argument("--max-sessions", type=_positive, help="at most this many sessions (more: 429)")
    parser.add_argument("--memory-budget", type=byte_size,
                        help="device bytes for session state (e.g. 8GiB); beyond it idle sessions go to host memory")
    parser.add_argument("--host-budget", type=byte_size,
                        help="bytes of host memory for sessions offloaded from the device (default: a quarter of "
                             "the memory available at start)")
    parser.add_argument("--idle-timeout", type=_seconds, help="seconds after which an idle session goes to host memory")
    parser.add_argument("--session-ttl", type=_seconds_or_none, default=DEFAULT_SESSION_TTL,
                        help="seconds a named session may sit unused before it is parked: saved to SESSION_DIR/.live "
                             "(with --session-dir) and closed; 'none': never (default %(default)g)")
    parser.add_argument("--session-dir", help="folder of session files for save and load (default: off)")
    parser.add_argument("--max-session-files", type=_positive, default=DEFAULT_MAX_SESSION_FILES, metavar="N",
                        help="session files each API key may save (more: 403 until it deletes some with DELETE "
                             "/v1/session-files/NAME; default %(default)s)")
    parser.add_argument("--max-session-files-bytes", type=byte_size, default=DEFAULT_MAX_SESSION_FILES_BYTES,
                        metavar="SIZE",
                        help="bytes of session files each API key may save (default 16GiB)")
    parser.add_argument("--persist-sessions", action=argparse.BooleanOptionalAction, default=None,
                        help="park named sessions in SESSION_DIR/.live when their TTL ends and when the server stops "
                             "(SIGTERM), and bring them back when a request names them (default: on with "
                             "--session-dir)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the model and its step loop in a process of their own, HTTP and tokenizing in "
                             "this one, so they share no GIL (default on; --no-engine-process: one process)")
    parser.add_argument("--api-workers", type=_positive, metavar="N",
                        help="front ends: processes that serve HTTP, chat templates, tokenizing and streaming, all on "
                             "one port, over one engine process and one registry of sessions (any session may come "
                             "to any of them; /metrics is one view); one front end is at most a core (default: 1 on "
                             "a CPU device or with --no-engine-process, else one per three CPUs beyond two, at most 4)")
    parser.add_argument("--engine-timeout", type=_seconds, default=ENGINE_TIMEOUT_S,
                        help="seconds without a heartbeat from the engine process (one comes every second or so, "
                             "whatever the step loop does) after which it is unresponsive (stopped, wedged): requests "
                             "get 503 at once and /health 503 until it answers again (default %(default)g)")
    parser.add_argument("--step-timeout", type=_seconds, default=STEP_TIMEOUT_S,
                        help="seconds the engine process's step loop may spend in one step (a batched decode and a "
                             "prefill chunk) while generations wait, after which it is unresponsive (a hung device, "
                             "a deadlock) (default %(default)g)")
    parser.add_argument("--max-body-bytes", type=byte_size,
                        help="a request body longer than this is answered 413 unread (default: 32 bytes a token "
                             "of the model's context, at least 1MiB)")
    parser.add_argument("--max-connections", type=_positive, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections (or requests in flight) at once, each front end's; more are answered 503 "
                             "(default %(default)s; the open-file limit is raised to room for them)")
    parser.add_argument("--header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds for a request's head to arrive whole, else the connection is closed (default "
                             "%(default)g)")
    parser.add_argument("--body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT,
                        help="seconds for a request's body to arrive whole, else 408 (default %(default)g)")
    parser.add_argument("--rewind-checkpoints", type=_count,
                        help="models with recurrent state (hybrid): turns back a chat can rewind without feeding "
                             "its history again, each up to two slots of recurrent state per session (its start, its "
                             "prompt's end; default 1)")
    parser.add_argument("--prefix-cache", type=_count, metavar="N",
                        help="requests without a session id: keep up to N of their sessions once they end, to "
                             "start later requests of the same key whose prompts begin the same way (their "
                             "pages shared, only the rest prefilled; 0: off; default 64)")
    parser.add_argument("--prefix-cache-bytes", type=byte_size,
                        help="the prefix cache's session state at most (default: a quarter of --memory-budget); "
                             "whatever it holds, the engine closes its sessions first when it needs room")
    parser.add_argument("--trust-op-modules", type=trusted_modules, default=False, metavar="MODULES",
                        help=TRUST_HELP)
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template used instead of the package's (checked at start)")
    parser.add_argument("--tool-call-parser", metavar="NAME",
                        help="the format of the model's tool calls: hermes (Qwen, Hermes), llama3_json, mistral, "
                             "harmony (GPT-OSS), or none (default: read from the chat template)")
    parser.add_argument("--reasoning-parser", metavar="NAME",
                        help="the format of the model's reasoning, returned as reasoning_content: think (<think>, "
                             "as Qwen3 and DeepSeek-R1; also named qwen3, deepseek_r1), harmony (GPT-OSS's analysis "
                             "channel), or none (default: read from the chat template)")
    parser.add_argument("--served-model-name", nargs="+", action="extend", metavar="NAME",
                        help="the model ids the server answers to (requests may name any; /v1/models lists them; "
                             "answers report the first; default: the package's model name)")
    parser.add_argument("--allowed-origins", nargs="+", action="extend", metavar="ORIGIN",
                        help="origins whose web pages may call the server from a browser (CORS): "
                             "https://app.example:8443, or '*' for any; their preflight OPTIONS needs no API key, "
                             "every other request still does (default: none)")
    parser.add_argument("--stats-interval", type=_seconds_or_none, default=DEFAULT_STATS_INTERVAL, metavar="SECONDS",
                        help="seconds between the stats lines of the log (requests, tokens/s, sessions, KV pages), "
                             "written while the server is busy; 'none': none (default %(default)g)")
    parser.add_argument("--threads", type=_positive,
                        help="threads for the model's CPU kernels (torch.set_num_threads); default on a CPU "
                             "device: one fewer than the CPUs this process may use (at least 1), leaving one to "
                             "the server's own work; on CUDA: torch's default")


def prompt_options(args: argparse.Namespace) -> dict[str, Any]:
    """How prompts are made and replies read (the LLM's ``chat_template``,
    ``tool_parser``, ``reasoning_parser``), from the command line (the LLM
    checks them: a ValueError, exit status 2)."""
    options: dict[str, Any] = {"tool_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser}
    if args.chat_template is not None:
        try:
            options["chat_template"] = Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: {e}") from None
    return {k: v for k, v in options.items() if v is not None}


def describe_limits(args: argparse.Namespace, memory_budget: int | None, host_budget: int) -> str:
    """The server's limits in one line, for the log at start."""
    gib = 1 << 30
    persist = args.persist_sessions if args.persist_sessions is not None else args.session_dir is not None
    return ", ".join([
        f"sessions {args.max_sessions or 'bounded by memory'}",
        f"session state {memory_budget / gib:.1f} GiB" if memory_budget is not None else "session state: the device's",
        f"offloaded {host_budget / gib:.1f} GiB",
        f"idle sessions parked after {args.session_ttl:g} s" if args.session_ttl is not None else "no session TTL",
        f"parked to {args.session_dir}/.live" if persist else "parked = closed (no --session-dir)",
        f"saved sessions {args.max_session_files} files, {args.max_session_files_bytes / gib:.1f} GiB a key",
        f"bodies up to {args.max_body_bytes} bytes" if args.max_body_bytes else "bodies up to 32 bytes a context token",
        f"{args.max_connections} connections",
        f"request head in {args.header_timeout:g} s, body in {args.body_timeout:g} s",
    ])


def describe_defaults(config: dict[str, Any]) -> str:
    """The sampling defaults a generation config gives requests that leave
    them unset, as the start line names them."""
    from ..llm.interface import generation_defaults

    d = generation_defaults(config)
    sampling = d["temperature"] > 0
    named = [f"temperature {d['temperature']:g}"] if sampling else ["greedy (do_sample is not set)"]
    for name, neutral in (("top_k", 0.0), ("top_p", 1.0), ("min_p", 0.0)):
        if sampling and d[name] != neutral:
            named.append(f"{name} {d[name]:g}")
    if d["repetition_penalty"] != 1.0:
        named.append(f"repetition_penalty {d['repetition_penalty']:g}")
    return ", ".join(named)


def compute_threads(requested: int | None, device: str) -> int | None:
    """The model's CPU thread count for ``serve`` (None: leave torch's)."""
    if requested is not None:
        return requested
    if not device.startswith("cpu"):
        return None
    from ..llm.interface import usable_cpus

    return max(1, usable_cpus() - 1)


def not_a_package(package: str) -> str | None:
    """Why ``package`` is a model export would take rather than a package
    (a saved transformers folder, an ``owner/name`` hub id: a bare name is
    more likely a mistyped file), with the command that makes one;
    None where it may be a package (the engine says what else is wrong)."""
    path = Path(package)
    if path.is_dir() and (path / "config.json").is_file():
        what = f"{package} is a saved transformers model (it has config.json), not a package"
    elif not path.exists() and not package.endswith(".pt2") and "/" in package and HUB_ID.fullmatch(package):
        what = f"{package} is no file here; as a Hugging Face hub id it names a model, not a package"
    else:
        return None
    return (f"{what}: serve takes a .pt2 package that export makes from it: aoti-sessions export {package} "
            f"-o model.pt2 [--device cuda --dtype bfloat16], then aoti-sessions serve model.pt2")


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (bound as uvicorn binds it),
    or None: checked before the model loads, so a taken port costs no load."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot listen on {host}: {e}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            from ._fleet import TAKEN, holds_port

            if holds_port(port):
                return TAKEN.format(port=port)
            return f"cannot listen on {host}:{port}: {e.strerror or e} (give another --port)"
    return None


def run(args: argparse.Namespace) -> int:
    api_keys = read_api_keys(args.api_keys) if args.api_keys is not None else []
    Keys(args.api_key, api_keys)  # (a bad key refused at once)
    for problem in (not_a_package(args.package), port_taken(args.host, args.port)):
        if problem is not None:
            print(f"aoti-sessions serve: {problem}", file=sys.stderr)
            return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"aoti-sessions serve needs FastAPI and uvicorn (missing: {e.name}): "
              "pip install 'aoti-sessions[serve]'", file=sys.stderr)
        return 2
    from ._app import create_app, served_names
    from ._open import open_llm
    from ._middleware import check_origins

    check_origins(args.allowed_origins or ())  # (refused at once: ValueError, exit status 2)
    if args.served_model_name is not None:
        served_names(args.served_model_name, "")

    if args.session_dir is not None:
        Path(args.session_dir).mkdir(parents=True, exist_ok=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key and not api_keys:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    if args.persist_sessions and args.session_dir is None:
        print("aoti-sessions serve: --persist-sessions needs --session-dir", file=sys.stderr)
        return 2
    memory_budget, host_budget = default_budgets(args.device, available_memory())
    memory_budget = args.memory_budget if args.memory_budget is not None else memory_budget
    host_budget = args.host_budget if args.host_budget is not None else host_budget
    engine_options = {k: v for k, v in (("max_sessions", args.max_sessions), ("memory_budget", memory_budget),
                                        ("host_budget", host_budget), ("idle_timeout", args.idle_timeout),
                                        ("rewind_checkpoints", args.rewind_checkpoints),
                                        ("prefix_cache", args.prefix_cache),
                                        ("prefix_cache_bytes", args.prefix_cache_bytes),
                                        ("trust_op_modules", args.trust_op_modules)) if v is not None}
    if args.engine_process:
        engine_options.update(engine_timeout=args.engine_timeout, step_timeout=args.step_timeout)
    engine_options.update(prompt_options(args))
    # The model's kernels and the server's event loop share the CPUs: a
    # parallel kernel waits for its slowest thread, so one the loop preempts
    # stalls every step.
    threads = compute_threads(args.threads, args.device)
    from ..llm.interface import usable_cpus
    from ._fleet import default_api_workers

    workers = args.api_workers if args.api_workers is not None else \
        default_api_workers(args.device, usable_cpus()) if args.engine_process else 1
    if workers > 1 and not args.engine_process:
        print("aoti-sessions serve: --api-workers above 1 needs the engine process (not --no-engine-process)",
              file=sys.stderr)
        return 2
    llm = open_llm(args.package, device=args.device, threads=threads, engine_process=args.engine_process,
                   engine_options=engine_options)  # (a chat template or parser refused: ValueError, exit status 2)
    kernels = f", {threads} CPU thread{'s' if threads != 1 else ''} for its kernels" if threads is not None else ""
    print(f"aoti-sessions serve: {llm.name} on {llm.device}{kernels}", file=sys.stderr, flush=True)
    print(f"aoti-sessions serve: limits: {describe_limits(args, memory_budget, host_budget)}", file=sys.stderr,
          flush=True)
    print(f"aoti-sessions serve: sampling defaults from the package's generation config (a request's own values "
          f"take precedence): {describe_defaults(llm.generation_config)}", file=sys.stderr, flush=True)
    try:
        from ._http import server_config, stop_when_the_engine_dies

        options = dict(api_key=args.api_key, session_dir=args.session_dir, max_body_bytes=args.max_body_bytes,
                       session_ttl=args.session_ttl, persist_sessions=args.persist_sessions,
                       body_timeout=args.body_timeout, api_keys=api_keys, max_session_files=args.max_session_files,
                       max_session_files_bytes=args.max_session_files_bytes, model_name=args.served_model_name,
                       allowed_origins=args.allowed_origins or (), stats_interval=args.stats_interval)
        if workers > 1:
            from ._fleet import ServeError, serve

            try:
                serve(llm, args.package, workers, host=args.host, port=args.port, app_options=options,
                      server_options=dict(max_connections=args.max_connections, header_timeout=args.header_timeout))
            except ServeError as e:
                print(f"aoti-sessions serve: {e}", file=sys.stderr)
                return 2
            return _exit_status(llm)
        app = create_app(llm, **options)
        server = uvicorn.Server(server_config(app, args.host, args.port, max_connections=args.max_connections,
                                              header_timeout=args.header_timeout, log_level="info",
                                              log_config=None))  # (uvicorn's lines through the command's logs)
        if args.engine_process:
            stop_when_the_engine_dies(llm, server)
        server.run()
    finally:
        llm.close()
    return _exit_status(llm)


def _exit_status(llm: Any) -> int:
    """1 where the engine process died (the server stopped for it), else 0.

    The server does not start a new engine process itself: the sessions the
    dead one held are gone, and whatever killed it (the out-of-memory killer, a
    device fault) is a supervisor's to see and count; a supervisor (systemd,
    Kubernetes; Serve for a cluster's replica) starts the server again, which
    serves the sessions parked in --session-dir (at their TTL, or at stops)."""
    from ..errors import EngineProcessError

    ended = llm.wait_ended(0) if hasattr(llm, "wait_ended") else None
    if not isinstance(ended, EngineProcessError):
        return 0
    print(f"aoti-sessions serve: {ended}: stopped with exit status 1, for a supervisor to start it again",
          file=sys.stderr, flush=True)
    return 1
