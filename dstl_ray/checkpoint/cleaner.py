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
* the cleaner knows which discards are outstanding (handed over or running), by metadata
  URL: whatever could meet one runs it first, in the caller, and waits for a running one
  (:meth:`settle`): writing a checkpoint id again (a replay after
  ``drop_checkpoints_from``: the old discard must not delete the new ``_metadata`` nor drop
  its references), a restore listing the retained checkpoints, a cancel deleting them all;
  and the subsumed watermark stays below every outstanding id (:meth:`outstanding_ids`), so
  no merged file a listed ``_metadata`` names is freed by it;
* a discard the deleter cannot take (its queue is full) runs in the caller at once;
* a discard that never runs (a crash) leaves a subsumed checkpoint on storage: the next
  run's recovery deletes its ``_metadata`` as an orphan, and the files nothing references
  (docs/architecture.md "Checkpoint lifecycle").
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Iterable

from ..errors import DstlError
from ..state.registry import SharedStateRegistry
from .lease import JobLease
from .metadata import delete_metadata
from .recovery import CompletedCheckpoint

log = logging.getLogger(__name__)


class CheckpointsCleaner:
    """Deletes subsumed checkpoints of one job: now (:meth:`discard`) or in the background
    (:meth:`discard_later`), each at most once."""

    def __init__(self, lease: JobLease, registry: SharedStateRegistry,
                 on_discarded: Callable[[], None] = lambda: None) -> None:
        """``on_discarded`` runs after each discard (the coordinator tells its backends the
        subsumed watermark, which an outstanding discard held back)."""
        self._lease = lease
        self._registry = registry
        self._on_discarded = on_discarded
        self._cond = threading.Condition()
        self._queued: dict[str, CompletedCheckpoint] = {}  # handed over, not started
        self._running: dict[str, int] = {}  # metadata URL -> checkpoint id
        self._refused: set[str] = set()  # queued, but their lease check failed: next time

    def discard(self, cc: CompletedCheckpoint) -> None:
        """Subsume ``cc`` now. A fenced driver deletes nothing: the job is another
        driver's now."""
        if self._allowed(cc):
            self._remove(cc)

    def discard_later(self, checkpoints: Iterable[CompletedCheckpoint]) -> None:
        """Hand the discards of ``checkpoints`` to the background deleter (one the deleter
        cannot take runs here, now)."""
        with self._cond:  # those whose lease check failed (unsure, not fenced) go again
            todo = [*checkpoints, *(self._queued[u] for u in self._refused)]
            self._refused.clear()
            self._queued.update((cc.metadata_url, cc) for cc in todo)
        for cc in todo:
            url = cc.metadata_url
            if not self._registry.deleter.submit(
                    functools.partial(self._take, url),
                    f"checkpoint {cc.checkpoint_id} ({url})",
                    guard=functools.partial(self._guard, url)):
                self._settle_one(url)

    def outstanding_ids(self) -> list[int]:
        """Ids of the checkpoints whose discards are handed over or running."""
        with self._cond:
            return [c.checkpoint_id for c in self._queued.values()] + list(
                self._running.values())

    def settle(self, urls: Collection[str] | None = None) -> None:
        """Run now, in the caller, the outstanding discards of ``urls`` (metadata URLs;
        None: all) that have not started, and wait for those running."""
        with self._cond:
            todo = [u for u in self._queued if urls is None or u in urls]
        for url in todo:
            self._settle_one(url)
        with self._cond:
            while any(urls is None or u in urls for u in self._running):
                self._cond.wait()

    def _settle_one(self, url: str) -> None:
        with self._cond:
            cc = self._queued.get(url)
        if cc is not None and self._allowed(cc):
            self._take(url)

    def _guard(self, url: str) -> None:
        """The deleter's check before it runs a discard: the job's lease."""
        try:
            self._lease.check()
        except BaseException:
            with self._cond:
                if url in self._queued:
                    self._refused.add(url)
            raise

    def _allowed(self, cc: CompletedCheckpoint) -> bool:
        try:
            self._lease.check()
        except DstlError as e:  # fenced, or unsure: the next recovery's cleanup gets it
            log.warning("not discarding checkpoint %d: %s", cc.checkpoint_id, e)
            return False
        return True

    def _take(self, url: str) -> None:
        """Run the discard of ``url`` if it is still queued (whoever takes it first)."""
        with self._cond:
            cc = self._queued.pop(url, None)
            if cc is None:
                return
            self._refused.discard(url)
            self._running[url] = cc.checkpoint_id
        try:
            self._remove(cc)
        finally:
            with self._cond:
                del self._running[url]
                self._cond.notify_all()
        try:
            self._on_discarded()
        except Exception as e:  # noqa: BLE001 - the discard is done; the next one tells again
            log.warning("after discarding checkpoint %d: %s", cc.checkpoint_id, e)

    def _remove(self, cc: CompletedCheckpoint) -> None:
        """The metadata first, then its references (the registry deletes what nobody else
        uses)."""
        try:
            delete_metadata(cc.metadata_url)
        except DstlError as e:
            log.warning("cannot delete %s: %s", cc.metadata_url, e)
        self._registry.release(cc.metadata_url)
