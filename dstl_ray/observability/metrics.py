"""FLIP-158 "Monitoring" metrics of a node actor, through ``ray.util.metrics`` so that Ray's
Prometheus endpoint exposes them, mirrored in a local snapshot that ``status()`` returns.

DFS request size, latency, logs per request and errors (FLIP-158), plus the tree's own:
forwarded bytes per level, flushes per node, routing bypasses, batch wait, in-flight bytes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

log = logging.getLogger(__name__)

MS_BOUNDARIES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
BYTE_BOUNDARIES = [1 << k for k in range(8, 31, 2)]
COUNT_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


class NodeMetrics:
    def __init__(self, node: str, level: int) -> None:
        self.node = node
        self.level = level
        self.snapshot: dict[str, Any] = defaultdict(float)
        self._m: dict[str, Any] = {}
        try:
            from ray.util.metrics import Counter, Gauge, Histogram

            keys = ("node", "level")
            self._m = {
                "requests": Counter("dstl_requests_total", "persist requests received",
                                    tag_keys=keys),
                "dfs_request_bytes": Histogram("dstl_dfs_request_size_bytes",
                                               "bytes per DFS request (file)",
                                               boundaries=BYTE_BOUNDARIES, tag_keys=keys),
                "dfs_latency_ms": Histogram("dstl_dfs_request_latency_ms",
                                            "DFS request latency", boundaries=MS_BOUNDARIES,
                                            tag_keys=keys),
                "logs_per_request": Histogram("dstl_logs_per_request",
                                              "logs (writers) per DFS request",
                                              boundaries=COUNT_BOUNDARIES, tag_keys=keys),
                "errors": Counter("dstl_errors_total", "failed DFS requests or forwards",
                                  tag_keys=(*keys, "kind")),
                "forwarded_bytes": Counter("dstl_forwarded_bytes_total",
                                           "bytes forwarded to an upper level", tag_keys=keys),
                "flushes": Counter("dstl_flushes_total", "files written by this node",
                                   tag_keys=keys),
                "bypasses": Counter("dstl_routing_bypasses_total",
                                    "batches sent past the parent (up-front routing)",
                                    tag_keys=keys),
                "batch_wait_ms": Histogram("dstl_batch_wait_ms", "time a request waited for "
                                           "its batch", boundaries=MS_BOUNDARIES, tag_keys=keys),
                "in_flight_bytes": Gauge("dstl_in_flight_bytes", "upload bytes in flight",
                                         tag_keys=keys),
            }
        except Exception as e:  # noqa: BLE001 - outside Ray: local snapshot only
            log.debug("ray metrics unavailable: %s", e)

    def _tags(self, **extra: str) -> dict[str, str]:
        return {"node": self.node, "level": str(self.level), **extra}

    def _inc(self, name: str, value: float = 1.0, **extra: str) -> None:
        key = name if not extra else f"{name}:{','.join(extra.values())}"
        self.snapshot[key] += value
        m = self._m.get(name)
        if m is not None:
            m.inc(value, tags=self._tags(**extra))

    def _observe(self, name: str, value: float) -> None:
        self.snapshot[f"{name}_count"] += 1
        self.snapshot[f"{name}_sum"] += value
        m = self._m.get(name)
        if m is not None:
            m.observe(value, tags=self._tags())

    def request(self) -> None:
        self._inc("requests")

    def dfs_request(self, size: int, latency_ms: float, logs: int) -> None:
        self._observe("dfs_request_bytes", size)
        self._observe("dfs_latency_ms", latency_ms)
        self._observe("logs_per_request", logs)
        self._inc("flushes")

    def error(self, kind: str) -> None:
        self._inc("errors", kind=kind)

    def forwarded(self, size: int, bypass: bool) -> None:
        self._inc("forwarded_bytes", size)
        if bypass:
            self._inc("bypasses")

    def batch_wait(self, ms: float) -> None:
        self._observe("batch_wait_ms", ms)

    def in_flight(self, size: int) -> None:
        self.snapshot["in_flight_bytes"] = size
        m = self._m.get("in_flight_bytes")
        if m is not None:
            m.set(size, tags=self._tags())

    def to_dict(self) -> dict[str, float]:
        return dict(self.snapshot)
