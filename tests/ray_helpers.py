"""A real local Ray (127.0.0.1, 2 CPUs) serving one carpool application,
for the Ray Serve tests. Imported only by them (Ray is a test extra)."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray import serve

from carpool.ray_serve.app import application, settings_from_args
from carpool.ray_serve.driver import stop_driver_router


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(app_name: str, args: dict, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start Ray and Serve, run carpool's application of ``args``
    (``settings_from_args``) as ``app_name``; yields its base URL; stops
    both after. ``env``: variables for the processes Ray starts (set
    before ``ray.init``, restored after)."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(settings_from_args(args)), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        stop_driver_router()  # the tests' handles started it in this process
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
