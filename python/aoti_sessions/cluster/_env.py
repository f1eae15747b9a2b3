"""The Ray Serve settings every process of the cluster runs with.

Serve's throughput-optimized mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``,
Ray 2.55 and later): a handle calls its replica over gRPC, straight to the
replica's own server, instead of as a Ray actor task, and a replica's
methods run on the replica's own event loop instead of a thread of their
own. Its direct ingress (ingress replicas answering HTTP on ports of their
own) stays off: the command's front, or Serve's proxy under ``serve run``,
answers HTTP. bench/bench_cluster.py measures the cluster's overhead with
these settings and with Serve's defaults.

Serve reads these as its modules load, in every process: the driver (the
command's front, where the handle's router runs) sets them before it
imports Ray Serve, and each deployment's replicas get them through their
runtime environment. A value already in the environment is kept.
"""

from __future__ import annotations

import os

SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
             # A handle's router keeps a loop of its own: the command's front
             # runs uvicorn's loop, which is closed before Serve, stopping,
             # shuts the handle's router down (on a closed loop it fails).
             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}


def serve_env() -> dict[str, str]:
    """The settings as this process has them (a value already set kept)."""
    return {name: os.environ.get(name, value) for name, value in SERVE_ENV.items()}


def runtime_env() -> dict[str, dict[str, str]]:
    """A deployment's ``runtime_env`` carrying them to its replicas."""
    return {"env_vars": serve_env()}


def apply() -> None:
    """Sets them in this process, for a Ray Serve imported after this."""
    os.environ.update(serve_env())
