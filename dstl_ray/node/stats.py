"""A node's counters and the status it reports (docs/architecture.md "Observability"): what
the CLI's ``status``, the experiments and the soak run read."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

from ..upload.uploader import UploadStats
from .dead_writers import DeadWriters
from .namespaces import JobNamespaces
from .peers import Place
from .throttle import ByteBudget


def current_rss_kb() -> int:
    """Resident set size now (``ru_maxrss`` is the peak), from /proc where there is one."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@dataclass
class NodeCounters:
    requests: int = 0  # persist requests received (writer or child batches)
    requests_from_children: int = 0
    batches: int = 0
    files_flushed: int = 0
    bytes_flushed: int = 0
    forwards: int = 0
    forwards_by_lane: int = 0  # of them, sent over a lane (dstl_ray.transport.lane)
    marks_by_lane: int = 0  # marks passed upstream over a lane
    bytes_forwarded: int = 0
    forward_failures: int = 0
    flush_failures: int = 0
    files_deleted: int = 0
    routed_direct: int = 0  # batches sent straight to an ancestor, skipping hops
    route_failures: int = 0
    sent_all_pending: int = 0  # batches sent because every source had a request pending
    sent_size: int = 0  # batches sent because the buffered bytes passed the threshold
    sent_delay: int = 0  # batches sent by the persist-delay timer
    sent_late_arrived: int = 0  # sent when the late sources of a checkpoint arrived
    waits_for_late: int = 0  # batches whose delay was extended for late sources
    registration_failures: int = 0  # upstream (un)registrations that failed or timed out
    idle_sources_dropped: int = 0  # sources silent for source_idle_s, no longer waited for
    incarnations: int = 0  # jobs (re)started under a newer incarnation
    stale_refused: int = 0  # requests of a job's older incarnation, refused
    deadline_expired: int = 0  # requests whose sender's deadline passed here
    late_answers_released: int = 0  # forwards answered after we gave up: released unused
    jobs_forgotten: int = 0  # idle jobs whose node-side state was dropped
    dead_writer_rounds_failed: int = 0  # dead-writer releases put off (a node did not answer)



def build_status(*, place: Place, node_id: str, raylet_pid: str, started: float,
                 incarnation: str, counters: NodeCounters, writers: int, children: list[str],
                 buffered_bytes: int, pending_requests: int, budget: ByteBudget | None,
                 in_flight_limit: int, route: str | None, route_left: int,
                 dead: DeadWriters, namespaces: JobNamespaces, jobs: int,
                 merged_changelog: dict[str, Any], upload: UploadStats,
                 entries: dict[str, int], metrics: dict[str, Any],
                 lane: dict[str, int] | None = None) -> dict[str, Any]:
    """A node's ``status()``: its place, counters, tables and process."""
    c = counters
    return {
        "name": place.name, "node_id": node_id, "level": place.level,
        "parent": place.parent, "root": place.parent is None,
        "writers": writers, "children": children,
        "buffered_bytes": buffered_bytes, "pending_requests": pending_requests,
        "in_flight_bytes": budget.used if budget else 0,
        "requests": c.requests, "requests_from_children": c.requests_from_children,
        "batches": c.batches, "files_flushed": c.files_flushed,
        "bytes_flushed": c.bytes_flushed, "forwards": c.forwards,
        "forwards_by_lane": c.forwards_by_lane, "marks_by_lane": c.marks_by_lane,
        "bytes_forwarded": c.bytes_forwarded, "forward_failures": c.forward_failures,
        "flush_failures": c.flush_failures, "files_deleted": c.files_deleted,
        "routed_direct": c.routed_direct,
        "batch_triggers": {"all_pending": c.sent_all_pending, "size": c.sent_size,
                           "delay": c.sent_delay, "late_arrived": c.sent_late_arrived},
        "waits_for_late": c.waits_for_late,
        "idle_sources_dropped": c.idle_sources_dropped,
        "registration_failures": c.registration_failures, "route": route,
        "incarnations": c.incarnations, "stale_refused": c.stale_refused,
        "deadline_expired": c.deadline_expired,
        "late_answers_released": c.late_answers_released,
        "dead_writers_released": dead.released,
        "dead_writers_kept": dead.skipped,
        "dead_writer_rounds_failed": c.dead_writer_rounds_failed,
        "jobs_forgotten": c.jobs_forgotten,
        "jobs": jobs,
        "namespace_refusals": namespaces.refused,
        "merged_changelog": merged_changelog,
        "namespace_takeovers": namespaces.taken_over,
        "route_left": route_left, "route_failures": c.route_failures,
        "index": place.index, "height": place.height,
        "upload_attempts": upload.attempts,
        "upload_retries": upload.retries,
        "upload": upload.to_dict(),
        "backpressure": {"limit": in_flight_limit,
                         "waiting": budget.waiting if budget else 0,
                         "waits": budget.waits if budget else 0,
                         "wait_s": round(budget.wait_s, 3) if budget else 0.0,
                         "peak_in_flight_bytes": budget.peak if budget else 0},
        "raylet_pid": raylet_pid, "uptime_s": round(time.time() - started, 1),
        "pid": os.getpid(), "rss_kb": current_rss_kb(),
        "py_blocks": sys.getallocatedblocks(),
        "entries": entries,
        "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "incarnation": incarnation,
        "metrics": metrics,
        "lane": lane,  # local lane calls, connections, refused (None: no lane)
    }
