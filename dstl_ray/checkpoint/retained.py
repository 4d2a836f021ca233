"""The job's retained checkpoints: the last K complete ones, oldest first (Flink's
``CompletedCheckpointStore``: adding one subsumes the oldest beyond K).

Completed checkpoints only rise: a checkpoint older than (or as old as) the newest retained
one can no longer complete (:meth:`RetainedCheckpoints.refuse_older`). Not locked itself:
the coordinator changes and reads it under its own lock, together with its pending
checkpoints.
"""

from __future__ import annotations

from collections.abc import Collection

from ..errors import CheckpointDeclinedError
from .recovery import CompletedCheckpoint


class RetainedCheckpoints:
    """At most ``count`` complete checkpoints, oldest first."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._list: list[CompletedCheckpoint] = []

    def all(self) -> list[CompletedCheckpoint]:
        return list(self._list)

    def latest(self) -> CompletedCheckpoint | None:
        return self._list[-1] if self._list else None

    def newest_id(self) -> int:
        """The newest retained checkpoint's id (-1: none)."""
        return self._list[-1].checkpoint_id if self._list else -1

    def ids(self) -> list[int]:
        return [c.checkpoint_id for c in self._list]

    def add(self, cc: CompletedCheckpoint) -> list[CompletedCheckpoint]:
        """Retain ``cc`` (newer than every retained one); returns the ones it subsumes."""
        self._list.append(cc)
        subsumed, self._list = self._list[:-self.count], self._list[-self.count:]
        return subsumed

    def refuse_older(self, n: int, job_id: str, in_progress: Collection[int] = ()) -> None:
        """Raise :class:`CheckpointDeclinedError` unless checkpoint ``n`` may still
        complete: newer than every retained one, and not in progress already."""
        newest = self.newest_id()
        if n <= newest or n in in_progress:
            raise CheckpointDeclinedError(
                f"checkpoint {n} of job {job_id}: checkpoint {newest} is already complete, "
                f"or {n} in progress (ids must grow)")

    def subsumed(self, n: int) -> str | None:
        """Why checkpoint ``n`` can no longer complete (a newer one did), or None."""
        newest = self.newest_id()
        return f"checkpoint {n} subsumed: checkpoint {newest} completed first" \
            if newest >= n else None

    def drop_from(self, n: int) -> list[CompletedCheckpoint]:
        """Forget the retained checkpoints with id >= ``n``; returns them, oldest first."""
        gone = [c for c in self._list if c.checkpoint_id >= n]
        self._list = [c for c in self._list if c.checkpoint_id < n]
        return gone

    def replace(self, checkpoints: Collection[CompletedCheckpoint]) -> None:
        """Retain ``checkpoints`` instead (a restore's choice)."""
        self._list = sorted(checkpoints, key=lambda c: c.checkpoint_id)

    def clear(self) -> list[CompletedCheckpoint]:
        """Forget them all; returns them."""
        gone, self._list = self._list, []
        return gone
