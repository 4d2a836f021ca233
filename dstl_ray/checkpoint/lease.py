"""One live driver per job: a lease file in the job directory, and the job's incarnation.

Two drivers coordinating the same job id would each write ``chk-n/_metadata`` and each run
the orphan cleanup of FLIP-158 "Cleanup after recovery", which deletes every file that no
checkpoint *it* retains names: the second driver would delete the first one's in-flight
changelog and state files. Flink avoids this with leader election of its JobMaster; dstl-ray
has no cluster service of its own, so the coordinator holds a lease, ``{job}/_lease``, renewed
in the background:

* ``acquire`` refuses with :class:`JobLeaseError` while the file names another holder that is
  alive: renewed within its ``ttl_s``, and not known dead (same host and its process gone,
  or, in this process, shut down or abandoned). The file is written, then read back after a
  short settle time, so of two drivers starting at once only one keeps it.
* The renewer re-reads the file before every renewal; a lease taken over by someone else
  (this driver was paused past its TTL) *fences* this driver: its later checkpoints are
  declined and it never deletes again.

Every acquisition starts a new **incarnation** of the job: ``{epoch}-{holder}``, with the
epoch above the previous lease's and at least the wall clock in milliseconds, so it grows also
when the job directory (and its lease) was deleted. Node actors keep a job's state (batching
knowledge, merged changelog files, the subsumed watermark) per incarnation and start clean
when a newer one appears, so a job id reused after DELETE_ON_CANCELLATION never has its new
files freed with the old run's knowledge (docs/architecture.md "Jobs and incarnations").
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import DstlError, JobLeaseError, StorageError
from ..process_identity import MACHINE as _MACHINE
from ..process_identity import pid_alive as _pid_alive
from ..storage.base import Storage, join
from ..storage.registry import get_storage

log = logging.getLogger(__name__)

LEASE_FILE = "_lease"
LEASE_VERSION = 1


@dataclass(frozen=True)
class Incarnation:
    """One run of a job: ``epoch`` orders incarnations, ``holder`` names the driver."""

    epoch: int
    holder: str

    def __str__(self) -> str:
        return f"{self.epoch}-{self.holder}"

    @classmethod
    def parse(cls, text: str) -> Incarnation | None:
        """``""`` (a writer outside any coordinated job) gives None."""
        if not text:
            return None
        epoch, sep, holder = text.partition("-")
        if not sep or not epoch.isdigit() or not holder.isalnum():
            raise DstlError(f"bad job incarnation {text!r} (want EPOCH-HOLDER)")
        return cls(int(epoch), holder)


# holders in this process that are gone (shut down or abandoned): the pid is alive, the
# holder is not; weak values so live leases of this process are recognised as alive
_LOCAL: weakref.WeakValueDictionary[str, JobLease] = weakref.WeakValueDictionary()
_HOST = socket.gethostname()
# the newest epoch this process gave out: two incarnations of one job started by one process
# in the same millisecond (a wiped job directory, then a restart) must still be ordered
_last_epoch = 0
_epoch_lock = threading.Lock()


class JobLease:
    """The lease of one job held by one coordinator (see the module docstring)."""

    def __init__(self, job_path: str, *, ttl_s: float = 30.0, settle_s: float = 0.05,
                 storage: Storage | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not ttl_s > 0:
            raise DstlError(f"lease ttl_s must be > 0, got {ttl_s!r}")
        self.job_path = job_path
        self.url = join(job_path, LEASE_FILE)
        self.ttl_s = float(ttl_s)
        self.settle_s = settle_s
        self.storage = storage or get_storage(job_path)
        self.clock = clock
        self.holder = uuid.uuid4().hex[:16]
        self.incarnation: Incarnation | None = None
        self.fenced: str | None = None  # why this holder lost the job
        self._active = False
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ reading

    def read(self) -> dict | None:
        """The lease file's record, or None when there is none. A file that cannot be read
        or parsed raises :class:`JobLeaseError`: never take or give up a job on doubt."""
        try:
            if not self.storage.exists(self.url):
                return None
            rec = json.loads(self.storage.read_file(self.url))
        except (StorageError, ValueError) as e:
            raise JobLeaseError(f"cannot read the job lease {self.url} ({e}); if no driver "
                                f"runs this job, delete the file") from e
        if not isinstance(rec, dict):
            raise JobLeaseError(f"job lease {self.url} holds no JSON object; if no driver "
                                f"runs this job, delete the file")
        return rec

    def _alive(self, rec: dict) -> bool:
        if rec.get("released"):
            return False  # given up by a clean shutdown (the record keeps its epoch)
        if rec.get("holder") == self.holder:
            return True
        if self.clock() - float(rec.get("renewed_at", 0)) > float(rec.get("ttl_s", 0)):
            return False  # not renewed in time: its driver is gone or fenced itself
        if rec.get("machine") == _MACHINE:
            pid = int(rec.get("pid", -1))
            if pid == os.getpid():
                other = _LOCAL.get(str(rec.get("holder")))
                return other is not None and other._active
            return pid > 0 and _pid_alive(pid)
        return True

    def _record(self, **extra: object) -> bytes:
        assert self.incarnation is not None
        return json.dumps({"version": LEASE_VERSION, "holder": self.holder,
                           "epoch": self.incarnation.epoch, "host": _HOST,
                           "machine": _MACHINE, "pid": os.getpid(),
                           "renewed_at": self.clock(), "ttl_s": self.ttl_s,
                           **extra}).encode()

    # ------------------------------------------------------------------ holding

    @property
    def held(self) -> bool:
        """This driver holds the job now (acquired, not released, abandoned or fenced)."""
        return self._active

    def acquire(self, renew: bool = True) -> Incarnation:
        """Take the job for a new incarnation, or raise :class:`JobLeaseError`."""
        if self._active:
            assert self.incarnation is not None
            return self.incarnation
        old = self.read()
        if old is not None and self._alive(old):
            raise JobLeaseError(
                f"job directory {self.job_path} is held by another live driver (holder "
                f"{old.get('holder')} on host {old.get('host')}, pid {old.get('pid')}, "
                f"renewed {self.clock() - float(old.get('renewed_at', 0)):.1f}s ago, ttl "
                f"{old.get('ttl_s')}s): stop that job (or wait for its lease to expire) "
                f"before starting it again, or use another job id")
        prev = int(old.get("epoch", 0)) if old else 0
        self.incarnation = Incarnation(_next_epoch(prev, int(self.clock() * 1000)), self.holder)
        create = getattr(self.storage, "create_file", None)
        if old is None and create is not None:
            # where the store can create a name only if absent, two drivers starting at
            # once cannot both succeed
            if not create(self.url, self._record()):
                raise JobLeaseError(f"job directory {self.job_path} was taken by another "
                                    f"driver while this one started")
        else:
            t0 = time.monotonic()
            self.storage.write_file(self.url, self._record())
            # two drivers that wrote at once: the last write wins; wait long enough for a
            # write as slow as ours to land before reading back
            time.sleep(max(self.settle_s, 3 * (time.monotonic() - t0)))
            now = self.read()
            if now is None or now.get("holder") != self.holder:
                raise JobLeaseError(f"job directory {self.job_path} was taken by another "
                                    f"driver (holder {now.get('holder') if now else None}) "
                                    f"while this one started")
        self._active = True
        self._renewed_at = self.clock()
        _LOCAL[self.holder] = self
        if renew:
            self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name="dstl-lease")
            self._renewer.start()
        log.info("job %s: incarnation %s", self.job_path, self.incarnation)
        return self.incarnation

    def check(self, force: bool = False) -> None:
        """Raise :class:`JobLeaseError` unless this driver still holds the job. Called before
        every metadata write and delete: when the last renewal is older than half the TTL
        (this process was paused, or storage was slow), or ``force``, the file is read
        again first, so a driver that woke up after another one took over never writes or
        deletes."""
        if self._active and (force or self.clock() - self._renewed_at > self.ttl_s / 2):
            self.renew()
        if self.fenced is not None:
            raise JobLeaseError(self.fenced)
        if not self._active:
            raise JobLeaseError(f"job {self.job_path}: this driver does not hold the lease")

    def _fence(self, why: str) -> bool:
        self.fenced = f"job {self.job_path}: {why}: this driver is fenced and stops " \
                      f"checkpointing"
        self._active = False
        log.error("%s", self.fenced)
        return False

    def renew(self) -> bool:
        """Renew once: False (and fenced) if someone else holds the lease now, or it
        vanished after our TTL ran out. A read error renews nothing and raises (the TTL is
        the limit); a lease file that vanished within our TTL (the job directory was
        deleted under us) is written again."""
        if not self._active:
            return False
        rec = self.read()
        if rec is not None and rec.get("holder") != self.holder:
            return self._fence(f"taken over by driver {rec.get('holder')} (host "
                               f"{rec.get('host')}, pid {rec.get('pid')})")
        if rec is None and self.clock() - self._renewed_at > self.ttl_s:
            return self._fence("the lease vanished while this driver was not renewing it")
        self.storage.write_file(self.url, self._record())
        self._renewed_at = self.clock()
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    return
            except DstlError as e:  # storage trouble: try again; the TTL is the limit
                log.warning("cannot renew job lease %s: %s", self.url, e)

    def release(self, delete: bool = False) -> None:
        """Give the job up (a clean shutdown): the next driver need not wait for the TTL.
        The file stays as a released record, so the next incarnation's epoch still grows
        from ours whatever its host's clock says; ``delete`` (a job cancelled with
        DELETE_ON_CANCELLATION leaves nothing behind) removes it."""
        was = self._active
        self.abandon()
        if not was:
            return
        try:
            rec = self.read()
            if rec is not None and rec.get("holder") == self.holder:
                if delete:
                    self.storage.delete(self.url)
                else:
                    self.storage.write_file(self.url, self._record(released=True))
        except DstlError as e:
            log.warning("cannot release job lease %s: %s", self.url, e)

    def abandon(self) -> None:
        """Stop holding without touching the file, as a crashed driver would (tests and
        the chaos harness simulate a driver's death with it)."""
        self._active = False
        self._stop.set()
        _LOCAL.pop(self.holder, None)


def _next_epoch(prev: int, now_ms: int) -> int:
    """Above the previous lease's epoch, at least the wall clock in milliseconds, and above
    every epoch this process gave out before."""
    global _last_epoch
    with _epoch_lock:
        _last_epoch = max(prev + 1, now_ms, _last_epoch + 1)
        return _last_epoch
