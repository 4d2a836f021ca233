"""This node's place in the tree and its peers (docs/architecture.md "Tree"): the other node
actors, found by name in the tree's Ray namespace.

``topology`` (placement, discovery) builds on these names; this package never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NODE_PREFIX = "dstl-node-"  # node actors' names: this prefix and the Ray node id's head


def list_node_actors(namespace: str) -> list[str]:
    """The names of every node actor of the tree in ``namespace``, sorted."""
    import ray  # lazy: importing dstl_ray must not start loading Ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in names
                  if a.get("namespace") == namespace and a["name"].startswith(NODE_PREFIX))


@dataclass
class Place:
    """Where this node sits; ``set_parent`` moves it (tree changes)."""

    name: str
    parent: str | None = None
    level: int = 0
    index: int = 0
    height: int = 0


class Peers:
    """Actor handles of other nodes by name, looked up once and kept until a call fails."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.handles: dict[str, Any] = {}

    def actor(self, name: str) -> Any:
        h = self.handles.get(name)
        if h is None:
            import ray  # lazy: unit tests build nodes without Ray

            h = ray.get_actor(name, namespace=self.namespace)
            self.handles[name] = h
        return h

    def drop(self, name: str | None) -> None:
        """Forget ``name``'s handle (its actor failed a call): looked up again next time."""
        if name is not None:
            self.handles.pop(name, None)
