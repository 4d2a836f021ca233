"""The job lease's record, how another driver judges it, and what one process knows of its own
holders (docs/architecture.md "Many jobs, one tree"; the holder is
:mod:`dstl_ray.checkpoint.lease`, the epoch claims :mod:`dstl_ray.checkpoint.lease_epochs`).

No decision here compares two hosts' clocks, as in Chubby's and ZooKeeper's sessions:

* A record carries no time. Every renewal rewrites it with a higher ``renewal`` counter, so
  a live holder's record keeps changing. An observer measures its age on its *own* monotonic
  clock: it treats the lease as expired only after it has seen the same :class:`View` (the
  record and the newest epoch claim) unchanged for a full TTL (:func:`watch`). A view that
  changes while watched belongs to a live holder or to another driver taking the job: the
  observer is refused (:class:`JobLeaseError` naming the holder).
* The job belongs to the holder of the newest claimed epoch (:func:`owner`). It can be taken
  at once only when that holder says so or is known dead (:func:`known_dead`): released by a
  clean shutdown (its record or its claim says so); on this machine (same host, boot and pid
  namespace) and its process gone, or its pid now another process (start times differ); in
  this very process and fenced, released, abandoned, or silent for a full TTL. A released
  record of an *older* epoch (a late release of a driver taken over since) is not enough:
  the newest claim's holder is watched.
* One process takes a job through one lease at a time (:func:`taking`): a second lease of
  the process asking for the same job meanwhile is refused at once.
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from ..errors import JobLeaseError, StorageError
from ..process_identity import MACHINE, ProcessId
from ..storage.base import Storage
from .lease_epochs import Claim

LEASE_FILE = "_lease"
LEASE_VERSION = 3  # 3: epochs claimed in {base}/_epochs/{job}/; 2: one counter file
WATCH_POLLS = 10  # an observer reads a watched record this many times per TTL


class LocalHolder(Protocol):
    def alive(self) -> bool:
        """Taking the job now, or holding it within its own validity (it may still write
        and delete)."""

    def gone(self) -> bool:
        """It can never act again: fenced, released, abandoned, or silent for a full TTL.
        Neither alive nor gone (past its validity, not yet fenced: a step that passed its
        check may still be landing): watched like any other holder."""


# holders of this process by holder id: a record naming one that is gone (or whose lease
# object is gone) is known dead; weak values, so a dropped lease object counts as gone
LOCAL_HOLDERS: weakref.WeakValueDictionary[str, LocalHolder] = weakref.WeakValueDictionary()
_TAKING: dict[str, str] = {}  # lease URL -> the holder of this process taking it now
_TAKING_LOCK = threading.Lock()


@contextmanager
def taking(url: str, holder: str, where: str) -> Iterator[None]:
    """``holder`` watches and takes the job of lease ``url``: no other lease of this process
    does meanwhile (it is refused at once, as it would be once the first one holds)."""
    with _TAKING_LOCK:
        other = _TAKING.get(url)
        if other is not None and other != holder:
            raise JobLeaseError(f"job directory {where} is being taken by another driver "
                                f"(holder {other}, in this process): stop that job before "
                                f"starting it again, or use another job id")
        _TAKING[url] = holder
    try:
        yield
    finally:
        with _TAKING_LOCK:
            if _TAKING.get(url) == holder:
                del _TAKING[url]


@dataclass(frozen=True)
class View:
    """What an observer reads of a job's lease: the record (None: no file) and the newest
    epoch claim (None: none, e.g. a job of a version before claims)."""

    record: dict | None
    claim: Claim | None


def record_epoch(rec: dict) -> int:
    """The epoch a record names; a bad one raises :class:`JobLeaseError`."""
    try:
        return int(rec.get("epoch", 0))
    except (TypeError, ValueError):
        raise JobLeaseError(f"job lease holds a bad epoch {rec.get('epoch')!r} (want a "
                            f"number); if no driver runs this job, delete the file") from None


def owner(view: View) -> dict | None:
    """The holder the job belongs to: the newest claim's (released if its claim or its own
    record says so), or the record's where it names a newer epoch than every claim (written
    by a version before claims). None: nobody ever held it."""
    rec, claim = view.record, view.claim
    if claim is None or (rec is not None and record_epoch(rec) > claim.epoch):
        return rec
    own = dict(claim.record)
    if (rec is not None and rec.get("released") and rec.get("holder") == own.get("holder")
            and record_epoch(rec) == claim.epoch):
        own["released"] = True
    return own


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
    """The holder ``rec`` names is a lease object of this process that is taking the job or
    holds it validly: refuse at once (nothing to watch)."""
    if rec.get("released") or not _local(rec):
        return False
    other = LOCAL_HOLDERS.get(str(rec.get("holder")))
    return other is not None and other.alive()


def known_dead(rec: dict) -> bool:
    """The holder ``rec`` names (a record or a claim) is released or known to be gone."""
    if rec.get("released"):
        return True
    if rec.get("machine") != MACHINE:
        return False  # another machine's pid says nothing here: watch the record
    if _local(rec):
        other = LOCAL_HOLDERS.get(str(rec.get("holder")))
        return other is None or other.gone()
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


def watch(read: Callable[[], View], own_ttl_s: float, clock: Callable[[], float],
          sleep: Callable[[float], None], where: str) -> View:
    """Observe a job's lease until it may be taken; returns the view to replace, or raises
    :class:`JobLeaseError` naming a live holder.

    A view whose :func:`owner` is not known dead is read again every TTL/``WATCH_POLLS``: if
    it changed (renewed, taken or being taken by a third driver), its holder is alive; if the
    observer saw it unchanged for a full TTL, measured on ``clock`` (this process's monotonic
    clock) from the end of the first read that returned it, its holder stopped renewing and
    has fenced itself (a holder counts a renewal only if its write returned within 0.8 TTL of
    the previous one's start, and acts for half a TTL from a write's start)."""
    view = read()
    seen = clock()
    while True:
        own = owner(view)
        if own is None or known_dead(own):
            return view
        if known_alive(own):
            raise JobLeaseError(f"job directory {where} is held by another live driver "
                                f"({describe(own)}, in this process): stop that job before "
                                f"starting it again, or use another job id")
        ttl = record_ttl(own, own_ttl_s)
        left = ttl - (clock() - seen)
        if left <= 0:
            return view  # unchanged for a full TTL: its holder has fenced itself
        sleep(min(left, ttl / WATCH_POLLS))
        now = read()
        if now != view:
            new = owner(now)
            if new is not None and not known_dead(new):
                raise JobLeaseError(
                    f"job directory {where} is held by another live driver ({describe(new)}, "
                    f"renewed while this driver watched, or taken; ttl {new.get('ttl_s')}s): "
                    f"stop that job (or wait until it stops renewing) before starting it "
                    f"again, or use another job id")
            view = now
