"""The aggregation tree: building it from Ray's nodes, placing one node actor per Ray node,
and finding the nearest node actor from any process on a Ray node."""

from .discovery import find_nearest_node, list_node_actors
from .placement import NODE_PREFIX, node_actor_name, place_tree
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
