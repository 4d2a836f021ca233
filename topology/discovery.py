"""Finding the nearest node actor from any process on a Ray node: a driver, a task, an actor,
or a Spark Python worker (docs/architecture.md "Spark glue").

Order of evidence: inside a Ray worker (task or actor) the runtime context names our node;
otherwise ``RAY_RAYLET_PID`` (inherited from the raylet by Spark executors' Python workers, and
unique per Ray node even when every node shares one IP) is matched against the node actors';
then the node the driver is connected to. If nothing matches: the root, never an error.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from dstl_ray.errors import NodeUnavailableError
from dstl_ray.node.peers import list_node_actors

from .placement import node_actor_name

__all__ = ["find_nearest_node", "list_node_actors"]

log = logging.getLogger(__name__)


def _infos(namespace: str) -> list[tuple[str, Any, dict[str, Any]]]:
    out = []
    for name in list_node_actors(namespace):
        try:
            h = ray.get_actor(name, namespace=namespace)
            out.append((name, h, ray.get(h.info.remote(), timeout=30)))
        except Exception as e:  # noqa: BLE001 - a dead node is just not a candidate
            log.debug("node actor %s unavailable: %s", name, e)
    return out


def find_nearest_node(namespace: str) -> tuple[str, Any, str]:
    """(actor name, handle, how it was chosen) of the nearest node actor."""
    ctx = ray.get_runtime_context()
    in_worker = ctx.worker.mode == ray.WORKER_MODE
    candidates: list[tuple[str, str]] = []
    if in_worker:
        candidates.append((node_actor_name(ctx.get_node_id()), "runtime context"))
    pid = os.environ.get("RAY_RAYLET_PID")
    infos = None
    if pid and not in_worker:
        infos = _infos(namespace)
        for name, h, info in infos:
            if info.get("raylet_pid") == pid:
                return name, h, "RAY_RAYLET_PID"
    if not in_worker:
        candidates.append((node_actor_name(ctx.get_node_id()), "connected node"))
    for name, how in candidates:
        try:
            return name, ray.get_actor(name, namespace=namespace), how
        except ValueError:
            pass
    if infos is None:
        infos = _infos(namespace)
    for name, h, info in infos:
        if info.get("parent") is None:
            return name, h, "root (fallback)"
    if infos:
        return infos[0][0], infos[0][1], "any node (fallback)"
    raise NodeUnavailableError(
        f"no dstl-ray node actors in namespace {namespace!r}: run dstl_ray.deploy() or "
        f"'dstl-ray up' first")
