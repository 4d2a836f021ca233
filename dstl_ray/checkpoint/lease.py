"""One live driver per job: a lease file in the job directory, and the job's incarnation.

Two drivers coordinating the same job id would each write ``chk-n/_metadata`` and each run
the orphan cleanup of FLIP-158 "Cleanup after recovery", which deletes every file that no
checkpoint *it* retains names: the second driver would delete the first one's in-flight
changelog and state files. Flink avoids this with leader election of its JobMaster; dstl-ray
has no cluster service of its own, so the coordinator holds a lease, ``{job}/_lease``, renewed
in the background. Chubby's and ZooKeeper's sessions are the models; no decision compares two
hosts' clocks (docs/architecture.md "Many jobs, one tree"):

* ``acquire`` takes a record that is absent, released or whose holder is known dead at once;
  a live-looking one it watches (:func:`~dstl_ray.checkpoint.lease_record.watch`): changed
  within its TTL refuses with :class:`JobLeaseError` naming the holder, unchanged for a full
  TTL on this process's monotonic clock is taken over. The record is then written (created
  only if absent where the store can) and read back after a short settle time, so of two
  drivers starting at once only one keeps it.
* The holder judges its own validity on its own monotonic clock: it is valid for half its
  TTL from the *start* of its last successful renewal. A renewal that could not complete in
  that time, however it ends, fences the holder for good (it cannot know whether someone
  took over), and so does a renewal that finds another holder's record or none at all.
  :meth:`JobLease.check`, called before every ``_metadata`` write and every delete (the
  background deleter's included), renews first when the last renewal is older than a
  quarter of the TTL, and refuses once the holder is fenced or past its validity. An
  observer takes over no earlier than a full TTL after the holder's last renewal began, so
  a step that passed ``check`` has at least half a TTL to land first.

Every acquisition starts a new **incarnation** of the job, ``{epoch}-{holder}``, the epoch one
above the job's counters in storage (the lease record and ``{base}/_epochs/{job}.epoch``,
never the wall clock). Node actors keep a job's state (batching knowledge, merged changelog
files, the subsumed watermark) per incarnation and start clean when a newer one appears, so a
job id reused after DELETE_ON_CANCELLATION never has its new files freed with the old run's
knowledge (docs/architecture.md "Many jobs, one tree").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

from ..errors import DstlError, JobLeaseError
from ..process_identity import HOST, MACHINE, start_time
from ..storage.base import Storage, join
from ..storage.registry import get_storage
from .lease_record import (
    LEASE_FILE,
    LEASE_VERSION,
    LOCAL_HOLDERS,
    Incarnation,
    default_epoch_url,
    describe,
    read_epoch,
    read_record,
    watch,
    write_epoch,
)

__all__ = ["LEASE_FILE", "Incarnation", "JobLease"]

log = logging.getLogger(__name__)

RENEW_AT = 0.2  # the background renewer renews when the last renewal is this old (x TTL)
CHECK_RENEW_AT = 0.25  # check() renews synchronously past this age (x TTL)
VALID_FOR = 0.5  # the holder's own validity from the start of its last renewal (x TTL)

# the newest epoch this process gave out per counter: two incarnations of one job started by
# one process must be ordered even if its counter was deleted in between
_epoch_floor: dict[str, int] = {}
_epoch_lock = threading.Lock()
_STARTED = start_time(os.getpid())


class JobLease:
    """The lease of one job held by one coordinator (see the module docstring). ``clock``
    is this process's monotonic clock (injected by tests, with ``sleep``)."""

    def __init__(self, job_path: str, *, ttl_s: float = 30.0, settle_s: float = 0.05,
                 storage: Storage | None = None, epoch_url: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not ttl_s > 0:
            raise DstlError(f"lease ttl_s must be > 0, got {ttl_s!r}")
        self.job_path = job_path
        self.url = join(job_path, LEASE_FILE)
        self.epoch_url = epoch_url or default_epoch_url(job_path)
        self.ttl_s = float(ttl_s)
        self.settle_s = settle_s
        self.storage = storage or get_storage(job_path)
        self.clock = clock
        self.sleep = sleep
        self.holder = uuid.uuid4().hex[:16]
        self.incarnation: Incarnation | None = None
        self.fenced: str | None = None  # why this holder lost the job (for good)
        self._active = False
        self._taking = False
        self._valid_from = 0.0  # start of the last successful renewal (self.clock)
        self._renewals = 0
        self._lock = threading.RLock()  # one renewal at a time; release waits for it
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ reading

    def read(self) -> dict | None:
        """The lease file's record (None: there is none); raises :class:`JobLeaseError`
        when it cannot be read."""
        return read_record(self.storage, self.url)

    def _record(self, **extra: object) -> bytes:
        assert self.incarnation is not None
        return json.dumps({"version": LEASE_VERSION, "holder": self.holder,
                           "epoch": self.incarnation.epoch, "host": HOST,
                           "machine": MACHINE, "pid": os.getpid(), "started": _STARTED,
                           "ttl_s": self.ttl_s, "renewal": self._renewals,
                           **extra}).encode()

    def _age(self) -> float:
        return self.clock() - self._valid_from

    # ------------------------------------------------------------------ holding

    @property
    def held(self) -> bool:
        """This driver holds the job now (acquired, not released, abandoned or fenced)."""
        return self._active

    def holds_validly(self) -> bool:
        """Held and within its validity: it may still write and delete."""
        return self._active and self._age() < VALID_FOR * self.ttl_s

    def alive(self) -> bool:
        """Taking the job now, or holding it validly: another lease of this process that
        finds its record refuses at once."""
        return self._taking or self.holds_validly()

    def acquire(self, renew: bool = True) -> Incarnation:
        """Take the job for a new incarnation, or raise :class:`JobLeaseError` (watching a
        live-looking lease may take up to its TTL)."""
        with self._lock:
            if self._active:
                assert self.incarnation is not None
                return self.incarnation
            if self.fenced is not None:
                raise JobLeaseError(f"{self.fenced}; start a new coordinator")
            old = watch(self.read, self.ttl_s, self.clock, self.sleep, self.job_path)
            self.incarnation = Incarnation(self._next_epoch(old), self.holder)
            self._renewals = 0
            start = self.clock()
            self._taking = True  # another lease of this process finds it alive meanwhile
            LOCAL_HOLDERS[self.holder] = self
            try:
                self._take(old)
            except BaseException:
                LOCAL_HOLDERS.pop(self.holder, None)
                self.incarnation = None  # not this driver's: a retry starts a new one
                raise
            finally:
                self._taking = False
            self._active = True
            self._valid_from = start
        if renew:  # its own stop event: a renewer of an earlier acquisition may linger
            self._stop = threading.Event()
            self._renewer = threading.Thread(target=self._renew_loop, args=(self._stop,),
                                             daemon=True, name="dstl-lease")
            self._renewer.start()
        log.info("job %s: incarnation %s", self.job_path, self.incarnation)
        return self.incarnation

    def _take(self, old: dict | None) -> None:
        """Write this holder's record over ``old`` (None: create it), or raise."""
        create = getattr(self.storage, "create_file", None)
        if old is None and create is not None:
            # where the store can create a name only if absent, two drivers starting at
            # once cannot both succeed
            if not create(self.url, self._record()):
                raise JobLeaseError(f"job directory {self.job_path} was taken by another "
                                    f"driver while this one started")
            return
        t0 = self.clock()
        self.storage.write_file(self.url, self._record())
        # two drivers that wrote at once: the last write wins; wait long enough for a
        # write as slow as ours to land before reading back
        self.sleep(max(self.settle_s, 3 * (self.clock() - t0)))
        now = self.read()
        if now is None or now.get("holder") != self.holder:
            raise JobLeaseError(f"job directory {self.job_path} was taken by another driver "
                                f"({describe(now) if now else 'its lease deleted'}) while "
                                f"this one started")

    def _next_epoch(self, old: dict | None) -> int:
        """One above the lease record's epoch, the job's epoch counter and every epoch this
        process gave out for it; the counter is written before the lease names the epoch."""
        try:
            prev = int(old.get("epoch", 0)) if old else 0
        except (TypeError, ValueError):
            raise JobLeaseError(f"job lease {self.url} holds a bad epoch "
                                f"{old.get('epoch')!r} (want a number); if no driver runs "
                                f"this job, delete the file") from None
        counted = read_epoch(self.storage, self.epoch_url)
        with _epoch_lock:
            epoch = max(prev, counted, _epoch_floor.get(self.epoch_url, 0)) + 1
            _epoch_floor[self.epoch_url] = epoch
        write_epoch(self.storage, self.epoch_url, epoch)
        return epoch

    def check(self, force: bool = False) -> None:
        """Raise :class:`JobLeaseError` unless this driver still holds the job validly.
        Called before every metadata write and delete: the lease is renewed first when its
        last renewal is older than a quarter of the TTL, or with ``force`` (the file is read
        again: before the orphan cleanup), so a driver that woke up after another one took
        over, or that could not renew in time, never writes or deletes."""
        asked = self.clock()
        if self._active and (force or self._age() > CHECK_RENEW_AT * self.ttl_s):
            with self._lock:
                # another thread's renewal that began after this call covers it
                if self._active and (self._valid_from < asked if force
                                     else self._age() > CHECK_RENEW_AT * self.ttl_s):
                    self._renew_locked()
        if self.fenced is not None:
            raise JobLeaseError(self.fenced)
        if not self._active:
            raise JobLeaseError(f"job {self.job_path}: this driver does not hold the lease")
        if not self.holds_validly():
            with self._lock:
                self._fence(f"its lease was last renewed {self._age():.1f}s ago, past its "
                            f"validity ({VALID_FOR * self.ttl_s:.1f}s)")
            raise JobLeaseError(self.fenced or "fenced")

    def _fence(self, why: str) -> bool:
        if self.fenced is None:
            self.fenced = (f"job {self.job_path}: {why}: this driver is fenced and stops "
                           f"checkpointing (another driver may hold the job now)")
            log.error("%s", self.fenced)
        self._active = False
        self._stop.set()
        return False

    def renew(self) -> bool:
        """Renew once: False (and fenced for good) if someone else holds the lease now, the
        lease vanished, or this holder is past its validity; a read error renews nothing
        and raises :class:`JobLeaseError` (validity is the limit)."""
        with self._lock:
            return self._renew_locked()

    def _renew_locked(self) -> bool:
        if not self._active:
            return False
        limit = VALID_FOR * self.ttl_s
        start = self.clock()
        if start - self._valid_from >= limit:
            return self._fence(f"it could not renew its lease within {limit:.1f}s "
                               f"(paused, or storage slow)")
        rec = self.read()
        if rec is None:
            return self._fence("its lease vanished (the job directory was deleted, or "
                               "another driver released it)")
        if rec.get("holder") != self.holder:
            return self._fence(f"taken over by driver {describe(rec)}")
        self._renewals += 1
        self.storage.write_file(self.url, self._record())
        took = self.clock() - start
        if self.clock() - self._valid_from >= limit:
            return self._fence(f"its lease renewal took {took:.1f}s and ended past its "
                               f"validity ({limit:.1f}s)")
        self._valid_from = start
        return True

    def _renew_loop(self, stop: threading.Event) -> None:
        retry = self.ttl_s / 20
        while True:
            due = self._valid_from + RENEW_AT * self.ttl_s - self.clock()
            if stop.wait(max(due, 0.0)):
                return
            try:
                with self._lock:
                    if not self._active:
                        return
                    if self._age() >= RENEW_AT * self.ttl_s and not self._renew_locked():
                        return
            except DstlError as e:  # storage trouble: try again; validity is the limit
                log.warning("cannot renew job lease %s: %s", self.url, e)
                if stop.wait(retry):
                    return

    def release(self, delete: bool = False) -> None:
        """Give the job up (a clean shutdown): the next driver need not wait for the TTL.
        The file stays as a released record; ``delete`` (a job cancelled with
        DELETE_ON_CANCELLATION leaves nothing in its directory) removes it, and the job's
        epoch counter outside the directory keeps the next incarnation's epoch growing. A
        holder past its validity touches nothing (another driver may hold the job)."""
        with self._lock:
            was = self._active and self.holds_validly()
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
        LOCAL_HOLDERS.pop(self.holder, None)
