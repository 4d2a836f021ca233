"""Writing ``chk-n/_metadata`` so that no driver's write replaces another's.

The lease (:mod:`~dstl_ray.checkpoint.lease`) lets a driver write metadata only after a
check that it still holds the job, but a write that passed that check can land much later:
the driver's host is partitioned with the request in flight, and TCP delivers it once the
link is back, after another driver took the job over and resumed from the checkpoint before.
The new driver then completes the same checkpoint id (the next one, or a replayed Spark
micro-batch, whose id is fixed), and a plain last-writer-wins put would let the old
incarnation's late write replace the new one's ``_metadata``: a retained checkpoint naming
files the new driver's orphan cleanup deleted, or the state of a timeline that is gone.

So metadata is created only if absent (S3 ``If-None-Match: *``, a hard link on a file
system): a late write that comes after the new driver's fails. One that comes first is found
by the new driver's create: a file of an older incarnation (its ``epoch``) or of this one
(an attempt of its own that failed after all) is nobody's retained checkpoint, so after a
lease check it is deleted, and after another the create is retried; a file of a newer
incarnation means this driver no longer holds the job, and the checkpoint is declined. A
create that fails but landed (the file holds exactly this metadata) counts as done.

What is left: that delete is by name. A driver that passed its check and then was cut off
with the delete in flight, while a third one took the job and wrote this id, would delete
the third one's file when the link comes back (a conditional delete, S3 ``If-Match`` on
DeleteObject, would close it where the store has one).
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

from ..errors import CheckpointDeclinedError, StorageError
from ..storage.base import Storage
from .metadata import CheckpointMetadata

log = logging.getLogger(__name__)

ATTEMPTS = 5  # an old incarnation has a few writes in flight at most, each lands once


class Lease(Protocol):
    """What of the job's lease (:class:`~dstl_ray.checkpoint.lease.JobLease`) it needs."""

    @property
    def epoch(self) -> int: ...

    def check(self, force: bool = False) -> None: ...


class ExclusiveMetadata:
    """Creates the ``_metadata`` of a job's checkpoints for the incarnation holding
    ``lease`` (its epoch; its check before every delete)."""

    def __init__(self, storage: Storage, lease: Lease) -> None:
        self.storage = storage
        self.lease = lease
        self._create = getattr(storage, "create_file", None)
        self.replaced = 0  # late writes of other incarnations (or its own) deleted
        self._warned = False

    def write(self, url: str, meta: CheckpointMetadata) -> int:
        """Create ``url`` holding ``meta``; returns its size in bytes. Raises
        :class:`CheckpointDeclinedError` when a newer incarnation's file is there, or late
        writes kept coming."""
        data = meta.to_json().encode()
        if self._create is None:  # a storage without atomic create: the last write wins
            if not self._warned:
                self._warned = True
                log.warning("%s: this storage cannot create a file only if absent; a late "
                            "metadata write of a driver taken over may replace a checkpoint",
                            url)
            self.storage.write_file(url, data)
            return len(data)
        for attempt in range(ATTEMPTS):
            if attempt:
                self.lease.check()  # a driver taken over meanwhile creates nothing
            if self._created(url, data):
                return len(data)
            theirs = self._epoch_of(url)
            if theirs is None:
                continue  # deleted meanwhile: create again
            if theirs > meta.epoch:
                raise CheckpointDeclinedError(
                    f"{url} was written by incarnation epoch {theirs}, newer than this "
                    f"driver's ({meta.epoch}): another driver holds the job")
            self.lease.check()  # still the job's holder: the file is nobody's checkpoint
            log.warning("%s: a late write of incarnation epoch %d (this one is %d) is in "
                        "the way; deleted", url, theirs, meta.epoch)
            self.storage.delete(url)
            self.replaced += 1
        raise CheckpointDeclinedError(f"{url}: late writes of other incarnations kept "
                                      f"landing there ({ATTEMPTS} attempts)")

    def _created(self, url: str, data: bytes) -> bool:
        """One create; a create that failed (a timeout, say) but landed counts as done: the
        file holds exactly ``data`` (unique: it carries its time)."""
        assert self._create is not None
        try:
            return bool(self._create(url, data))
        except StorageError:
            try:
                if self.storage.exists(url) and self.storage.read_file(url) == data:
                    return True
            except StorageError:
                pass
            raise

    def _epoch_of(self, url: str) -> int | None:
        """The epoch the file at ``url`` names (0: none, or unreadable: not a loadable
        checkpoint, nobody's), or None when it is gone."""
        if not self.storage.exists(url):
            return None
        raw = self.storage.read_file(url)
        try:
            d = json.loads(raw)
        except ValueError:
            return 0
        epoch = d.get("epoch", 0) if isinstance(d, dict) else 0
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0
