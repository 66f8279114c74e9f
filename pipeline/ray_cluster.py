"""Which Ray cluster a job runs on: the one RAY_ADDRESS names (as under `ray job submit`), else a new local one.

A local cluster is started with `address="local"`, so a job never silently joins another local cluster, and with
its dashboard (the State API server) on a free loopback port that its processes are told about: Ray Train frees a
finished or killed run's workers (its placement group) from a helper that finds the cluster through the State
API, and on a machine with several local Ray instances that lookup is otherwise ambiguous and fails, leaving the
resources held. RAY_API_SERVER_ADDRESS names a place; it changes no behaviour.
"""

from __future__ import annotations

import os
import socket


def init_ray(num_cpus: int | None = None) -> str:
    """Join or start the job's cluster (no-op if this process is already connected); returns what it did."""
    import ray

    if ray.is_initialized():
        return "already connected to a Ray cluster"
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return f"joined Ray cluster at {os.environ['RAY_ADDRESS']}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=port, runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}})
    return f"started a local Ray cluster: {ray.cluster_resources()}"
