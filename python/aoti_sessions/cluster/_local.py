"""A local Ray cluster that talks on loopback only.

On Linux, Ray replaces a node address of 127.0.0.1 by the machine's own
address (so that other machines could join) unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` says the cluster is this machine
alone; then every Ray process binds and connects on 127.0.0.1, the dashboard
too. One server is left: Ray Serve 2.60's replica starts its inter-deployment
gRPC server on ``[::]:0`` (every address) with no option to change it; a
replica of a local cluster binds it to 127.0.0.1 instead
(:func:`keep_replica_on_loopback`), where the cluster's other processes,
told the node is 127.0.0.1, reach it.
"""

from __future__ import annotations

import os
from typing import Any

LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOOPBACK = "127.0.0.1"


def start(num_cpus: int | None = None, num_gpus: int | None = None, dashboard: bool = True) -> None:
    """Starts a Ray cluster on this machine alone, every process on 127.0.0.1."""
    from . import _env

    os.environ.update(LOCAL_ONLY_ENV)  # Ray's processes read it as they start
    _env.apply()
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # this one read it when it imported ray

    options: dict[str, Any] = {"_node_ip_address": LOOPBACK, "include_dashboard": dashboard,
                               "dashboard_host": LOOPBACK, "log_to_driver": False,
                               "runtime_env": {"env_vars": {**LOCAL_ONLY_ENV, **_env.serve_env()}}}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    if num_gpus is not None:
        options["num_gpus"] = num_gpus
    ray.init(**options)


def keep_replica_on_loopback() -> None:
    """In a replica of a local cluster: its inter-deployment gRPC server
    (started after the replica's constructor) binds 127.0.0.1, not every
    address."""
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server")
    if getattr(bind, "_loopback", False):
        return

    def bind_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"{LOOPBACK}:{port}"
        return int(bind(server, address))

    setattr(bind_loopback, "_loopback", True)
    setattr(replica, "add_port_to_grpc_server", bind_loopback)
