"""A deterministic static tree over an ordered list of nodes (FLIP-158 "Future directions").

Node ``i`` of the order (the root, i.e. the head node, is 0) has parent ``(i - 1) // b``: a
complete b-ary tree filled level by level. Nodes that join later are appended to the order, so
they attach as leaves and nobody else moves; when a node leaves, the order without it is used
again, so its children re-attach deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TreePosition:
    node: str
    index: int
    parent: str | None
    level: int
    children: tuple[str, ...]
    height: int = 0  # levels below this node (0 for a leaf)


def build_tree(order: Sequence[str], branching: int) -> dict[str, TreePosition]:
    """Positions of every node in ``order`` (root first) in a ``branching``-ary tree."""
    if branching < 1:
        raise ValueError(f"branching factor must be >= 1, got {branching}")
    if len(set(order)) != len(order):
        raise ValueError("node order has duplicates")
    n = len(order)
    levels = [0] * n
    for i in range(1, n):
        levels[i] = levels[(i - 1) // branching] + 1
    heights = [0] * n
    for i in range(n - 1, 0, -1):  # children have larger indices than their parent
        p = (i - 1) // branching
        heights[p] = max(heights[p], heights[i] + 1)
    out = {}
    for i, node in enumerate(order):
        parent = order[(i - 1) // branching] if i else None
        kids = tuple(order[j] for j in range(i * branching + 1, min(n, (i + 1) * branching + 1)))
        out[node] = TreePosition(node, i, parent, levels[i], kids, heights[i])
    return out


def path_to_root(tree: dict[str, TreePosition], node: str) -> list[str]:
    """``node``, its parent, ..., the root."""
    out = [node]
    while tree[out[-1]].parent is not None:
        out.append(tree[out[-1]].parent)  # type: ignore[arg-type]
    return out


def depth(tree: dict[str, TreePosition]) -> int:
    return max((p.level for p in tree.values()), default=0)
