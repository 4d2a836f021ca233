"""The job lease's record, how another driver judges it, and the job's epoch counter
(docs/architecture.md "Many jobs, one tree"; the holder is :mod:`dstl_ray.checkpoint.lease`).

No decision here compares two hosts' clocks, as in Chubby's and ZooKeeper's sessions:

* A record carries no time. Every renewal rewrites it with a higher ``renewal`` counter, so
  a live holder's record keeps changing. An observer measures a record's age on its *own*
  monotonic clock: it treats the lease as expired only after it has seen the same record
  unchanged for a full TTL (:func:`watch`). A record that changes while watched belongs to a
  live holder: the observer is refused (:class:`JobLeaseError` naming the holder).
* A record can be taken at once when it says so or when its holder is known dead
  (:func:`known_dead`): released by a clean shutdown; on this machine (same host, boot and
  pid namespace) and its process gone, or its pid now another process (start times differ);
  in this very process and no longer holding (shut down, abandoned, fenced, or past its own
  validity: it can never act again).
* Epochs are counters in storage: the lease record's epoch and a per-job counter kept under
  the base path, outside the job directory (``{base}/_epochs/{job}.epoch``), so they keep
  growing after DELETE_ON_CANCELLATION deleted the lease and after the user deleted the
  whole job directory. Node actors order a job's incarnations by them
  (:mod:`dstl_ray.node.jobs`), so a restart is never refused as stale because of a clock.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import DstlError, JobLeaseError, StorageError
from ..process_identity import MACHINE, ProcessId
from ..storage.base import Storage, join

LEASE_FILE = "_lease"
LEASE_VERSION = 2
EPOCHS_DIR = "_epochs"  # under the base path: {base}/_epochs/{job}.epoch
WATCH_POLLS = 10  # an observer reads a watched record this many times per TTL


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


class LocalHolder(Protocol):
    def alive(self) -> bool:
        """Taking the job now, or holding it within its own validity (it may still write
        and delete)."""


# holders of this process by holder id: a record naming one that no longer holds validly
# (or is gone) is known dead; weak values, so a dropped lease object counts as gone
LOCAL_HOLDERS: weakref.WeakValueDictionary[str, LocalHolder] = weakref.WeakValueDictionary()
def read_record(storage: Storage, url: str) -> dict | None:
    """The lease file's record, or None when there is none. A file that cannot be read or
    parsed raises :class:`JobLeaseError`: never take or give up a job on doubt."""
    try:
        if not storage.exists(url):
            return None
        rec = json.loads(storage.read_file(url))
    except (StorageError, ValueError) as e:
        raise JobLeaseError(f"cannot read the job lease {url} ({e}); if no driver runs this "
                            f"job, delete the file") from e
    if not isinstance(rec, dict):
        raise JobLeaseError(f"job lease {url} holds no JSON object; if no driver runs this "
                            f"job, delete the file")
    return rec


def describe(rec: dict) -> str:
    """The holder a record names, for error messages."""
    return (f"holder {rec.get('holder')} on host {rec.get('host')}, pid {rec.get('pid')}, "
            f"epoch {rec.get('epoch')}")


def _local(rec: dict) -> bool:
    return rec.get("machine") == MACHINE and rec.get("pid") == os.getpid()


def known_alive(rec: dict) -> bool:
    """The record's holder is a lease object of this process that is taking the job or
    holds it validly: refuse at once (nothing to watch)."""
    if rec.get("released") or not _local(rec):
        return False
    other = LOCAL_HOLDERS.get(str(rec.get("holder")))
    return other is not None and other.alive()


def known_dead(rec: dict) -> bool:
    """The record may be taken at once: released, or its holder is known to be gone."""
    if rec.get("released"):
        return True
    if rec.get("machine") != MACHINE:
        return False  # another machine's pid says nothing here: watch the record
    if _local(rec):
        return not known_alive(rec)
    try:
        pid = int(rec.get("pid", -1))
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    started = rec.get("started")
    # gone, a zombie, or the pid now names a later process (reused)
    return ProcessId(MACHINE, pid, started if isinstance(started, int) else None).dead()


def record_ttl(rec: dict, own_ttl_s: float) -> float:
    """How long an observer watches ``rec``: the TTL its holder promised (the observer's
    own where the record names none)."""
    try:
        ttl = float(rec.get("ttl_s", 0))
    except (TypeError, ValueError):
        ttl = 0.0
    return ttl if 0 < ttl < math.inf else own_ttl_s


def watch(read: Callable[[], dict | None], own_ttl_s: float, clock: Callable[[], float],
          sleep: Callable[[float], None], where: str) -> dict | None:
    """Observe a job's lease until it may be taken; returns the record to replace (None:
    there is none), or raises :class:`JobLeaseError` naming a live holder.

    A live-looking record is read again every TTL/``WATCH_POLLS``: if it changed (renewed,
    or taken by a third driver), its holder is alive; if the observer saw it unchanged for
    a full TTL, measured on ``clock`` (this process's monotonic clock) from the end of the
    first read that returned it, its holder stopped renewing and has fenced itself (the
    holder's validity is half its TTL, counted from before its renewal was written)."""
    rec = read()
    seen = clock()
    while True:
        if rec is None or known_dead(rec):
            return rec
        if known_alive(rec):
            raise JobLeaseError(f"job directory {where} is held by another live driver "
                                f"({describe(rec)}, in this process): stop that job before "
                                f"starting it again, or use another job id")
        ttl = record_ttl(rec, own_ttl_s)
        left = ttl - (clock() - seen)
        if left <= 0:
            return rec  # unchanged for a full TTL: its holder has fenced itself
        sleep(min(left, ttl / WATCH_POLLS))
        now = read()
        if now != rec and now is not None and not known_dead(now):
            raise JobLeaseError(
                f"job directory {where} is held by another live driver ({describe(now)}, "
                f"renewed while this driver watched; ttl {now.get('ttl_s')}s): stop that job "
                f"(or wait until it stops renewing) before starting it again, or use another "
                f"job id")
        rec = now if now != rec else rec


def default_epoch_url(job_path: str) -> str:
    """``{base}/_epochs/{job}.epoch`` for a job directory ``{base}/{job}`` (a coordinator
    passes its own base path: job ids may hold ``/``)."""
    base, _, job = job_path.rstrip("/").rpartition("/")
    return join(base, EPOCHS_DIR, f"{job}.epoch")


def read_epoch(storage: Storage, url: str) -> int:
    """The job's epoch counter (0 when there is none). One that cannot be read raises: a
    new incarnation must be above every earlier one."""
    try:
        if not storage.exists(url):
            return 0
        text = storage.read_file(url).decode()
        epoch = int(text.strip())
    except (StorageError, ValueError, UnicodeDecodeError) as e:
        raise JobLeaseError(f"cannot read the job's epoch counter {url} ({e}); write a "
                            f"number above every epoch the job ran with into it") from e
    if epoch < 0:
        raise JobLeaseError(f"job epoch counter {url} holds {epoch}, want a number >= 0")
    return epoch


def write_epoch(storage: Storage, url: str, epoch: int) -> None:
    storage.write_file(url, f"{epoch}\n".encode())
