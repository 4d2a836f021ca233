"""What each micro-batch of :class:`~spark_glue.operator.KeyedStatefulOperator` did: its
:class:`BatchStats`, kept in a bounded :class:`BatchHistory` (progress lines, summaries, plots)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import overload


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

    @classmethod
    def done(cls, batch_id: int) -> BatchStats:
        """A replayed batch whose checkpoint and outputs were both complete: nothing ran."""
        return cls(batch_id, 0, 0, 0.0, 0.0, 0.0, 0, 0, True)


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
