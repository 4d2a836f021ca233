"""The forward-or-flush decision (docs/architecture.md "Write path" 4), shared by the node actor and the
scale simulation so both run the same code. It lives with the node (dstl_ray.node.routing):
topology depends on dstl_ray.node, never the reverse."""

from __future__ import annotations

from dstl_ray.node.routing import should_flush

__all__ = ["should_flush"]
