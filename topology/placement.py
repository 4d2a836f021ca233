"""Placing one ``ChangelogNode`` actor per Ray node, pinned with
``NodeAffinitySchedulingStrategy(soft=False)``, named and in a namespace so any process of the
cluster can find it."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dstl_ray.config import ChangelogConfig
from dstl_ray.node import ChangelogNode
from dstl_ray.node.membership import Reconcile
from dstl_ray.transport.discovery import NODE_PREFIX, node_actor_name

from .tree import TreePosition, build_tree

__all__ = ["NODE_PREFIX", "alive_nodes", "node_actor_name", "node_order", "place_tree"]

RemoteChangelogNode = ray.remote(ChangelogNode)


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _is_head(n: dict[str, Any]) -> bool:
    return any(k.startswith("node:__internal_head__") for k in n.get("Resources", {}))


def node_order(nodes: list[dict[str, Any]]) -> list[str]:
    """Head node first, then the others in a deterministic order (by node id)."""
    heads = [n["NodeID"] for n in nodes if _is_head(n)]
    others = sorted(n["NodeID"] for n in nodes if not _is_head(n))
    return heads + others


def place_tree(base_path: str, config: ChangelogConfig, order: list[str] | None = None,
               detached: bool = True, *, reconcile: Reconcile | None
               ) -> dict[str, tuple[TreePosition, Any]]:
    """Create (or reuse) the node actors for ``order`` (default: every alive Ray node).
    ``reconcile`` (``topology.membership.reconcile``; required, so no caller forgets it): the
    root's membership watcher keeps the tree in line with Ray's nodes with it; None: no
    watcher (the tree stays as placed).

    Returns node id -> (tree position, actor handle).
    """
    if order is None:
        order = node_order(alive_nodes())
    tree = build_tree(order, config.branching_factor)
    names = {nid: node_actor_name(nid) for nid in order}
    placed: dict[str, tuple[TreePosition, Any]] = {}
    for nid in order:
        pos = tree[nid]
        parent = names[pos.parent] if pos.parent is not None else None
        opts: dict[str, Any] = dict(
            name=names[nid], namespace=config.namespace, get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
        )
        if detached:
            opts["lifetime"] = "detached"
        actor = RemoteChangelogNode.options(**opts).remote(
            nid, names[nid], base_path, config, parent, pos.level, pos.index, pos.height,
            reconcile)
        placed[nid] = (pos, actor)
    # (re-)attach: actors may exist already with another parent; children before parents
    for p, a in sorted(placed.values(), key=lambda pa: -pa[0].level):
        ray.get(a.set_parent.remote(names[p.parent] if p.parent else None, p.level, p.index,
                                    p.height))
    root_pos, root = placed[order[0]]
    ray.get(root.set_tree.remote(list(order)))
    return placed
