"""The node actor and its parts (docs/architecture.md "Write path" 3-6); see
:mod:`dstl_ray.node.actor` for how they fit together."""

from .actor import ChangelogNode
from .peers import NODE_PREFIX, list_node_actors
from .routing import should_flush
from .stats import NodeCounters, current_rss_kb

__all__ = ["NODE_PREFIX", "ChangelogNode", "NodeCounters", "current_rss_kb",
           "list_node_actors", "should_flush"]
