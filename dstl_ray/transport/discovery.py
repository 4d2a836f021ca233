"""Finding node actors from any process on a Ray node: a driver, a task, an actor, a Spark
Python worker (docs/architecture.md "Tree" and "Spark glue").

Node actors are named actors of the tree's Ray namespace: :data:`NODE_PREFIX` and the head of
their Ray node's id, so any process can find its own node's actor by name. Writers' transports
find their node here, node actors their peers, and ``topology`` (which places them, and
re-exports these names) builds on it.

Order of evidence for the nearest node: inside a Ray worker (task or actor) the runtime context
names our node; otherwise ``RAY_RAYLET_PID`` (inherited from the raylet by Spark executors'
Python workers, and unique per Ray node even when every node shares one IP) is matched against
the node actors'; then the node the driver is connected to. If nothing matches: the root, never
an error.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import NodeUnavailableError

__all__ = ["NODE_PREFIX", "find_nearest_node", "list_node_actors", "node_actor_name",
           "node_infos"]

log = logging.getLogger(__name__)

NODE_PREFIX = "dstl-node-"  # node actors' names: this prefix and the Ray node id's head


def node_actor_name(node_id: str) -> str:
    """The name of the node actor of Ray node ``node_id``."""
    return NODE_PREFIX + node_id[:16]


def list_node_actors(namespace: str) -> list[str]:
    """The names of every node actor of the tree in ``namespace``, sorted."""
    import ray  # lazy: importing dstl_ray must not start loading Ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in names
                  if a.get("namespace") == namespace and a["name"].startswith(NODE_PREFIX))


def node_infos(namespace: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, handle, ``info()``) of every node actor of ``namespace`` that answers."""
    import ray

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
    import ray

    ctx = ray.get_runtime_context()
    in_worker = ctx.worker.mode == ray.WORKER_MODE
    candidates: list[tuple[str, str]] = []
    if in_worker:
        candidates.append((node_actor_name(ctx.get_node_id()), "runtime context"))
    pid = os.environ.get("RAY_RAYLET_PID")
    infos = None
    if pid and not in_worker:
        infos = node_infos(namespace)
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
        infos = node_infos(namespace)
    for name, h, info in infos:
        if info.get("parent") is None:
            return name, h, "root (fallback)"
    if infos:
        return infos[0][0], infos[0][1], "any node (fallback)"
    raise NodeUnavailableError(
        f"no dstl-ray node actors in namespace {namespace!r}: run dstl_ray.deploy() or "
        f"'dstl-ray up' first")
