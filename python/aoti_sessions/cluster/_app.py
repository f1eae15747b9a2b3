"""The cluster as a Ray Serve application: the ingress deployment in front
of the engine replicas' deployment, routed by :class:`SessionRouter`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..serve.interface import Keys, read_api_keys
from . import _env
from ._ingress import Ingress
from ._replica import Replica
from ._router import SessionRouter

ROUTING_STATS_PERIOD_S = 0.5  # how often each replica tells the router what it holds


def engines(package: str | Path, *, replicas: int = 2, session_dir: str | Path, device: str = "cpu",
            threads: int | None = None, engine: dict[str, Any] | None = None, server: dict[str, Any] | None = None,
            cpus_per_replica: float = 1.0, max_ongoing_requests: int = 1024, engine_process: bool = True,
            loopback: bool = False) -> Any:
    """The engine replicas' deployment, bound: what the ingress (a Serve
    deployment, :func:`app`, or the command line's own HTTP front) routes to.
    Arguments as :func:`app`'s."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if not Path(package).exists():
        raise FileNotFoundError(f"no LLM package at {package}")
    folder = Path(session_dir)
    folder.mkdir(parents=True, exist_ok=True)
    gpu = device.startswith("cuda")
    routing: dict[str, Any] = {"request_router_class": SessionRouter,
                               "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    deployment = serve.deployment(
        name="engine", num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": 0 if gpu else cpus_per_replica, "num_gpus": 1 if gpu else 0,
                           "runtime_env": _env.runtime_env()},
        request_router_config=RequestRouterConfig(**routing),
        health_check_period_s=2.0, graceful_shutdown_timeout_s=120.0)(Replica)
    return deployment.bind(str(Path(package).resolve()), session_dir=str(folder.resolve()), device=device,
                           threads=threads, engine=engine, server=server, engine_process=engine_process,
                           loopback=loopback)


def app(package: str | Path, *, replicas: int = 2, session_dir: str | Path, device: str = "cpu",
        threads: int | None = None, api_key: str | None = None, api_keys: Sequence[str] = (),
        engine: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None, cpus_per_replica: float = 1.0, max_ongoing_requests: int = 1024,
        max_body_bytes: int = 64 << 20, engine_process: bool = True, loopback: bool = False,
        allowed_origins: Sequence[str] = ()) -> Any:
    """The application of ``replicas`` engines of ``package`` behind an
    ingress deployment (Serve's HTTP proxy in front).

    Args:
        session_dir: a folder every replica reads and writes (on many
            machines, shared storage): session files, and the checkpoints
            sessions survive a replica's loss by.
        device: ``cpu`` or ``cuda``; on CUDA each replica takes one GPU.
        threads: the model's CPU threads per replica.
        api_key: the key every endpoint but ``/health`` wants.
        api_keys: more keys, each a tenant of its own, as
            :func:`aoti_sessions.serve.create_app` takes them (the ingress
            and every replica check them).
        engine: the engine's options (``max_sessions``, ``memory_budget``,
            ``host_budget``, ``idle_timeout``, ``rewind_checkpoints``).
        server: :func:`aoti_sessions.serve.create_app`'s options (its
            ``allowed_origins`` are the ingress's: below).
        engine_process: each replica's engine in a process of its own (as
            ``aoti-sessions serve`` runs it; False: in the replica's).
        loopback: the cluster is local and talks on 127.0.0.1 only (see
            :mod:`aoti_sessions.cluster._local`).
        allowed_origins: origins whose pages may call the cluster from a
            browser (CORS, answered by the ingress).
    """
    from ray import serve

    from ..serve.interface import check_origins

    api_keys = list(api_keys)
    Keys(api_key, api_keys)  # (refused here, not in each replica)
    check_origins(allowed_origins)
    server = {**(server or {}), "api_key": api_key, "api_keys": api_keys}
    bound = engines(package, replicas=replicas, session_dir=session_dir, device=device, threads=threads,
                    engine=engine, server=server, cpus_per_replica=cpus_per_replica,
                    max_ongoing_requests=max_ongoing_requests, engine_process=engine_process, loopback=loopback)
    front = serve.deployment(name="ingress", num_replicas=1, max_ongoing_requests=100_000,
                             ray_actor_options={"num_cpus": 0, "runtime_env": _env.runtime_env()})(Ingress)
    return front.bind(bound, api_key=api_key, api_keys=api_keys, max_body_bytes=max_body_bytes, loopback=loopback,
                      allowed_origins=list(allowed_origins))


def build_app(args: dict[str, Any]) -> Any:
    """``serve run aoti_sessions.cluster:build_app package=P session_dir=D
    replicas=N device=cuda``: :func:`app` of those arguments (``api_keys_file``:
    the keys of ``api_keys``, read as ``--api-keys`` reads them)."""
    options = dict(args)
    if "api_keys_file" in options:
        options["api_keys"] = read_api_keys(options.pop("api_keys_file"))
    for name, kind in (("replicas", int), ("threads", int), ("cpus_per_replica", float),
                       ("max_ongoing_requests", int), ("max_body_bytes", int)):
        if name in options:
            options[name] = kind(options[name])
    if isinstance(options.get("allowed_origins"), str):  # (origins separated by commas)
        options["allowed_origins"] = [o.strip() for o in options["allowed_origins"].split(",") if o.strip()]
    for name in ("engine_process", "loopback"):
        if isinstance(options.get(name), str):
            options[name] = _flag(name, options[name])
    return app(options.pop("package"), session_dir=options.pop("session_dir"), **options)


def _flag(name: str, text: str) -> bool:
    """A yes / no argument of ``serve run`` (given as text)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {text!r}")
