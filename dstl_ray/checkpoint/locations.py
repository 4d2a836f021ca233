"""Checkpoint locations: each checkpoint's ``chk-n`` directory, made before its metadata.

Flink's coordinator initializes a checkpoint's storage location when it triggers the
checkpoint, before the barriers go out (``CheckpointStorageCoordinatorView
.initializeLocationForCheckpoint``), and discards it when the checkpoint fails. Here the
location is made on a thread of its own while the snapshots are taken
(:meth:`CheckpointLocations.begin`; a checkpoint hub begins it just after its triggers are
sent), so the commit that follows only writes ``_metadata``:
the directory and its durable name in the job directory are off the checkpoint's critical
path (on ``file://`` a new directory is a ``mkdir`` and an fsync of its parent).

The thread is the locations' own: a commit waits for its location (:meth:`ready`) while
holding the coordinator's commit lock, so a location must never queue behind work that
waits for that lock. A location not started by then is cancelled, and one that failed is
made again in the commit: either way the metadata's directory is there, its name durable,
or the checkpoint is declined.

A location that never gets its metadata is removed when a newer checkpoint completes (an id
older than a complete one can no longer complete), when its own checkpoint is declined, and
when the coordinator shuts down. Only an empty directory is ever removed, and only by a
driver that still holds the job's lease (``guard``), as for every delete. A driver that
crashes leaves its empty ``chk-n`` behind: the next run's orphan cleanup removes it
(:func:`remove_abandoned_locations`). Stores without directories (S3) have no location to
make: there, all of this does nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from collections.abc import Callable

from ..storage.base import Storage, join
from .metadata import METADATA_FILE, remove_checkpoint_dir

log = logging.getLogger(__name__)

_LOCATION = re.compile(r"chk-([0-9]+)")


def checkpoint_dir(job_path: str, checkpoint_id: int) -> str:
    """The location of checkpoint ``checkpoint_id`` of the job at ``job_path``."""
    return join(job_path, f"chk-{checkpoint_id}")


def metadata_url(job_path: str, checkpoint_id: int) -> str:
    """The ``_metadata`` of checkpoint ``checkpoint_id`` of the job at ``job_path``."""
    return join(checkpoint_dir(job_path, checkpoint_id), METADATA_FILE)


def remove_abandoned_locations(job_path: str, storage: Storage, check: Callable[[], object],
                               spare: Callable[[int], bool] = lambda n: False) -> list[str]:
    """Remove the empty ``chk-n`` directories of the job at ``job_path`` (a crashed
    driver's locations made ahead; a directory holding anything stays) but those of the ids
    ``spare`` names (this run's own, begun meanwhile), each after ``check`` (the lease's:
    it raises to stop). For the orphan cleanup of a restore; on a storage that lists
    directories (``list_dirs``); a listing that fails leaves them all. Returns the URLs of
    those it tried."""
    listing = getattr(storage, "list_dirs", None)
    if listing is None:
        return []
    try:
        dirs = listing(job_path)
    except Exception as e:  # noqa: BLE001 - a tidy-up: it never fails the restore
        log.warning("empty checkpoint directories of %s not removed: %s", job_path, e)
        return []
    tried = []
    for url in dirs:
        m = _LOCATION.fullmatch(url.rstrip("/").rsplit("/", 1)[-1])
        if m and not spare(int(m.group(1))):
            check()
            remove_checkpoint_dir(storage, join(url, METADATA_FILE))  # (only if empty)
            tried.append(url)
    return tried


class CheckpointLocations:
    """The locations begun and not yet committed or removed, by checkpoint id.

    ``guard`` raises unless this driver may still write and delete (the job lease's check);
    ``before_make(url)`` runs before a location is made, with its ``_metadata`` URL (a
    replayed id waits for its old checkpoint's discard, which removes the same directory)."""

    def __init__(self, storage: Storage, job_path: str, guard: Callable[[], object],
                 before_make: Callable[[str], object]) -> None:
        self.storage = storage
        self.job_path = job_path
        self._make = getattr(storage, "make_dirs", None)
        self._guard = guard
        self._before_make = before_make
        self._lock = threading.Lock()
        self._begun: dict[int, concurrent.futures.Future] = {}
        self._ready: set[int] = set()  # begun, then made ready for their commit
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "dstl-chk-dirs")

    def begin(self, checkpoint_id: int, metadata_url: str) -> None:
        """Make checkpoint ``checkpoint_id``'s location in the background (once; nothing
        once closed)."""
        if self._make is None:
            return
        with self._lock:
            if checkpoint_id in self._begun or self._closed:
                return
            self._begun[checkpoint_id] = self._executor.submit(
                self._made, checkpoint_id, metadata_url)

    def _made(self, checkpoint_id: int, metadata_url: str) -> None:
        assert self._make is not None
        self._guard()  # a driver fenced meanwhile makes nothing in the job
        self._before_make(metadata_url)
        self._make(checkpoint_dir(self.job_path, checkpoint_id))

    def owns(self, checkpoint_id: int) -> bool:
        """Whether checkpoint ``checkpoint_id``'s location is this run's (begun, not yet
        committed or removed)."""
        with self._lock:
            return checkpoint_id in self._begun or checkpoint_id in self._ready

    def ready(self, checkpoint_id: int) -> None:
        """Before checkpoint ``checkpoint_id``'s metadata is written: its location, if
        begun, is made, its name durable (made here, in the caller, if it was not started
        yet or failed; a failure here declines the checkpoint)."""
        with self._lock:
            made = self._begun.pop(checkpoint_id, None)
            if made is None:
                return
            self._ready.add(checkpoint_id)
        if not made.cancel():
            try:
                made.result()
                return
            except Exception as e:  # noqa: BLE001 - made again below, or the commit fails
                log.warning("location of checkpoint %d not made ahead (made now): %s",
                            checkpoint_id, e)
        assert self._make is not None
        self._make(checkpoint_dir(self.job_path, checkpoint_id))

    def declined(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` was declined: its location goes if this made it
        (and it is empty)."""
        with self._lock:
            ours = checkpoint_id in self._begun or checkpoint_id in self._ready
            self._ready.discard(checkpoint_id)
        if ours:
            self.remove(checkpoint_id)

    def completed(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: the older locations begun can no longer
        get their metadata, and go (rare: a micro-batch that failed and was not retried)."""
        with self._lock:
            self._ready.discard(checkpoint_id)
            older = [n for n in self._begun if n < checkpoint_id]
        for n in older:
            self.remove(n)

    def remove(self, checkpoint_id: int) -> None:
        """Remove checkpoint ``checkpoint_id``'s location if it is empty (a declined or
        abandoned checkpoint's; a directory holding anything is left as it is)."""
        with self._lock:
            made = self._begun.pop(checkpoint_id, None)
        if made is not None and not made.cancel():
            concurrent.futures.wait([made])
        try:
            self._guard()  # a driver fenced meanwhile deletes nothing
        except Exception as e:  # noqa: BLE001 - an empty directory left costs nothing more
            log.debug("location of checkpoint %d not removed: %s", checkpoint_id, e)
            return
        remove_checkpoint_dir(self.storage, metadata_url(self.job_path, checkpoint_id))

    def close(self) -> None:
        """Remove every location begun and never completed, and make no more (shutting
        down; the caller holds the commit lock, so no commit writes into one meanwhile)."""
        with self._lock:
            self._closed = True
            left = list(self._begun)
        for n in left:
            self.remove(n)
        self._executor.shutdown(wait=True)

    def abandon(self) -> None:
        """Make and remove nothing more (a crashed driver's stop)."""
        with self._lock:
            self._closed = True
            self._begun.clear()
            self._ready.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
