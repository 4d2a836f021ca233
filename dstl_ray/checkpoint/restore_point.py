"""The job's restore point: a checkpoint or savepoint a run was told to restore from that is
not one of the job's own retained checkpoints (another job's, a savepoint, a copy), kept in
``{base}/_restore_points/{job}`` (outside the job directory, as the job's epoch claims: no
orphan cleanup touches it) until a checkpoint of the job completes after it (docs/architecture.md
"A job's life"; Flink restarts a job started from a savepoint from that savepoint until its
first checkpoint completes).

Without it, a driver that crashed after restoring from a savepoint and before its first
checkpoint was followed by one that restored the job's newest own checkpoint: state from
before the savepoint restore, silently. A recovery without an explicit checkpoint now
restores from the restore point while no retained checkpoint is newer than it (ids above
``after_id``, the newest id the job kept when it restored: every checkpoint completed since
has a higher one, a Spark batch's too), in the mode it was restored in.
An explicit restore from one of the job's own checkpoints removes it (that checkpoint is the
job's latest then), and so does cancelling with DELETE_ON_CANCELLATION (a job restarted
under its id counts checkpoint ids from 1 again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import RestoreError
from ..storage.base import join
from ..storage.registry import get_storage
from .recovery import CompletedCheckpoint, load_checkpoint
from .restore import RestoreMode, RestorePlan

RESTORE_POINTS_DIR = "_restore_points"


@dataclass(frozen=True)
class RestorePoint:
    """``metadata_url`` restored from in ``mode`` while the job's newest checkpoint id was
    ``after_id`` (-1: none): every checkpoint completed since has a higher one."""

    metadata_url: str
    mode: RestoreMode
    after_id: int

    def applies(self, retained: Iterable[CompletedCheckpoint]) -> bool:
        """No retained checkpoint completed after it: it is still the job's latest state."""
        return not any(c.checkpoint_id > self.after_id for c in retained)

    def to_json(self) -> bytes:
        return json.dumps({"type": "dstl-restore-point", "metadata": self.metadata_url,
                           "mode": self.mode.value, "after_id": self.after_id},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, url: str) -> RestorePoint:
        """A :class:`RestoreError` names ``url`` when it is not a restore point: the job's
        state could be either, so no guess is made."""
        try:
            d = json.loads(data)
            if d.get("type") != "dstl-restore-point":
                raise ValueError("not a restore point record")
            return cls(str(d["metadata"]), RestoreMode(d["mode"]), int(d["after_id"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RestoreError(f"cannot read the job's restore point {url}: {e} (delete it to "
                               f"restore from the job's latest checkpoint instead)",
                               checkpoint=url) from None


class RestorePointFile:
    """The restore point of the job at ``job_path``: read when a recovery picks what to
    restore, written or removed (after ``guard``, the job lease's check) by a restore and a
    cancel."""

    def __init__(self, base_path: str, job_id: str, guard: Callable[[], None]) -> None:
        self.url = join(base_path, RESTORE_POINTS_DIR, job_id)
        self._storage, self._guard = get_storage(self.url), guard

    def pick(self, checkpoint: str | None, mode: RestoreMode,
             retained: list[CompletedCheckpoint]) -> tuple[str | None, RestoreMode]:
        """What to restore: ``checkpoint`` when given; else the restore point while nothing
        completed since it; else None (the job's latest retained checkpoint)."""
        point = None if checkpoint is not None else self.current()
        if point is None:
            return checkpoint, mode
        if not point.applies(retained):
            return None, mode
        try:  # gone or broken: the job cannot start until the user chooses
            load_checkpoint(point.metadata_url)
        except RestoreError as e:
            raise RestoreError(f"the job's restore point names {point.metadata_url} (restored "
                               f"from, and no checkpoint completed since): {e}; delete "
                               f"{self.url} to restore from the job's latest checkpoint",
                               checkpoint=point.metadata_url) from e
        return point.metadata_url, point.mode

    def current(self) -> RestorePoint | None:
        """The restore point, if the job has one (whether it applies or not)."""
        if not self._storage.exists(self.url):
            return None
        return RestorePoint.from_json(self._storage.read_file(self.url), self.url)

    def restored(self, checkpoint: str | None, mode: RestoreMode, plan: RestorePlan) -> None:
        """After a restore from ``checkpoint`` (None: the latest retained): kept for a
        checkpoint not the job's own (after the newest id the job keeps: the claimed one's
        in CLAIM mode), removed for one of the job's own."""
        if checkpoint is None or plan.chosen is None:
            return
        if plan.own:
            self.remove()
            return
        newest = max((c.checkpoint_id for c in plan.keep), default=-1)
        point = RestorePoint(plan.chosen.metadata_url, mode, newest)
        self._guard()
        self._storage.write_file(self.url, point.to_json())

    def remove(self) -> None:
        if self._storage.exists(self.url):
            self._guard()
            self._storage.delete(self.url)
