"""From inside a Spark task's Python worker: connect to Ray once per worker process and find
the node actor of this executor's Ray node (docs/architecture.md "Spark glue").

RayDP runs executors as Ray actors; the Python worker a Spark task runs in is forked by its
executor and inherits ``RAY_RAYLET_PID`` from the executor's raylet, which identifies the Ray
node even on a one-machine test cluster where every node has the same IP. If anything is
uncertain the root is used: the task never fails because of discovery.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_connected: tuple[str, str] | None = None
_nearest: dict[str, tuple[str, str]] = {}


def connect(gcs_address: str, namespace: str) -> None:
    """``ray.init`` once per Python worker process (a no-op when already connected), in the
    cluster's authentication mode (:mod:`dstl_ray.transport.auth`): a worker in token mode on a cluster
    without tokens cannot be called back, and node actors on other Ray nodes then fail to
    fetch its large persist requests with ``OwnerDiedError``."""
    global _connected
    import ray

    from dstl_ray.transport.auth import use_cluster_auth_mode

    with _lock:
        if ray.is_initialized():
            return
        use_cluster_auth_mode(gcs_address)
        ray.init(address=gcs_address, namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
        _connected = (gcs_address, namespace)


def nearest_node_name(gcs_address: str, namespace: str) -> tuple[str, str]:
    """(node actor name, how it was chosen) for this worker process, cached per process."""
    from topology import find_nearest_node

    connect(gcs_address, namespace)
    key = f"{namespace}:{os.environ.get('RAY_RAYLET_PID', '')}"
    with _lock:
        hit = _nearest.get(key)
    if hit is not None:
        return hit
    name, _, how = find_nearest_node(namespace)
    with _lock:
        _nearest[key] = (name, how)
    return name, how
