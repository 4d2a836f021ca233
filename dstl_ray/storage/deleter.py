"""Background deletes: file deletes off the caller's thread and off every lock.

A delete on an object store takes a round trip (tens of ms, seconds when S3 throttles). Deletes
are decided in places that must not wait: under a backend's lock (a materialization unpins the
files it replaced), on a client's single delivery thread (a persist completion pins new files
and frees old ones), in an upload's completion. They are handed to a :class:`Deleter`, whose
few threads run them. Deletes are best effort: a failure is logged and counted, and a delete
that is lost (a failure, a full queue, the process exiting) leaves an orphan that the cleanup
after recovery removes (FLIP-158 "Cleanup after recovery"). Only what is decided dead is ever
handed over, so running a delete late never loses a file anybody still names.

A delete may carry a ``guard``, the check of the fencing token it was decided under (a
coordinator's job lease, :meth:`dstl_ray.checkpoint.lease.JobLease.check`): it runs right
before the delete, which is skipped (counted as ``fenced``) when the guard raises. A driver
fenced after deciding a delete therefore never runs it late, when another driver may hold the
job and name the file again; the file is left to that driver's orphan cleanup.

The queue is bounded (``max_pending``): when it is full, deletes are dropped (counted and
logged), never waited for. :meth:`Deleter.flush` waits for everything handed over so far
(and what that hands over while it runs: a subsumed checkpoint's discard releases its files),
for close paths that must leave nothing behind (a backend's ``close``, a coordinator's
``shutdown``) and for tests.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_PENDING = 10_000
WORKERS = 4


@dataclass
class DeleterStats:
    submitted: int = 0
    deleted: int = 0  # deletes that ran without an error
    failed: int = 0  # deletes that raised (logged)
    dropped: int = 0  # deletes not queued: the queue was full
    fenced: int = 0  # deletes skipped: their guard refused (the deciding driver is fenced)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Deleter:
    """Runs deletes on ``workers`` daemon threads (started on first use); ``workers=0`` runs
    each delete in the caller (for unit tests of pure logic that want them synchronous)."""

    def __init__(self, workers: int = WORKERS, max_pending: int = MAX_PENDING,
                 name: str = "dstl-delete") -> None:
        if workers < 0 or max_pending < 1:
            raise ValueError("workers must be >= 0 and max_pending >= 1")
        self.workers = workers
        self.max_pending = max_pending
        self.name = name
        self.stats = DeleterStats()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._queue: collections.deque[
            tuple[int, Callable[[], Any], str, Callable[[], Any] | None]] = collections.deque()
        self._unfinished: set[int] = set()  # tickets queued or running
        # a delete handed over while another one runs (a checkpoint's discard releasing its
        # files) is part of it: ticket -> the ticket handed over from outside it came from
        self._root: dict[int, int] = {}
        self._running = threading.local()  # the ticket this thread runs now
        self._seq = 0
        self._threads: list[threading.Thread] = []

    def _check_fork(self) -> None:
        """In a forked child (a Spark Python worker forked from its daemon) the parent's
        threads are gone, and so is what they had queued: start afresh."""
        if self._pid != os.getpid():
            self._reset()

    def submit(self, delete: Callable[[], Any], what: str,
               guard: Callable[[], Any] | None = None) -> bool:
        """Run ``delete()`` (which deletes ``what``, named in logs) in the background, after
        ``guard()`` (if given) returned without raising; False if it was dropped because the
        queue is full."""
        self._check_fork()
        parent = getattr(self._running, "ticket", None)
        with self._cond:
            self.stats.submitted += 1
            if self.workers == 0:
                ticket = self._new_ticket(parent)
            elif len(self._queue) >= self.max_pending:
                self.stats.dropped += 1
                dropped = self.stats.dropped
                ticket = 0
            else:
                ticket = self._new_ticket(parent)
                self._queue.append((ticket, delete, what, guard))
                if len(self._threads) < self.workers:
                    t = threading.Thread(target=self._work, daemon=True,
                                         name=f"{self.name}-{len(self._threads)}")
                    self._threads.append(t)
                    t.start()
                self._cond.notify()
                return True
        if ticket == 0:
            log.warning("delete of %s dropped: %d deletes are queued already (%d dropped so "
                        "far; orphan cleanup after recovery removes the file)", what,
                        self.max_pending, dropped)
            return False
        self._run(ticket, delete, what, guard)  # workers == 0: inline
        return True

    def _new_ticket(self, parent: int | None) -> int:
        """A ticket for a delete handed over (with ``_cond`` held), counted unfinished, part
        of ``parent``'s root when handed over by the running delete ``parent``."""
        self._seq += 1
        ticket = self._seq
        self._unfinished.add(ticket)
        self._root[ticket] = self._root.get(parent, ticket) if parent else ticket
        return ticket

    def delete(self, storage: Any, url: str) -> bool:
        """Delete ``url`` through ``storage`` in the background."""
        return self.submit(lambda: storage.delete(url), url)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                ticket, fn, what, guard = self._queue.popleft()
            self._run(ticket, fn, what, guard)

    def _run(self, ticket: int, fn: Callable[[], Any], what: str,
             guard: Callable[[], Any] | None) -> None:
        outcome = "deleted"
        outer, self._running.ticket = getattr(self._running, "ticket", None), ticket
        try:
            if guard is not None:
                try:
                    guard()
                except Exception as e:  # noqa: BLE001 - any doubt: do not delete
                    outcome = "fenced"
                    self._log_fenced(what, e)
            if outcome == "deleted":
                fn()
        except Exception as e:  # noqa: BLE001 - best effort: orphan cleanup covers it
            outcome = "failed"
            log.warning("cannot delete %s: %s: %s", what, type(e).__name__, e)
        finally:
            self._running.ticket = outer
        with self._cond:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            self._unfinished.discard(ticket)
            self._root.pop(ticket, None)
            self._cond.notify_all()

    def _log_fenced(self, what: str, e: Exception) -> None:
        """The first skipped delete is a warning, later ones (a fenced driver's whole queue)
        are debug lines."""
        level = logging.WARNING if self.stats.fenced == 0 else logging.DEBUG
        log.log(level, "not deleting %s: the driver that decided it may no longer delete "
                "(%s: %s); orphan cleanup after recovery removes it", what, type(e).__name__, e)

    @property
    def pending(self) -> int:
        """Deletes queued or running."""
        with self._cond:
            return len(self._unfinished)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every delete handed over before this call ran, with the deletes they
        handed over while running; False on timeout."""
        self._check_fork()
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._seq
            while any(self._root.get(t, t) <= target for t in self._unfinished):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True


_default: Deleter | None = None
_default_lock = threading.Lock()


def background_deleter() -> Deleter:
    """This process's deleter (its threads start on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Deleter()
        return _default


def flush_deletes(timeout: float | None = 60.0) -> bool:
    """Wait for the deletes this process handed to its background deleter so far."""
    return background_deleter().flush(timeout)
