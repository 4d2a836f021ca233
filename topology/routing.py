"""The forward-or-flush decision (docs/architecture.md "Write path" 4), shared by the node actor and the
scale simulation so both run the same code."""

from __future__ import annotations


def should_flush(has_parent: bool, batch_bytes: int, flush_bytes: int) -> bool:
    """A node writes the batch itself if it is the root or holds at least ``flush_bytes``;
    otherwise it forwards the whole batch to its parent (FLIP-158 "Future directions": each
    node proxies requests up to the root unless it has gathered enough data)."""
    return not has_parent or batch_bytes >= flush_bytes
