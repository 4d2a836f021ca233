"""A job's epochs as claim files, the fencing tokens of its lease (docs/architecture.md "Many
jobs, one tree"; the holder is :mod:`dstl_ray.checkpoint.lease`).

Each incarnation of a job claims its epoch by creating ``{base}/_epochs/{job}/{epoch}.epoch``
*only if it is absent* (``Storage.create_file``). Claims are what makes the lease a lock
rather than a guess:

* Two drivers that both decided to take the job compute the same next epoch (one above the
  newest claim they listed) and only one creates it; the other is refused. A driver that
  listed after the other's claim sees a claim newer than the lease record and watches
  instead of taking at once.
* The fencing token of an incarnation is "claim ``epoch + 1`` is absent": one existence
  check, made before each destructive step (:meth:`EpochClaims.superseded`). A holder whose
  job was taken over fails it at its next step, whatever its clock or its renewals say.
* Epochs never repeat or go backwards: no counter is read, bumped and written back. The
  directory is outside the job directory, so it survives DELETE_ON_CANCELLATION and a deleted
  job directory (one small file per incarnation stays behind).
* A clean shutdown marks its claim released (rewritten by its own holder), so the next
  driver may start at once even when the lease record was deleted with the job's files.

Stores without an atomic create-if-absent (``create_file`` is None: some fsspec stores, S3
through an s3fs without conditional puts) write the claim, wait a settle time (three times
the write's duration, at least ``settle_s``) and read it back: a guess, as two writes may
land in either order; :meth:`EpochClaims.superseded` there also reads the holder's own claim
back, so of two holders of one epoch the overwritten one is fenced at its next step. Where
``create_file`` exists the claim is read back too (a server that ignores the condition is
caught when its other write came first).

The previous version counted epochs in one file, ``{base}/_epochs/{job}.epoch``; it is read
as a floor, so a job that ran under it keeps growing its epochs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import JobLeaseError, StorageError
from ..storage.base import Storage, join

EPOCHS_DIR = "_epochs"  # under the base path: {base}/_epochs/{job}/{epoch}.epoch
CLAIM_SUFFIX = ".epoch"
_CLAIM_NAME = re.compile(r"^(\d+)" + re.escape(CLAIM_SUFFIX) + "$")


def default_epochs_url(job_path: str) -> str:
    """``{base}/_epochs/{job}`` for a job directory ``{base}/{job}`` (a coordinator passes
    its own base path: job ids may hold ``/``)."""
    base, _, job = job_path.rstrip("/").rpartition("/")
    return join(base, EPOCHS_DIR, job)


@dataclass(frozen=True)
class Claim:
    """Epoch ``epoch`` was claimed by the driver ``record`` names (holder, host, machine,
    pid, process start, TTL; ``released`` once it shut down cleanly)."""

    epoch: int
    record: dict


class EpochClaims:
    """The claim files of one job under ``directory`` (``{base}/_epochs/{job}``)."""

    def __init__(self, storage: Storage, directory: str, *, settle_s: float,
                 clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.storage = storage
        self.directory = directory.rstrip("/")
        self.legacy_url = self.directory + CLAIM_SUFFIX  # the previous version's counter
        self.settle_s = settle_s
        self.clock = clock
        self.sleep = sleep

    @property
    def atomic(self) -> bool:
        """The store creates a name only if absent (else claims are written and read back)."""
        return getattr(self.storage, "create_file", None) is not None

    def url(self, epoch: int) -> str:
        return join(self.directory, f"{epoch}{CLAIM_SUFFIX}")

    # ------------------------------------------------------------------ reading

    def epochs(self) -> list[int]:
        """Every claimed epoch, oldest first (a listing of the claims directory: only its
        own files, not those of a job whose id continues this one's with ``/``)."""
        prefix = self.directory + "/"
        out = []
        try:
            files = self.storage.list_files(self.directory)
        except StorageError as e:
            raise JobLeaseError(f"cannot list the job's epoch claims {self.directory} ({e})"
                                ) from e
        for url in files:
            m = _CLAIM_NAME.match(url[len(prefix):]) if url.startswith(prefix) else None
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def read(self, epoch: int) -> Claim | None:
        """Claim ``epoch`` (None: not claimed). A claim whose content cannot be read names
        an unknown holder: it is watched, never taken at once."""
        url = self.url(epoch)
        try:
            if not self.storage.exists(url):
                return None
            rec = json.loads(self.storage.read_file(url))
        except StorageError as e:
            raise JobLeaseError(f"cannot read the job's epoch claim {url} ({e})") from e
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            rec = {"holder": "?", "host": "?"}
        return Claim(epoch, {**rec, "epoch": epoch})

    def newest(self) -> Claim | None:
        """The newest claim (None: the job never ran under epoch claims)."""
        epochs = self.epochs()
        return self.read(epochs[-1]) if epochs else None

    def floor(self) -> int:
        """The previous version's epoch counter (0 when there is none). One that cannot be
        read raises: a new incarnation must be above every earlier one."""
        url = self.legacy_url
        try:
            if not self.storage.exists(url):
                return 0
            epoch = int(self.storage.read_file(url).decode().strip())
        except (StorageError, ValueError, UnicodeDecodeError) as e:
            raise JobLeaseError(f"cannot read the job's epoch counter {url} ({e}); write a "
                                f"number above every epoch the job ran with into it") from e
        if epoch < 0:
            raise JobLeaseError(f"job epoch counter {url} holds {epoch}, want a number >= 0")
        return epoch

    # ------------------------------------------------------------------ writing

    def claim(self, epoch: int, record: dict) -> bool:
        """Claim ``epoch`` for the holder ``record`` names: False if another driver has (or
        may have) claimed it."""
        url, data = self.url(epoch), json.dumps({**record, "epoch": epoch}).encode()
        create = getattr(self.storage, "create_file", None)
        if create is not None:
            if not create(url, data):
                return False
        else:
            t0 = self.clock()
            self.storage.write_file(url, data)
            # the last write wins: wait long enough for a write as slow as ours to land
            self.sleep(max(self.settle_s, 3 * (self.clock() - t0)))
        return self._holder(epoch) == record.get("holder")

    def release(self, epoch: int, record: dict) -> None:
        """Mark this holder's own claim released (a clean shutdown): the next driver may take
        the job at once, also when the lease record was deleted."""
        self.storage.write_file(self.url(epoch),
                                json.dumps({**record, "epoch": epoch, "released": True}).encode())

    def superseded(self, epoch: int, holder: str) -> str | None:
        """The fencing-token check of incarnation ``epoch``: why it no longer holds the job
        (a newer epoch was claimed, or, where claims are guessed, its own claim names
        another holder), or None. One existence check where claims are atomic."""
        try:
            if self.storage.exists(self.url(epoch + 1)):
                return f"epoch {epoch + 1} was claimed by another driver"
            if not self.atomic and self._holder(epoch) != holder:
                return f"its epoch {epoch} was claimed by another driver too"
        except StorageError as e:
            raise JobLeaseError(f"cannot check the job's epoch claims {self.directory} ({e})"
                                ) from e
        return None

    def _holder(self, epoch: int) -> object:
        claim = self.read(epoch)
        return None if claim is None else claim.record.get("holder")
