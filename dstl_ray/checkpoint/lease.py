"""One live driver per job: a lease file in the job directory, and the job's incarnation.

Two drivers coordinating the same job id would each write ``chk-n/_metadata`` and each run
the orphan cleanup of FLIP-158 "Cleanup after recovery", which deletes every file that no
checkpoint *it* retains names: the second driver would delete the first one's in-flight
changelog and state files. Flink avoids this with leader election of its JobMaster; dstl-ray
has no cluster service of its own, so the coordinator holds a lease, ``{job}/_lease``, renewed
in the background, and each incarnation claims its epoch in a file created only if absent
(:mod:`~dstl_ray.checkpoint.lease_epochs`). Chubby's and ZooKeeper's sessions are the models;
no decision compares two hosts' clocks (docs/architecture.md "Many jobs, one tree"):

* ``acquire`` takes the job at once when nobody ever held it or the newest epoch's holder is
  released or known dead; otherwise it watches the lease
  (:func:`~dstl_ray.checkpoint.lease_record.watch`): changed within its TTL refuses with
  :class:`JobLeaseError` naming the holder, unchanged for a full TTL on this process's
  monotonic clock is taken over. It then claims the next epoch (one above the newest claim):
  of two drivers deciding at once only one creates that claim, the other is refused.
* The holder judges its own validity on its own monotonic clock: it acts for half its TTL
  from the start of its last successful renewal write. A renewal counts if it found no newer
  claim and no newer record, and its write returned within 0.8 TTL of the previous renewal
  write's start: an observer's final read of the previous record comes at least a full TTL
  after that start, so it sees the new one. A renewal later than that fences the holder for
  good (it cannot know whether someone took over), and so does a newer claim or record. A
  record of an older epoch, or none (a late write or delete of a driver taken over since),
  is written over: the higher epoch wins.
* :meth:`JobLease.check`, called before every ``_metadata`` write and every delete (the
  background deleter's included), renews first when the last renewal is older than a
  quarter of the TTL (or past its validity), refuses once fenced, and checks the fencing
  token: claim ``epoch + 1`` absent. An observer takes over no earlier than a full TTL after
  the holder's last renewal write began, so a step that passed ``check`` has at least half
  a TTL to land first.

Every acquisition starts a new **incarnation** of the job, ``{epoch}-{holder}``, its epoch
claimed in storage (never the wall clock). Node actors keep a job's state (batching
knowledge, merged changelog files, the subsumed watermark) per incarnation and start clean
when a newer one appears, so a job id reused after DELETE_ON_CANCELLATION never has its new
files freed with the old run's knowledge (docs/architecture.md "Many jobs, one tree").
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
from ..storage.base import Storage, join, normalize_url
from ..storage.registry import get_storage
from ..transport.sender import Incarnation
from .lease_epochs import EpochClaims, default_epochs_url
from .lease_record import (
    LEASE_FILE,
    LEASE_VERSION,
    LOCAL_HOLDERS,
    View,
    describe,
    read_record,
    record_epoch,
    taking,
    watch,
)

__all__ = ["LEASE_FILE", "Incarnation", "JobLease"]

log = logging.getLogger(__name__)

RENEW_AT = 0.2  # the background renewer renews when the last renewal is this old (x TTL)
CHECK_RENEW_AT = 0.25  # check() renews synchronously past this age (x TTL)
VALID_FOR = 0.5  # the holder acts until this long after its last renewal write began (x TTL)
RENEW_BY = 0.8  # a renewal counts if its write returned within this of the last one's start
# the previous version of the lease took a record whose wall-clock ``renewed_at`` was more
# than its TTL behind its own clock as dead; this is no time but a marker far in the future,
# so such a driver never takes a live job of this version (it watches nothing, it refuses)
OLD_DRIVERS_REFUSE = 1e300

_STARTED = start_time(os.getpid())


class JobLease:
    """The lease of one job held by one coordinator (see the module docstring). ``clock``
    is this process's monotonic clock (injected by tests, with ``sleep``); ``epochs_url`` is
    the job's claims directory (default ``{base}/_epochs/{job}`` from ``job_path``)."""

    def __init__(self, job_path: str, *, ttl_s: float = 30.0, settle_s: float = 0.05,
                 storage: Storage | None = None, epochs_url: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not ttl_s > 0:
            raise DstlError(f"lease ttl_s must be > 0, got {ttl_s!r}")
        self.job_path = job_path
        self.url = join(job_path, LEASE_FILE)
        self.ttl_s = float(ttl_s)
        self.storage = storage or get_storage(job_path)
        self.claims = EpochClaims(self.storage, epochs_url or default_epochs_url(job_path),
                                  settle_s=settle_s, clock=clock, sleep=sleep)
        self.clock = clock
        self.sleep = sleep
        self.holder = uuid.uuid4().hex[:16]
        self.incarnation: Incarnation | None = None
        self.fenced: str | None = None  # why this holder lost the job (for good)
        self._active = False
        self._taking = False
        self._valid_from = 0.0  # start of the last successful renewal write (self.clock)
        self._renewals = 0
        self._lock = threading.RLock()  # one renewal at a time; release waits for it
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ reading

    def read(self) -> dict | None:
        """The lease file's record (None: there is none); raises :class:`JobLeaseError`
        when it cannot be read."""
        return read_record(self.storage, self.url)

    def view(self) -> View:
        """What an observer judges: the record and the newest epoch claim."""
        return View(self.read(), self.claims.newest())

    def _holder_fields(self) -> dict:
        assert self.incarnation is not None
        return {"holder": self.holder, "epoch": self.incarnation.epoch, "host": HOST,
                "machine": MACHINE, "pid": os.getpid(), "started": _STARTED,
                "ttl_s": self.ttl_s}

    def _record(self, **extra: object) -> bytes:
        return json.dumps({"version": LEASE_VERSION, **self._holder_fields(),
                           "renewal": self._renewals, "renewed_at": OLD_DRIVERS_REFUSE,
                           **extra}).encode()

    def _age(self) -> float:
        return self.clock() - self._valid_from

    # ------------------------------------------------------------------ holding

    @property
    def epoch(self) -> int:
        """This holder's incarnation epoch; :class:`JobLeaseError` before it took the job."""
        if self.incarnation is None:
            raise JobLeaseError(f"job {self.job_path}: this driver never took the job")
        return self.incarnation.epoch

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

    def gone(self) -> bool:
        """It can never act again (fenced, released, abandoned, or silent for a full TTL):
        another lease of this process may take the job at once."""
        return not self._taking and (not self._active or self._age() >= self.ttl_s)

    def acquire(self, renew: bool = True) -> Incarnation:
        """Take the job for a new incarnation, or raise :class:`JobLeaseError` (watching a
        live-looking lease may take up to its TTL)."""
        with self._lock:
            if self._active:
                assert self.incarnation is not None
                return self.incarnation
            if self.fenced is not None:
                raise JobLeaseError(f"{self.fenced}; start a new coordinator")
            with taking(normalize_url(self.url), self.holder, self.job_path):
                old = watch(self.view, self.ttl_s, self.clock, self.sleep, self.job_path)
                self.incarnation = Incarnation(self._next_epoch(old), self.holder)
                self._renewals = 0
                self._taking = True  # another lease of this process finds it alive meanwhile
                LOCAL_HOLDERS[self.holder] = self
                try:
                    self._take()
                except BaseException:
                    LOCAL_HOLDERS.pop(self.holder, None)
                    self.incarnation = None  # not this driver's: a retry starts a new one
                    raise
                finally:
                    self._taking = False  # after _active: never a moment not alive
        if renew:  # its own stop event: a renewer of an earlier acquisition may linger
            self._stop = threading.Event()
            self._renewer = threading.Thread(target=self._renew_loop, args=(self._stop,),
                                             daemon=True, name="dstl-lease")
            self._renewer.start()
        log.info("job %s: incarnation %s", self.job_path, self.incarnation)
        return self.incarnation

    def _take(self) -> None:
        """Claim this incarnation's epoch, then write this holder's record, or raise."""
        assert self.incarnation is not None
        epoch = self.incarnation.epoch
        if not self.claims.claim(epoch, self._holder_fields()):
            raise JobLeaseError(f"job directory {self.job_path} was taken by another driver "
                                f"while this one started (it claimed epoch {epoch} first)")
        try:
            start = self.clock()
            self.storage.write_file(self.url, self._record())
        except BaseException:
            self._release_claim()  # a failed take leaves no live-looking claim behind
            raise
        self._valid_from = start
        self._active = True

    def _next_epoch(self, old: View) -> int:
        """One above the newest claim, the record's epoch and the previous version's counter.
        Nothing else (no number this process remembers): two drivers that decide at once
        must compute the same epoch, so that only one can claim it."""
        return max(old.claim.epoch if old.claim else 0,
                   record_epoch(old.record) if old.record else 0, self.claims.floor()) + 1
    def check(self, force: bool = False) -> None:
        """Raise :class:`JobLeaseError` unless this driver still holds the job validly.
        Called before every metadata write and delete: the lease is renewed first when its
        last renewal is older than a quarter of the TTL or past its validity, or with
        ``force`` (the file is read again: before the orphan cleanup); then the fencing
        token is checked (no newer epoch claimed: one existence check), so a driver that
        woke up after another one took over, or that could not renew in time, never writes
        or deletes."""
        asked = self.clock()
        renewed = False
        if self._active and (force or self._age() > CHECK_RENEW_AT * self.ttl_s):
            with self._lock:
                # another thread's renewal that began after this call covers it
                if self._active and (self._valid_from < asked if force
                                     else self._age() > CHECK_RENEW_AT * self.ttl_s):
                    renewed = self._renew_locked()
        for _ in range(2):  # a renewal that ended late but in time: once more, from now
            if not self._active or self.holds_validly():
                break
            with self._lock:
                if self._active and not self.holds_validly():
                    renewed = self._renew_locked()
        if self.fenced is not None:
            raise JobLeaseError(self.fenced)
        if not self._active:
            raise JobLeaseError(f"job {self.job_path}: this driver does not hold the lease")
        if not self.holds_validly():
            raise JobLeaseError(f"job {self.job_path}: its lease renewals are too slow to "
                                f"act on ({self._age():.1f}s since the last one began)")
        if not renewed:
            self._check_token()

    def _check_token(self) -> None:
        """The fencing token: fenced for good when a newer epoch was claimed."""
        assert self.incarnation is not None
        why = self.claims.superseded(self.incarnation.epoch, self.holder)
        if why is not None:
            with self._lock:
                self._fence(f"taken over: {why}")
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
        """Renew once: False (and fenced for good) if someone else holds the job now or this
        holder could not renew in time; a read error renews nothing and raises
        :class:`JobLeaseError` (the renewal deadline is the limit)."""
        with self._lock:
            return self._renew_locked()

    def _renew_locked(self) -> bool:
        if not self._active:
            return False
        assert self.incarnation is not None
        epoch = self.incarnation.epoch
        deadline = self._valid_from + RENEW_BY * self.ttl_s
        if self.clock() >= deadline:
            return self._fence(f"it could not renew its lease within "
                               f"{RENEW_BY * self.ttl_s:.1f}s (paused, or storage slow)")
        why = self.claims.superseded(epoch, self.holder)
        if why is not None:
            return self._fence(f"taken over: {why}")
        rec = self.read()
        if rec is not None and rec.get("holder") != self.holder:
            try:
                newer = record_epoch(rec) >= epoch
            except JobLeaseError:
                newer = True  # on doubt: never write over it
            if newer:
                return self._fence(f"taken over by driver {describe(rec)}")
            log.warning("job %s: its lease held a record of an earlier incarnation (%s), "
                        "a late write: written over (the newer epoch holds the job)",
                        self.job_path, describe(rec))
        elif rec is None:
            log.warning("job %s: its lease vanished (a late delete, or the job directory "
                        "was deleted); no newer epoch is claimed: written again",
                        self.job_path)
        self._renewals += 1
        start = self.clock()
        self.storage.write_file(self.url, self._record())
        took = self.clock() - start
        if self.clock() >= deadline:
            return self._fence(f"its lease renewal took {took:.1f}s and ended past its "
                               f"deadline ({RENEW_BY * self.ttl_s:.1f}s after the last "
                               f"renewal began)")
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
            except DstlError as e:  # storage trouble: try again until the renewal deadline
                log.warning("cannot renew job lease %s: %s", self.url, e)
                if stop.wait(retry):
                    return

    def release(self, delete: bool = False) -> None:
        """Give the job up (a clean shutdown): the next driver need not wait for the TTL.
        The record stays, marked released, and so does the epoch claim; ``delete`` (a job
        cancelled with DELETE_ON_CANCELLATION leaves nothing in its directory) removes the
        record, and the claim outside the directory says released and keeps the next
        incarnation's epoch growing. A holder that may no longer act (fenced, past its
        validity, a newer epoch claimed) touches nothing: another driver may hold the job."""
        with self._lock:
            try:
                self.check()
                was = True
            except DstlError:
                was = False
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
            self._release_claim()

    def _release_claim(self) -> None:
        try:
            assert self.incarnation is not None
            self.claims.release(self.incarnation.epoch, self._holder_fields())
        except DstlError as e:  # the next driver watches the lease for a TTL instead
            log.warning("cannot mark epoch claim of job %s released: %s", self.job_path, e)

    def abandon(self) -> None:
        """Stop holding without touching the file, as a crashed driver would (tests and
        the chaos harness simulate a driver's death with it)."""
        self._active = False
        self._stop.set()
        LOCAL_HOLDERS.pop(self.holder, None)
