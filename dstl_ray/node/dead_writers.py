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
2. ``forget``: the bound of each log is the largest ``named`` any node recorded (or applied
   in an earlier, interrupted round), raised to the newest checkpoint id of the job that any
   node saw in a request or mark (a checkpoint naming the section was triggered before the
   writer died, and every checkpoint triggered since went through some live node, unless
   the job has no live writer left; this covers a writer whose newest record was on a node
   that then left the tree). Each node fences too, releases that log's sections (raising
   ``last_use`` where an earlier round released them) and remembers it for flushes still
   on their way. A log is skipped (kept for good) if a node was restarted by Ray after the
   log's first record: it may have lost the newest one.

Off unless ``dead_writer_check_s`` > 0 (and ``file_merging=across_checkpoints``): then nodes
keep records and writers wait for their marks (within ``persist_timeout_s``). Known limits,
for which the sections are kept (never freed early): a Ray node that dies with the writer's
process takes the writer's records with it; writers in Ray actors or tasks (not drivers) are
never declared dead. A node restarted by Ray, or one that joined after a round, never got
its fence: it looks up every driver's Ray job the first time it sees it, and fences a dead
one itself. A skipped log is released as unknown, so no later round can bound it lower.
A round that fails half-way (a node did not answer) is tried again: the Ray job stays a
candidate while records of it remain. Two limits remain. A restart of any node actor after
a log's first record keeps that log for good (nothing tells which writers the restarted node
had): over a long run with node restarts fewer logs are released, a leak until the job's next
recovery, never a loss. And one rare case is not covered: a writer that moved to another
node while its old node stayed alive (a transient failure), whose new node then left the tree
with the only record of newer handles, while no live node saw those checkpoints of its job.
Nothing here grows without bound: records go with their writers, fenced Ray jobs are capped
(``FENCED_MAX``, oldest first), bounds and newest checkpoint ids go with the job's node
state (a job restarted under its id, or idle).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import FencedError
from ..merging.pool import UNKNOWN_USE
from ..transport.sender import Caller

RESTART_MARGIN_S = 2.0  # clock difference between nodes (hosts) we allow for
FENCED_MAX = 100_000  # Ray jobs fenced, kept per node (the oldest go first: long dead)


@dataclass
class WriterRecord:
    job_id: str
    ray_job: str
    named: int | None  # None: not reported yet (a registration again), counts as unknown
    created: float  # wall clock of the node that made the record

    def report(self, named: int) -> None:
        """The writer's ``named`` only grows, but its messages may arrive out of order (its
        process's sender sends a round's requests before the round's marks): keep the
        largest; unknown stays unknown."""
        if self.named is None or named == UNKNOWN_USE:
            self.named = named
        elif self.named != UNKNOWN_USE:
            self.named = max(self.named, named)

    @property
    def bound(self) -> int:
        return UNKNOWN_USE if self.named is None else self.named


@dataclass
class DeadWriters:
    """One node's records of writers and Ray jobs it fenced. Not thread-safe: the node
    actor's event loop owns it."""

    # when Ray restarted this node actor (0: never), to skip logs it may have lost records of
    started: float = 0.0
    records: dict[str, WriterRecord] = field(default_factory=dict)
    # Ray job -> when fenced; insertion-ordered, so the oldest are dropped past FENCED_MAX
    fenced: dict[str, float] = field(default_factory=dict)
    # job -> newest checkpoint id this node saw in any request or mark of the job (from
    # any writer): a checkpoint naming a dead writer's section was triggered before the
    # death, so its id is at most the newest seen anywhere once the writer is fenced
    newest: dict[str, int] = field(default_factory=dict)
    vetted: set[str] = field(default_factory=set)  # Ray jobs looked up once, found alive
    # job -> log -> (Ray job, bound) of logs released here: for flushes landing later, and
    # reported again in a later round (one interrupted half-way)
    dead_logs: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)
    released: int = 0  # logs whose sections were released here
    skipped: int = 0  # dead logs kept for good (a node restarted since their first record)

    def registered(self, log_id: str, job_id: str, caller: Caller | None,
                   named: int | None) -> None:
        """``named`` None: a registration again (the writer's knowledge is not known yet)."""
        if caller is None or not caller.ray_job or not caller.driver:
            return  # a process we could never find dead: nothing to release
        rec = self.records.get(log_id)
        if rec is None:
            self.records[log_id] = WriterRecord(job_id, caller.ray_job, named, time.time())
        elif named is not None:
            rec.report(named)

    def reported(self, log_id: str, job_id: str, caller: Caller | None, named: int) -> None:
        """A request or mark of the writer, with its ``named`` when it sent it."""
        rec = self.records.get(log_id)
        if rec is None:
            self.registered(log_id, job_id, caller, named)
        else:
            rec.report(named)

    def saw(self, job_id: str, checkpoint_id: int) -> None:
        if checkpoint_id > self.newest.get(job_id, -1):
            self.newest[job_id] = checkpoint_id

    def add_fenced(self, ray_job: str) -> None:
        if ray_job not in self.fenced:
            self.fenced[ray_job] = time.time()
            while len(self.fenced) > FENCED_MAX:
                del self.fenced[next(iter(self.fenced))]

    def reset(self, job_id: str) -> None:
        """The job restarted under its id (or was forgotten as idle) here."""
        self.dead_logs.pop(job_id, None)
        self.newest.pop(job_id, None)

    def unregistered(self, log_id: str) -> None:
        self.records.pop(log_id, None)  # a closed writer released everything itself

    def check(self, caller: Caller | None) -> None:
        if (caller is not None and caller.driver and caller.ray_job
                and caller.ray_job in self.fenced):  # (a detached actor of it may live on)
            raise FencedError(f"Ray job {caller.ray_job} was found dead and is fenced: its "
                              f"writers' sections were released")

    def candidates(self) -> set[str]:
        """Ray jobs of writers recorded here: to check for death. Fenced ones too: a round
        that failed half-way (fenced, not forgotten everywhere) is tried again, and a
        record goes only when a round's second phase reached this node."""
        return {r.ray_job for r in self.records.values() if r.ray_job}

    def fence(self, ray_job: str) -> dict[str, Any]:
        self.add_fenced(ray_job)
        records = {log: (r.job_id, r.bound, r.created)
                   for log, r in self.records.items() if r.ray_job == ray_job}
        for job, logs in self.dead_logs.items():  # applied by an earlier round
            for log, (rj, bound) in logs.items():
                if rj == ray_job and log not in records:
                    records[log] = (job, bound, float("inf"))
        # every job's: the node that saw a dead writer's job go furthest may hold no record
        return {"started": self.started, "records": records, "newest": dict(self.newest)}

    def forget(self, ray_job: str, bounds: dict[str, dict[str, int]]) -> None:
        """Phase 2: fence (a node that joined after phase 1), drop the Ray job's records,
        remember the logs' bounds per job."""
        self.add_fenced(ray_job)
        for log in [lg for lg, r in self.records.items() if r.ray_job == ray_job]:
            del self.records[log]
        for job, logs in bounds.items():
            known = self.dead_logs.setdefault(job, {})
            for log, b in logs.items():
                old = known.get(log, (ray_job, -1))[1]
                known[log] = (ray_job, UNKNOWN_USE if UNKNOWN_USE in (old, b) else max(old, b))
            self.released += sum(1 for b in logs.values() if b != UNKNOWN_USE)

    def bounds_for(self, job_id: str) -> dict[str, int]:
        return {log: b for log, (_, b) in self.dead_logs.get(job_id, {}).items()}

    def size(self) -> int:
        return (len(self.records) + len(self.fenced) + len(self.vetted)
                + sum(len(v) for v in self.dead_logs.values()))


def bounds_of(answers: list[dict[str, Any]]) -> tuple[dict[str, dict[str, int]], int]:
    """From every node's ``fence`` answer: per job, per log, the largest ``named`` any node
    recorded, raised to the newest checkpoint id of the job any node saw; and how many logs are skipped because a node (re)started after their first
    record (it may have lost a newer one)."""
    latest_start = max(a["started"] for a in answers)
    newest: dict[str, int] = {}
    for a in answers:
        for job, c in a.get("newest", {}).items():
            newest[job] = max(newest.get(job, -1), c)
    merged: dict[str, tuple[str, int, float]] = {}
    for a in answers:
        for log, (job, named, created) in a["records"].items():
            if log in merged:
                j, n, c = merged[log]
                unknown = UNKNOWN_USE in (n, named)
                merged[log] = (j, UNKNOWN_USE if unknown else max(n, named), min(c, created))
            else:
                merged[log] = (job, named, created)
    out: dict[str, dict[str, int]] = {}
    skipped = 0
    for log, (job, named, created) in merged.items():
        if created != float("inf") and latest_start > created - RESTART_MARGIN_S:
            skipped += 1  # released as unknown: kept for good, and so in any later round
            named = UNKNOWN_USE
        elif named != UNKNOWN_USE:
            # the writer's own knowledge may be stale where its newest record was lost
            # (its node left the tree): no checkpoint newer than any node saw can name it
            named = max(named, newest.get(job, -1))
        out.setdefault(job, {})[log] = named
    return out, skipped
