"""Discarding subsumed checkpoints off the completion path (Flink's ``CheckpointsCleaner``).

A checkpoint is complete once its ``_metadata`` is durable (FLIP-158 "Performing a
checkpoint"); the checkpoints it subsumes are deleted after that, in the background, as
Flink's ``CheckpointsCleaner`` discards them on its I/O executor: the caller of
``complete_checkpoint`` (a Spark micro-batch, the next checkpoint's trigger) does not wait
for the deletes.

What makes that safe:

* the subsumed checkpoint left the retained list before its discard is handed over, so
  nothing new is built on it, and the newer checkpoint registered its own references to the
  shared files first (the registry deletes only files nobody references);
* a discard is one background delete (:mod:`dstl_ray.storage.deleter`, the process's
  deleter that the registry's deletes go through too) guarded by the job's lease: a driver
  fenced (or crashed: :meth:`~dstl_ray.checkpoint.lease.JobLease.abandon`) before it runs
  deletes nothing; it deletes the metadata first (never a metadata naming deleted files),
  then drops its references;
* a discard that never runs (a crash, a full queue) leaves a subsumed checkpoint on
  storage: the next run's recovery deletes its ``_metadata`` as an orphan, and the files
  nothing references (docs/architecture.md "Checkpoint lifecycle");
* ``flush`` of the deleter (a coordinator's ``shutdown``, tests) waits for the discards and
  for the file deletes they hand over.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from ..errors import DstlError
from ..state.registry import SharedStateRegistry
from .lease import JobLease
from .metadata import delete_metadata
from .recovery import CompletedCheckpoint

log = logging.getLogger(__name__)


class CheckpointsCleaner:
    """Deletes subsumed checkpoints of one job: now (:meth:`discard`) or in the background
    (:meth:`discard_later`)."""

    def __init__(self, lease: JobLease, registry: SharedStateRegistry) -> None:
        self._lease = lease
        self._registry = registry

    def discard(self, cc: CompletedCheckpoint) -> None:
        """Subsume ``cc`` now. A fenced driver deletes nothing: the job is another
        driver's now."""
        try:
            self._lease.check()
        except DstlError as e:  # fenced, or unsure: the next recovery's cleanup gets it
            log.warning("not discarding checkpoint %d: %s", cc.checkpoint_id, e)
            return
        self._remove(cc)

    def discard_later(self, checkpoints: Iterable[CompletedCheckpoint]) -> None:
        """Hand the discards of ``checkpoints`` to the background deleter."""
        for cc in checkpoints:
            self._registry.deleter.submit(functools.partial(self._remove, cc),
                           f"checkpoint {cc.checkpoint_id} ({cc.metadata_url})",
                           guard=self._lease.check)

    def _remove(self, cc: CompletedCheckpoint) -> None:
        """The metadata first, then its references (the registry deletes what nobody else
        uses)."""
        try:
            delete_metadata(cc.metadata_url)
        except DstlError as e:
            log.warning("cannot delete %s: %s", cc.metadata_url, e)
        self._registry.release(cc.metadata_url)
