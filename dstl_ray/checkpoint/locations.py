"""Checkpoint locations: each checkpoint's ``chk-n`` directory, made before its metadata.

Flink's coordinator initializes a checkpoint's storage location when it triggers the
checkpoint, before the barriers go out (``CheckpointStorageCoordinatorView
.initializeLocationForCheckpoint``), and discards it when the checkpoint fails. Here the
location is made on a background thread while the snapshots are taken
(:meth:`CheckpointLocations.begin`), so the commit that follows only writes ``_metadata``:
the directory and its durable name in the job directory are off the checkpoint's critical
path (on ``file://`` a new directory is a ``mkdir`` and an fsync of its parent).

A location that never gets its metadata is removed when a newer checkpoint completes (an id
older than a complete one can no longer complete), when its own checkpoint is declined, and
when the coordinator shuts down. Only an empty directory is ever removed. Stores without
directories (S3) have no location to make: there, all of this does nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

from ..storage.base import Storage, join
from .metadata import METADATA_FILE

log = logging.getLogger(__name__)


def checkpoint_dir(job_path: str, checkpoint_id: int) -> str:
    """The location of checkpoint ``checkpoint_id`` of the job at ``job_path``."""
    return join(job_path, f"chk-{checkpoint_id}")


def metadata_url(job_path: str, checkpoint_id: int) -> str:
    """The ``_metadata`` of checkpoint ``checkpoint_id`` of the job at ``job_path``."""
    return join(checkpoint_dir(job_path, checkpoint_id), METADATA_FILE)


class CheckpointLocations:
    """The locations begun and not yet committed or removed, by checkpoint id.

    ``submit`` runs the background work (the coordinator's executor); ``before_make(url)``
    runs first in it, with the ``_metadata`` URL (a replayed id waits for its old
    checkpoint's discard, which removes the same directory)."""

    def __init__(self, storage: Storage, job_path: str,
                 submit: Callable[..., concurrent.futures.Future],
                 before_make: Callable[[str], object]) -> None:
        self.storage = storage
        self.job_path = job_path
        self._make = getattr(storage, "make_dirs", None)
        self._remove = getattr(storage, "delete_dir", None)
        self._submit = submit
        self._before_make = before_make
        self._lock = threading.Lock()
        self._begun: dict[int, concurrent.futures.Future] = {}

    def begin(self, checkpoint_id: int, metadata_url: str) -> None:
        """Make checkpoint ``checkpoint_id``'s location in the background (once)."""
        if self._make is None:
            return
        with self._lock:
            if checkpoint_id in self._begun:
                return
            self._begun[checkpoint_id] = self._submit(self._made, checkpoint_id, metadata_url)

    def _made(self, checkpoint_id: int, metadata_url: str) -> None:
        assert self._make is not None
        self._before_make(metadata_url)
        self._make(checkpoint_dir(self.job_path, checkpoint_id))

    def ready(self, checkpoint_id: int) -> bool:
        """Wait until checkpoint ``checkpoint_id``'s location, if begun, is made; whether it
        was begun. A location that could not be made is only logged: writing the metadata
        makes it (or fails)."""
        with self._lock:
            made = self._begun.pop(checkpoint_id, None)
        if made is None:
            return False
        try:
            made.result()
        except Exception as e:  # noqa: BLE001
            log.debug("location of checkpoint %d not made ahead: %s", checkpoint_id, e)
        return True

    def completed(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: the older locations begun can no longer
        get their metadata, and go (rare: a micro-batch that failed and was not retried)."""
        with self._lock:
            older = [n for n in self._begun if n < checkpoint_id]
        for n in older:
            self.remove(n)

    def remove(self, checkpoint_id: int) -> None:
        """Remove checkpoint ``checkpoint_id``'s location if it is empty (a declined or
        abandoned checkpoint's; a directory holding anything is left as it is)."""
        with self._lock:
            made = self._begun.pop(checkpoint_id, None)
        if made is not None:
            concurrent.futures.wait([made])
        if self._remove is None:
            return
        try:
            self._remove(checkpoint_dir(self.job_path, checkpoint_id))
        except Exception as e:  # noqa: BLE001 - an empty directory left costs nothing more
            log.debug("location of checkpoint %d not removed: %s", checkpoint_id, e)

    def close(self) -> None:
        """Remove every location begun and never committed (shutting down)."""
        with self._lock:
            left = list(self._begun)
        for n in left:
            self.remove(n)
