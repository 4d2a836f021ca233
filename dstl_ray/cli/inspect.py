"""Human-readable summaries of changelog files and checkpoint metadata (``dstl-ray inspect``)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from ..errors import FormatError
from ..format.changelog import _TRAILER, FILE_SUFFIX, TRAILER_SIZE, decode_file
from ..storage.base import normalize_url
from ..storage.registry import get_storage


def describe_changelog_file(path: str, data: bytes) -> dict[str, Any]:
    """Decode and verify a whole ``.dstl`` file; per log: key groups, sqn range, changes."""
    contents = decode_file(data, path)
    logs: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "key_groups": set(), "sqn_min": None, "sqn_max": None, "changes": 0, "bytes": 0,
        "changesets": set()})
    for b in contents.blocks:
        d = logs[b.log_id.hex()]
        d["key_groups"].add(b.key_group)
        for sqn, values in b.changesets:
            d["changesets"].add(sqn)
            d["changes"] += len(values)
            d["bytes"] += sum(len(v) for v in values)
            d["sqn_min"] = sqn if d["sqn_min"] is None else min(d["sqn_min"], sqn)
            d["sqn_max"] = sqn if d["sqn_max"] is None else max(d["sqn_max"], sqn)
    return {
        "path": path, "format_version": contents.version,
        "compression": "zstd" if contents.flags & 1 else "none", "size": contents.size,
        "blocks": len(contents.blocks),
        "logs": {lid: {"key_groups": f"{min(d['key_groups'])}..{max(d['key_groups'])} "
                                     f"({len(d['key_groups'])})",
                       "sqn": [d["sqn_min"], d["sqn_max"]], "changesets": len(d["changesets"]),
                       "changes": d["changes"], "value_bytes": d["bytes"]}
                 for lid, d in logs.items()},
    }


def flush_ranges(data: bytes, path: str) -> list[tuple[int, int]]:
    """(start, end) of every whole changelog file in a merged file (FLIP-306 across
    checkpoints: flushes appended one after another), found from the end: each trailer
    gives its file's length."""
    out: list[tuple[int, int]] = []
    end = len(data)
    while end > 0:
        if end < TRAILER_SIZE:
            raise FormatError("merged file: no trailer before this point (torn?)", path=path,
                              offset=end)
        footer_off, footer_len = _TRAILER.unpack_from(data, end - TRAILER_SIZE)
        start = end - (footer_off + footer_len + TRAILER_SIZE)
        if start < 0 or start >= end:
            raise FormatError("merged file: trailer names a length beyond the file",
                              path=path, offset=end - TRAILER_SIZE)
        out.append((start, end))
        end = start
    return out[::-1]


def describe_merged_file(path: str, data: bytes) -> dict[str, Any]:
    """Every flush of a node's merged changelog file, each decoded and verified."""
    flushes = []
    for start, end in flush_ranges(data, path):
        d = describe_changelog_file(f"{path}@{start}", data[start:end])
        flushes.append({"offset": start, **{k: v for k, v in d.items() if k != "path"}})
    return {"path": path, "size": len(data), "flushes": flushes}


def inspect_path(path: str) -> dict[str, Any]:
    """Describe a changelog file, a checkpoint ``_metadata`` file or directory."""
    url = normalize_url(path)
    st = get_storage(url)
    if url.endswith(FILE_SUFFIX):
        data = st.read_file(url)
        if "/segments/" in url:  # a node's merged file: one flush after another
            return describe_merged_file(url, data)
        return describe_changelog_file(url, data)
    if not url.endswith("_metadata"):
        candidate = url.rstrip("/") + "/_metadata"
        if st.exists(candidate):
            url = candidate
    data = st.read_file(url)
    try:
        doc = json.loads(data)
    except ValueError:
        return describe_changelog_file(url, data)
    return {"path": url, "metadata": doc}


def render(summary: dict[str, Any]) -> str:
    if "flushes" in summary:
        parts = [f"merged file {summary['path']}: {summary['size']} bytes, "
                 f"{len(summary['flushes'])} flushes"]
        for f in summary["flushes"]:
            parts.append(f"-- flush at offset {f['offset']}")
            parts.append(render({"path": f"{summary['path']}@{f['offset']}", **f}))
        return "\n".join(parts)
    if "logs" not in summary:
        return json.dumps(summary, indent=2, sort_keys=True)
    lines = [
        f"file        {summary['path']}",
        f"format      v{summary['format_version']}, compression {summary['compression']}, "
        f"{summary['size']} bytes, {summary['blocks']} key-group blocks, "
        f"{len(summary['logs'])} logs, all CRC32C ok",
        f"{'log id':34} {'key groups':>18} {'sqn':>13} {'changesets':>10} {'changes':>9} "
        f"{'bytes':>10}",
    ]
    for lid, d in sorted(summary["logs"].items()):
        lines.append(f"{lid:34} {d['key_groups']:>18} {str(d['sqn'][0]) + '..' + str(d['sqn'][1]):>13} "
                     f"{d['changesets']:>10} {d['changes']:>9} {d['value_bytes']:>10}")
    return "\n".join(lines)
