"""The parts of a savepoint taken from a complete checkpoint's files rather than from live
backends (FLINK-5053's savepoint, written the way Flink's State Processor API rewrites a
snapshot): each part restores one key-group range of one operator of the checkpoint into a
throwaway table in a temporary directory and writes it as one whole materialized file.

This is how a job whose backends live elsewhere takes a savepoint: the Spark operator's
subtasks live in executors' Python workers, and between micro-batches the job's state is
exactly its latest complete checkpoint, so a savepoint of that checkpoint is a savepoint of
the job. The parts run one after the other on one thread of their own, so the process holds
one range's state at a time; the checkpoint's files are only read (they may be another job's).
As a live backend's savepoint, it leaves out entries a state's TTL expired.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..format.materialized import MAT_SUFFIX
from ..state.files import write_full
from ..state.snapshot import KeyedStateSnapshot
from ..state.ttl import now_ms
from ..storage.base import Storage
from .reader import restored_range
from .recovery import CompletedCheckpoint


@dataclass(frozen=True)
class CheckpointRange:
    """Key-group range ``index`` of ``parts`` of operator ``operator_id`` in ``checkpoint``,
    as a savepoint part (:func:`~dstl_ray.checkpoint.savepoint.start_savepoint` calls
    :meth:`savepoint`). ``table``: ``"heap"`` or ``"rocksdb"`` for the throwaway table (a
    large range belongs in RocksDB, as its job's backend had it)."""

    checkpoint: CompletedCheckpoint
    operator_id: str
    parts: int
    index: int
    storage: Storage
    pool: concurrent.futures.Executor
    table: str = "heap"
    local_dir: str | None = None  # where the throwaway table lives (default: temp)
    clock: Callable[[], float] = time.time  # TTL expiry is judged at this time
    queued = True  # a cancelled future of :meth:`savepoint` never runs (savepoint.py)

    def savepoint(self, target_dir: str) -> concurrent.futures.Future[KeyedStateSnapshot]:
        """Queued on the pool: a part not started yet can still be cancelled (a failed
        attempt's remaining parts never run)."""
        return self.pool.submit(self._write, target_dir)

    def _write(self, target_dir: str) -> KeyedStateSnapshot:
        with restored_range(self.checkpoint, self.operator_id, self.parts, self.index,
                            self.table, self.local_dir) as r:
            # as a live backend's savepoint: expired entries are never saved (by the TTLs
            # the checkpoint recorded)
            if any(t is not None for t in r.names.ttls):
                r.table.purge_expired(r.names.ttls, now_ms(self.clock()))
            handle = write_full(self.storage, r.table.view(), r.names.spec(), r.key_groups,
                                target_dir, f"{uuid.uuid4().hex}{MAT_SUFFIX}", None, 0)
        # where an event-time watermark resumes (the largest its sources had seen)
        marks = [s.snapshot.event_time_ms for s in r.sources
                 if s.snapshot.event_time_ms is not None]
        return KeyedStateSnapshot(self.operator_id, r.key_groups, (handle,),
                                  event_time_ms=max(marks) if marks else None)


def checkpoint_ranges(checkpoint: CompletedCheckpoint, storage: Storage,
                      pool: concurrent.futures.Executor, table: str = "heap",
                      local_dir: str | None = None) -> list[CheckpointRange]:
    """Every operator of ``checkpoint``, one part per snapshot it has there (the
    checkpoint's own parallelism: a savepoint is restorable at any other)."""
    counts: dict[str, int] = {}
    for s in checkpoint.metadata.snapshots:
        counts[s.operator_id] = counts.get(s.operator_id, 0) + 1
    return [CheckpointRange(checkpoint, op, n, i, storage, pool, table, local_dir)
            for op, n in sorted(counts.items()) for i in range(n)]


__all__ = ["CheckpointRange", "checkpoint_ranges"]
