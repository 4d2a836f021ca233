"""The node actor and its parts (docs/architecture.md "Write path" 3-6); see
:mod:`dstl_ray.node.actor` for how they fit together."""

from .actor import ChangelogNode
from .routing import should_flush
from .stats import NodeCounters, current_rss_kb

__all__ = ["ChangelogNode", "NodeCounters", "current_rss_kb", "should_flush"]
