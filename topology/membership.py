"""Membership changes of the tree (run by the root's watcher, or on ``dstl-ray up``).

Nodes that joined Ray are appended to the node order, so they attach as leaves and nobody else
moves; nodes that left are removed from the order and the tree is rebuilt from it, so their
children re-attach deterministically. The actor of a node that left is killed (it could never be
rescheduled: its placement is pinned to that node).
"""

from __future__ import annotations

import logging

import ray

from dstl_ray.config import ChangelogConfig
from dstl_ray.transport.discovery import node_infos

from .placement import alive_nodes, node_actor_name, node_order, place_tree

log = logging.getLogger(__name__)


def recover_order(config: ChangelogConfig) -> list[str] | None:
    """The order as the live node actors remember it (after a root restart)."""
    infos = node_infos(config.namespace)
    if not infos:
        return None
    return [i["node_id"] for _, _, i in sorted(infos, key=lambda t: t[2].get("index", 0))]


def next_order(order: list[str], alive: list[str]) -> list[str]:
    """``order`` without nodes that left, then the joined ones (by node id)."""
    alive_set = set(alive)
    kept = [n for n in order if n in alive_set]
    joined = sorted(n for n in alive if n not in set(order))
    # the head node stays the root even if it was missing from a recovered order
    head = alive[0] if alive else None
    if head is not None and head in joined:
        joined.remove(head)
        kept.insert(0, head)
    return kept + joined


def reconcile(base_path: str, config: ChangelogConfig, order: list[str] | None
              ) -> list[str]:
    """Bring the tree in line with Ray's alive nodes; returns the (new) order."""
    if order is None:
        order = recover_order(config) or []
    alive = node_order(alive_nodes())
    new = next_order(order, alive)
    if new == order:
        return order
    left = [n for n in order if n not in set(new)]
    log.info("tree membership changed: +%d -%d nodes", len(set(new) - set(order)), len(left))
    for nid in left:
        try:
            ray.kill(ray.get_actor(node_actor_name(nid), namespace=config.namespace),
                     no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    place_tree(base_path, config, order=new, detached=True, reconcile=reconcile)
    return new
