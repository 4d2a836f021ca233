"""Releasing the merged-file sections of writers that died (FLIP-306 4.8, node-owned files).

With ``file_merging=across_checkpoints`` a node appends flushes of many writers to one
physical file and deletes it once every section in it was released (``segment_files``). A
writer whose process dies (a lost Spark executor, a killed process) never releases, so every
file holding one of its sections would stay for the rest of the job's incarnation.

A section may be freed only when no retained checkpoint can name it, so a dead writer's
sections are released as used by checkpoints up to a *bound*: the newest checkpoint id the
writer made a handle for (``StateChangelogWriter.named``, sent with every request and with
an acknowledged mark whenever it had nothing new; unknown for good once it made a handle
without a checkpoint id, and then never freed). Each node keeps a record per writer that
registered with it or sent through it: its job, its process (the caller's Ray job, one per
driver and per Spark Python worker) and the newest ``named`` it reported.

A node declares a writer dead only when certain: Ray's job table marks the process's Ray job
dead (Ray actors inside a live job are not covered). Then, over every node of the tree:

1. ``fence``: each node refuses that Ray job from now on (:class:`FencedError`), so even a
   process Ray took for dead (a partition) cannot name a newer checkpoint, and returns its
   records of it. If any node does not answer, nothing is released this round.
2. ``forget``: the bound of each log is the largest ``named`` any node recorded; each node
   releases that log's sections (and remembers it, for flushes still on their way). A log is
   skipped (kept for good) if any node was (re)started after the log's first record: a
   restarted node may have lost the newest one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .errors import FencedError
from .merging import UNKNOWN_USE
from .namespaces import Caller

RESTART_MARGIN_S = 2.0  # clock difference between nodes (hosts) we allow for


@dataclass
class WriterRecord:
    job_id: str
    ray_job: str
    named: int  # UNKNOWN_USE until the writer reported it
    created: float  # wall clock of the node that made the record


@dataclass
class DeadWriters:
    """One node's records of writers and Ray jobs it fenced. Not thread-safe: the node
    actor's event loop owns it."""

    started: float = field(default_factory=time.time)
    records: dict[str, WriterRecord] = field(default_factory=dict)
    fenced: set[str] = field(default_factory=set)
    dead_logs: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> log -> bound
    released: int = 0  # logs whose sections were released here
    skipped: int = 0  # dead logs kept for good (a node restarted since their first record)

    def registered(self, log_id: str, job_id: str, caller: Caller | None,
                   named: int | None) -> None:
        """``named`` None: a registration again (the writer's knowledge is not known yet)."""
        rec = self.records.get(log_id)
        if rec is None:
            self.records[log_id] = WriterRecord(
                job_id, caller.ray_job if caller else "",
                UNKNOWN_USE if named is None else named, time.time())
        elif named is not None:
            rec.named = named

    def reported(self, log_id: str, job_id: str, caller: Caller | None, named: int) -> None:
        """A request or mark of the writer: ``named`` is its newest (it only grows)."""
        rec = self.records.get(log_id)
        if rec is None:
            self.records[log_id] = WriterRecord(job_id, caller.ray_job if caller else "",
                                                named, time.time())
        else:
            rec.named = named

    def unregistered(self, log_id: str) -> None:
        self.records.pop(log_id, None)  # a closed writer released everything itself

    def check(self, caller: Caller | None) -> None:
        if caller is not None and caller.ray_job and caller.ray_job in self.fenced:
            raise FencedError(f"Ray job {caller.ray_job} was found dead and is fenced: its "
                              f"writers' sections were released")

    def candidates(self) -> set[str]:
        """Ray jobs of writers recorded here, not fenced yet: to check for death."""
        return {r.ray_job for r in self.records.values()
                if r.ray_job and r.ray_job not in self.fenced}

    def fence(self, ray_job: str) -> dict[str, Any]:
        self.fenced.add(ray_job)
        return {"started": self.started,
                "records": {log: (r.job_id, r.named, r.created)
                            for log, r in self.records.items() if r.ray_job == ray_job}}

    def forget(self, ray_job: str, bounds: dict[str, dict[str, int]]) -> None:
        """Phase 2: drop the Ray job's records; remember the logs' bounds per job."""
        for log in [lg for lg, r in self.records.items() if r.ray_job == ray_job]:
            del self.records[log]
        for job, logs in bounds.items():
            known = self.dead_logs.setdefault(job, {})
            for log, b in logs.items():
                known[log] = max(known.get(log, -1), b)
            self.released += len(logs)

    def size(self) -> int:
        return (len(self.records) + len(self.fenced)
                + sum(len(v) for v in self.dead_logs.values()))


def bounds_of(answers: list[dict[str, Any]]) -> tuple[dict[str, dict[str, int]], int]:
    """From every node's ``fence`` answer: per job, per log, the largest ``named`` any node
    recorded; and how many logs are skipped because a node (re)started after their first
    record (it may have lost a newer one)."""
    latest_start = max(a["started"] for a in answers)
    merged: dict[str, tuple[str, int, float]] = {}
    for a in answers:
        for log, (job, named, created) in a["records"].items():
            if log in merged:
                j, n, c = merged[log]
                merged[log] = (j, max(n, named), min(c, created))
            else:
                merged[log] = (job, named, created)
    out: dict[str, dict[str, int]] = {}
    skipped = 0
    for log, (job, named, created) in merged.items():
        if latest_start > created - RESTART_MARGIN_S:
            skipped += 1
            continue
        out.setdefault(job, {})[log] = named
    return out, skipped
