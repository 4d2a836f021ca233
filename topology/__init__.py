"""The aggregation tree: building it from Ray's nodes, placing one node actor per Ray node,
and finding the nearest node actor from any process on a Ray node (node actors' names and the
lookup live in :mod:`dstl_ray.transport.discovery`, where writers' transports find their node;
re-exported here)."""

from dstl_ray.transport.discovery import (
    NODE_PREFIX,
    find_nearest_node,
    list_node_actors,
    node_actor_name,
)

from .placement import place_tree
from .tree import TreePosition, build_tree

__all__ = [
    "NODE_PREFIX",
    "TreePosition",
    "build_tree",
    "find_nearest_node",
    "list_node_actors",
    "node_actor_name",
    "place_tree",
]
