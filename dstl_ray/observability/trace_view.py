"""Looking at one checkpoint's path through the tree (``dstl-ray trace``).

Reads exported spans (``tracing=file:<dir>`` JSON lines, or dicts from ``memory`` mode),
groups the persist requests that a flush served together, and draws the tree: each node with
its level, each hop with the bytes it carried and the time it took, the flushing node with its
file and DFS put time.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from typing import Any

from ..plotting import pyplot


def load_spans(directory: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "spans-*.jsonl"))):
        with open(path) as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return out


def flushes(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``dstl.dfs.put`` spans in time order: one per file, i.e. per flush."""
    return sorted((s for s in spans if s["name"] == "dstl.dfs.put"), key=lambda s: s["start_ns"])


def request_paths(spans: list[dict[str, Any]], put: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """For one flush: the chain of spans (writer -> node ... -> flushing node) of every
    persist request it served."""
    by_id = {s["span_id"]: s for s in spans}
    ends = [put["parent_id"], *put.get("links", [])]
    paths = []
    for end in ends:
        chain = []
        cur = by_id.get(end)
        while cur is not None:
            chain.append(cur)
            cur = by_id.get(cur["parent_id"]) if cur["parent_id"] else None
        paths.append(list(reversed(chain)))
    return paths


def hops(spans: list[dict[str, Any]], put: dict[str, Any]) -> dict[tuple[str, str], dict[str, float]]:
    """(from node, to node) -> bytes and ms, for the requests of one flush."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"bytes": 0.0, "ms": 0.0,
                                                                        "requests": 0})
    for path in request_paths(spans, put):
        nodes = [s for s in path if s["name"] == "dstl.node"]
        for a, b in zip(nodes, nodes[1:], strict=False):
            h = out[(a["attributes"]["dstl.node"], b["attributes"]["dstl.node"])]
            h["bytes"] += b["attributes"].get("dstl.bytes", 0)
            h["ms"] = max(h["ms"], (b["start_ns"] - a["start_ns"]) / 1e6)
            h["requests"] += 1
    return dict(out)


def stage_breakdown(spans: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Where one flush's time went, per flush, along its slowest persist request: ``send``
    (the writer's persist call to the first node actor taking it: the writer's work, its
    sender thread, the Ray call), ``tree`` (node to node, each level's batching included),
    ``batch`` (at the flushing node, until the put starts: waiting for the other sources,
    and the hand-off to the flush thread), ``put`` (the DFS write, fsynced), and ``reply``
    (from the put's end until the writer's persist completed: answers down the tree, the
    Ray reply, the delivery thread). ms; one dict per flush, in time order."""
    out = []
    for put in flushes(spans):
        best: dict[str, float] | None = None
        for path in request_paths(spans, put):
            w = next((s for s in path if s["name"] == "dstl.writer.persist"), None)
            nodes = [s for s in path if s["name"] == "dstl.node"]
            if w is None or not nodes or w["end_ns"] is None:
                continue
            row = {"send": (nodes[0]["start_ns"] - w["start_ns"]) / 1e6,
                   "tree": (nodes[-1]["start_ns"] - nodes[0]["start_ns"]) / 1e6,
                   "batch": (put["start_ns"] - nodes[-1]["start_ns"]) / 1e6,
                   "put": (put["end_ns"] - put["start_ns"]) / 1e6,
                   "reply": (w["end_ns"] - put["end_ns"]) / 1e6,
                   "total": (w["end_ns"] - w["start_ns"]) / 1e6,
                   "levels": float(len(nodes))}
            if best is None or row["total"] > best["total"]:
                best = row
        if best is not None:
            out.append(best)
    return out


def draw(spans: list[dict[str, Any]], index: int, out_png: str) -> dict[str, Any]:
    """Draw flush number ``index`` (negative counts from the end) as a PNG; returns a
    summary of the picture."""
    plt = pyplot("dstl-ray trace (drawing the path)")
    puts = flushes(spans)
    if not puts:
        raise ValueError("no dstl.dfs.put spans found (was tracing on?)")
    put = puts[index]
    paths = request_paths(spans, put)
    levels: dict[str, int] = {}
    for path in paths:
        for s in path:
            if s["name"] == "dstl.node":
                levels[s["attributes"]["dstl.node"]] = s["attributes"]["dstl.level"]
    by_level: dict[int, list[str]] = defaultdict(list)
    for n, lv in sorted(levels.items()):
        by_level[lv].append(n)
    pos = {n: (i - (len(ns) - 1) / 2, -lv) for lv, ns in by_level.items()
           for i, n in enumerate(ns)}
    fig, ax = plt.subplots(figsize=(10, 1.8 + 1.6 * len(by_level)))
    hop_info = hops(spans, put)
    for (a, b), h in hop_info.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "->", "color": "#4c72b0", "lw": 1.5})
        ax.text((x0 + x1) / 2, (y0 + y1) / 2, f"{h['bytes'] / 1024:.1f} KiB\n{h['ms']:.1f} ms",
                fontsize=8, ha="center", color="#4c72b0")
    flusher = put["attributes"]["dstl.node"]
    for n, (x, y) in pos.items():
        color = "#dd8452" if n == flusher else "#dddddd"
        ax.scatter([x], [y], s=900, color=color, zorder=3)
        ax.text(x, y, n.replace("dstl-node-", "")[:8], ha="center", va="center", fontsize=7,
                zorder=4)
    x, y = pos[flusher]
    put_ms = (put["end_ns"] - put["start_ns"]) / 1e6
    ax.text(x, y + 0.45, f"flush: {put['attributes'].get('dstl.bytes', 0) / 1024:.1f} KiB, "
            f"{put['attributes'].get('dstl.logs')} logs, DFS put {put_ms:.1f} ms",
            ha="center", fontsize=9, color="#c44e52")
    writer_spans = [p[0] for p in paths if p and p[0]["name"] == "dstl.writer.persist"]
    total_ms = max(((s["end_ns"] - s["start_ns"]) / 1e6 for s in writer_spans), default=0.0)
    ax.set_title(f"one flush through the tree: {len(paths)} persist requests, "
                 f"slowest end to end {total_ms:.1f} ms")
    ax.set_xlim(min(p[0] for p in pos.values()) - 1, max(p[0] for p in pos.values()) + 1)
    ax.set_ylim(-max(by_level) - 0.7, 1.0)
    ax.axis("off")
    fig.savefig(out_png, dpi=110, bbox_inches="tight")
    return {"flush_node": flusher, "requests": len(paths), "put_ms": put_ms,
            "hops": {f"{a}->{b}": h for (a, b), h in hop_info.items()},
            "slowest_request_ms": total_ms}
