"""``aoti-sessions serve PACKAGE --replicas N [--ray-address ADDR]``: the
server on a Ray Serve cluster. Without ``--ray-address`` it starts a local
cluster on 127.0.0.1 (this machine's CPUs or GPUs); with one it joins that
cluster, whose replicas must all reach ``--session-dir``."""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from ..serve.interface import Keys, available_memory, default_budgets, prompt_options, read_api_keys
from . import _supervise

MAX_BODY_BYTES = 64 << 20  # the front's limit; each replica checks its own (by the model's context)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=_positive,
                        help="serve on a Ray Serve cluster of this many engine replicas (one GPU each with --device "
                             "cuda), sessions routed to the replica that holds them and checkpointed to "
                             "--session-dir after every turn (needs the [cluster] extra)")
    parser.add_argument("--ray-address",
                        help="with --replicas: the Ray cluster to join (auto, ray://HOST:PORT); default: start a "
                             "local one on 127.0.0.1")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The cluster command (``argv``: its arguments, to run it again in a
    session of its own where it starts a local cluster: _supervise.py)."""
    api_keys = read_api_keys(args.api_keys) if args.api_keys is not None else []
    Keys(args.api_key, api_keys)  # (a bad key refused at once)
    from . import _env

    _env.apply()  # before Ray Serve is imported
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError:
        print("aoti-sessions serve --replicas needs Ray Serve: pip install 'aoti-sessions[cluster]'", file=sys.stderr)
        return 2
    from ..serve.interface import check_origins, served_names

    check_origins(args.allowed_origins or ())  # (refused before any cluster starts: exit status 2)
    if args.served_model_name is not None:
        served_names(args.served_model_name, "")
    local = args.ray_address is None
    if local and not _supervise.in_child():
        return _supervise.supervised(argv)
    if local:
        _supervise.stop_with_parent()
    if not local and args.session_dir is None:
        print("aoti-sessions serve: --ray-address needs --session-dir, a folder every replica's machine reaches "
              "(shared storage): sessions are checkpointed there to survive a replica", file=sys.stderr)
        return 2
    session_dir = args.session_dir or tempfile.mkdtemp(prefix="aoti-sessions-cluster-")
    replicas, cpu = args.replicas, args.device.startswith("cpu")
    from ..llm.interface import usable_cpus
    from . import _local
    from ._app import engines
    from ._front import serve_front

    memory_budget, host_budget = default_budgets(args.device, available_memory() // (replicas if local else 1))
    engine = {k: v for k, v in (("max_sessions", args.max_sessions),
                                ("memory_budget", args.memory_budget or memory_budget),
                                ("host_budget", args.host_budget or host_budget), ("idle_timeout", args.idle_timeout),
                                ("rewind_checkpoints", args.rewind_checkpoints),
                                ("trust_op_modules", args.trust_op_modules)) if v is not None}
    engine.update(prompt_options(args))  # (each replica makes its prompts and reads its replies)
    threads = args.threads or (max(1, (usable_cpus() - 1) // replicas) if cpu and local else None)
    server = {"session_ttl": args.session_ttl, "body_timeout": args.body_timeout,
              "max_body_bytes": args.max_body_bytes, "max_session_files": args.max_session_files,
              "max_session_files_bytes": args.max_session_files_bytes, "model_name": args.served_model_name,
              "stats_interval": args.stats_interval,  # (each replica's line, in its Ray log)
              "api_key": args.api_key, "api_keys": api_keys}  # (each replica checks the keys too)
    cpus_per_replica = 1.0
    if local and cpu:  # a local cluster's CPUs shared by its replicas (each runs `threads` kernels)
        cpus_per_replica = min(1.0, usable_cpus() / replicas)
    if local and not cpu:
        import torch

        if torch.cuda.device_count() < replicas:
            print(f"aoti-sessions serve: {replicas} replicas need {replicas} GPUs (one each); this machine has "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
    if local:
        _local.start(num_gpus=None if cpu else replicas)
    else:
        ray.init(address=args.ray_address, log_to_driver=False)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key and not api_keys:
        print(f"aoti-sessions serve: listening on {args.host} without an API key: anyone who can reach it can use it",
              file=sys.stderr)
    try:
        serve.start(http_options={"location": "NoServer"})  # the front below answers HTTP
        replicas_handle = serve.run(engines(args.package, replicas=replicas, session_dir=session_dir,
                                            device=args.device, threads=threads, engine=engine, server=server,
                                            cpus_per_replica=cpus_per_replica, engine_process=args.engine_process,
                                            loopback=local),
                                    name="aoti-sessions", route_prefix=None)
        print(f"aoti-sessions serve: {replicas} replicas of {args.package} on {args.device}, at "
              f"http://{args.host}:{args.port}; sessions checkpointed to {session_dir}"
              + ("; Ray dashboard http://127.0.0.1:8265" if local else ""), file=sys.stderr, flush=True)
        serve_front(replicas_handle, args.host, args.port, api_key=args.api_key, api_keys=api_keys,
                    allowed_origins=args.allowed_origins or (),
                    max_body_bytes=args.max_body_bytes or MAX_BODY_BYTES, max_connections=args.max_connections,
                    header_timeout=args.header_timeout)
        print("aoti-sessions serve: stopping: every replica parks its sessions in the session dir", file=sys.stderr,
              flush=True)
    finally:
        stop_serve: Any = serve.shutdown  # (untyped)
        stop_serve()
        ray.shutdown()
    return 0
