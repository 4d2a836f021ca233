"""What each micro-batch of :class:`~spark_glue.operator.KeyedStatefulOperator` did: its
:class:`BatchStats`, kept in a bounded :class:`BatchHistory` (progress lines, summaries, plots)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

# a batch's numbers as Spark users see them (query.lastProgress, spark_glue.progress) and
# the demo's summary: summed over the subtasks, or the batch's own
METRICS = ("rows", "keys", "state_rows", "state_bytes", "timers_registered", "timers_fired",
           "ttl_evicted", "checkpoint_ms", "files_written", "restores")
# those the subtasks report (their ``metrics``), summed over them
SUBTASK_METRICS = ("state_rows", "state_bytes", "timers_registered", "timers_fired",
                   "ttl_evicted")
# those that count events (a run's total is their sum over its batches; the others are levels)
COUNTING = ("rows", "timers_registered", "timers_fired", "ttl_evicted", "files_written",
            "restores")


@dataclass
class BatchStats:
    """What one micro-batch did (for progress lines, summaries and plots)."""

    batch_id: int
    rows: int
    keys: int
    batch_s: float
    checkpoint_s: float  # slowest subtask's persist + the metadata commit
    commit_s: float
    restores: int
    retries: int
    replayed: bool
    nodes: dict[int, str] = field(default_factory=dict)  # subtask -> node actor it used
    chosen_by: dict[int, str] = field(default_factory=dict)
    raylet_pids: dict[int, str] = field(default_factory=dict)
    executors: dict[int, str] = field(default_factory=dict)  # subtask -> Spark executor id
    restore_s: float = 0.0  # slowest subtask's restore (0 when every cache hit)
    apply_s: float = 0.0  # slowest subtask's update function time
    finished_at: float = field(default_factory=time.time)
    # the subtasks' state_rows, state_bytes, timers and TTL counts, summed, and the files
    # the batch's checkpoint names that the previous one did not (see metrics())
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, batch_id: int, results: Sequence[Mapping[str, Any]], replayed: bool,
           times: tuple[float, float, float, float], files_written: int) -> BatchStats:
        """The stats of a batch that ran: its subtasks' ``results`` (spark_glue.worker) and
        ``times`` (start, tasks done, checkpoint complete, sink done; perf_counter)."""
        t0, t1, t2, t3 = times
        counts = {"files_written": files_written}
        for r in results:
            for k, v in r["metrics"].items():
                counts[k] = counts.get(k, 0) + v
        return cls(
            batch_id, sum(r["rows"] for r in results), sum(r["keys"] for r in results),
            t3 - t0, max(r["snapshot_s"] for r in results) + (t2 - t1), t3 - t2,
            sum(1 for r in results if r["restore_s"] > 0),
            sum(1 for r in results if r["attempt"] > 0 or r["stage_attempt"] > 0), replayed,
            {r["index"]: r["node"] for r in results},
            {r["index"]: r["chosen_by"] for r in results},
            {r["index"]: r["raylet_pid"] for r in results},
            {r["index"]: r["executor"] or "" for r in results},
            max(r["restore_s"] for r in results), max(r["apply_s"] for r in results),
            counts=counts)

    def metrics(self) -> dict[str, int | float]:
        """The batch's :data:`METRICS`: rows and keys it got, state entries and bytes after
        it (the bytes its checkpoint names), timers registered and fired, expired entries
        purged, checkpoint ms, files new in its checkpoint, subtasks that restored."""
        return {"rows": self.rows, "keys": self.keys,
                **{k: self.counts.get(k, 0) for k in SUBTASK_METRICS},
                "checkpoint_ms": round(self.checkpoint_s * 1000, 3),
                "files_written": self.counts.get("files_written", 0),
                "restores": self.restores}

    @classmethod
    def done(cls, batch_id: int) -> BatchStats:
        """A replayed batch whose checkpoint and outputs were both complete: nothing ran."""
        return cls(batch_id, 0, 0, 0.0, 0.0, 0.0, 0, 0, True)


def totals(history: Sequence[BatchStats]) -> dict[str, int]:
    """The counting :data:`METRICS` summed over ``history``, and the state's entries and
    bytes after its last batch (levels, not counts)."""
    out = {k: sum(s.metrics()[k] for s in history) for k in COUNTING}
    last = history[-1].metrics() if history else {}
    return {**out, "state_rows": int(last.get("state_rows", 0)),
            "state_bytes": int(last.get("state_bytes", 0))}


class BatchHistory(deque[BatchStats]):
    """The :class:`BatchStats` of the last ``maxlen`` micro-batches, oldest first (``None``:
    every batch; a long run with a bound keeps memory flat). ``total`` counts every batch
    ever recorded, including those that fell off the front. Slicing returns a list."""

    def __init__(self, iterable: Iterable[BatchStats] = (), maxlen: int | None = None) -> None:
        super().__init__(iterable, maxlen)
        self.total = len(self)

    def append(self, stats: BatchStats) -> None:
        super().append(stats)
        self.total += 1

    @overload
    def __getitem__(self, i: int) -> BatchStats: ...
    @overload
    def __getitem__(self, i: slice) -> list[BatchStats]: ...
    def __getitem__(self, i: int | slice) -> BatchStats | list[BatchStats]:
        if isinstance(i, slice):
            return list(self)[i]
        return super().__getitem__(i)
