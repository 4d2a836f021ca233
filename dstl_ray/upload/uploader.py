"""DFS uploads with a retry policy and request hedging.

Retry policy (Flink's ``dstl.dfs.upload.*`` and its ``RetryingExecutor``): each try has a
per-attempt timeout (``upload_timeout_s``, 1 s), at most ``max_attempts`` tries (3), and
``retry_delay_s`` after a failed one. Hedging (FLIP-158 "Request hedging",
:mod:`dstl_ray.upload.hedging`): when a try's attempt is still running after the hedge delay, a second
attempt of the same request starts; the first attempt to succeed wins.

Deadlines. Attempts run on a bounded thread pool, so under load an attempt may wait for a
thread. An attempt's timeout (and its hedge delay) starts when it starts running, not when it
is queued, as in Flink's RetryingExecutor: waiting for a thread is not a slow store, and
counting it made every queued attempt time out and retry, which queued more. The upload as a
whole has one deadline, ``max_attempts x (upload_timeout_s + retry_delay_s)`` from the call: an
attempt still queued when it passes (or when the upload already ended) is cancelled and never
starts, no new try starts after it, and the upload fails with :class:`StorageError`.

Names and losers. Every attempt writes its own object: the first under the requested name,
attempt k under ``NAME-a{k}.dstl``. :meth:`Uploader.write` returns the name that won: the first
attempt that succeeds while the upload is still open, a timed-out one that lands before any
other included (Flink's ``actionCompleted`` check). Every other attempt that started is
discarded when it finishes (Flink's ``discardResult``): a loser that landed late, a timed-out
attempt that lands after the upload ended, a torn partial object. Its own object is deleted,
never the winner's, on the background deleter (:mod:`dstl_ray.storage.deleter`), so closing the
uploader never drops a pending cleanup and a late loser cannot resurrect a deleted file.

Counters: uploads, attempts (all, hedges included), retries (tries after the first), hedged
(hedge attempts started), hedge_wins, failures (uploads that failed), timeouts, errors,
skipped (queued attempts that never started), late_wins (a timed-out attempt won),
losers_deleted, cleanup_failures.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import ChangelogConfig
from ..errors import StorageError
from ..format.changelog import FILE_SUFFIX
from ..observability import tracing
from ..storage.base import Storage
from ..storage.deleter import Deleter, background_deleter
from .hedging import HedgePolicy

log = logging.getLogger(__name__)


@dataclass
class UploadStats:
    uploads: int = 0
    attempts: int = 0
    retries: int = 0
    hedged: int = 0
    hedge_wins: int = 0
    failures: int = 0
    timeouts: int = 0
    errors: int = 0
    skipped: int = 0
    late_wins: int = 0
    losers_deleted: int = 0
    cleanup_failures: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def attempt_path(path: str, n: int) -> str:
    """The object name of attempt ``n`` (1-based) of an upload to ``path``."""
    if n == 1:
        return path
    if path.endswith(FILE_SUFFIX):
        return f"{path[:-len(FILE_SUFFIX)]}-a{n}{FILE_SUFFIX}"
    return f"{path}-a{n}"


class _NotStarted(Exception):
    """An attempt taken off the queue after its upload ended or its deadline passed."""


@dataclass(eq=False)
class _Attempt:
    n: int
    path: str
    try_no: int
    hedge: bool
    span: Any = None
    future: concurrent.futures.Future | None = None
    start: float | None = None  # when it started running; None while queued
    deadline: float | None = None  # start + upload_timeout_s
    finished: float | None = None
    done: bool = False
    started: bool = False
    seen: bool = False  # its end was looked at by the caller
    timed_out: bool = False
    error: BaseException | None = field(default=None)


@dataclass(eq=False)
class _Upload:
    """One :meth:`Uploader.write`, shared by the caller and its attempts (under ``cond``)."""

    path: str
    data: bytes
    deadline: float
    cond: threading.Condition = field(
        default_factory=lambda: threading.Condition(threading.RLock()))
    ended: bool = False  # the caller returned or raised: nothing more may win or start
    winner: _Attempt | None = None


class Uploader:
    """Writes whole files with retries and hedging; thread-safe, blocking (run it off the
    event loop)."""

    def __init__(self, storage: Storage, config: ChangelogConfig, max_workers: int = 32,
                 policy: HedgePolicy | None = None, deleter: Deleter | None = None) -> None:
        self.storage = storage
        self.config = config
        self.policy = policy or HedgePolicy.from_config(config)
        self.stats = UploadStats()
        self.deleter = deleter or background_deleter()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                           thread_name_prefix="dstl-upload")

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    # ------------------------------------------------------------------ attempts

    def _launch(self, up: _Upload, n: int, try_no: int, hedge: bool,
                trace: dict[str, str] | None) -> _Attempt:
        """Queue attempt ``n`` (caller holds ``up.cond``)."""
        a = _Attempt(n, attempt_path(up.path, n), try_no, hedge)
        if trace:
            a.span = tracing.start_span("dstl.dfs.attempt", trace, attempt=n, hedged=hedge,
                                        bytes=len(up.data))
        try:
            a.future = self._pool.submit(self._run, up, a)
        except RuntimeError as e:  # the pool is shut down
            tracing.end_span(a.span, error=e)
            raise StorageError(f"upload of {up.path}: the uploader is closed") from e
        self._count(attempts=1, hedged=int(hedge))
        a.future.add_done_callback(lambda f: self._attempt_done(up, a, f))
        return a

    def _run(self, up: _Upload, a: _Attempt) -> None:
        """On a pool thread: the attempt's clock starts now, unless it is too late."""
        with up.cond:
            now = time.monotonic()
            if up.ended or now >= up.deadline:
                raise _NotStarted()
            a.started, a.start = True, now
            a.deadline = now + self.config.upload_timeout_s
            up.cond.notify_all()  # the caller waits for this deadline (and the hedge's)
        self.storage.write_file(a.path, up.data)

    def _attempt_done(self, up: _Upload, a: _Attempt, f: concurrent.futures.Future) -> None:
        """An attempt finished (or was cancelled): the first success while the upload is
        open wins; any other attempt that started is discarded."""
        err = None if f.cancelled() else f.exception()
        skipped = f.cancelled() or isinstance(err, _NotStarted)
        with up.cond:
            a.done, a.finished = True, time.monotonic()
            won = not skipped and err is None and up.winner is None and not up.ended
            if won:
                up.winner = a
            elif err is not None and not skipped and a.error is None:
                a.error = err
            up.cond.notify_all()
        if skipped:
            self._count(skipped=1)
            tracing.end_span(a.span, error=TimeoutError("never started"))
            return
        if won:
            return  # the caller ends the span and counts
        if err is None:
            self.policy.record(a.finished - (a.start or a.finished))  # a true latency too
            if a.span is not None and not a.timed_out:
                tracing.end_span(a.span, won=False)
        else:
            self._count(errors=1)
            if not a.timed_out:
                tracing.end_span(a.span, error=err)
            log.warning("upload of %s, attempt %d (try %d/%d%s) failed: %s", up.path, a.n,
                        a.try_no, self.config.max_attempts, ", hedged" if a.hedge else "", err)
        self._discard(a, up.winner, landed=err is None)

    def _discard(self, a: _Attempt, winner: _Attempt | None, landed: bool) -> None:
        """Delete what a non-winning attempt left under its own name (a landed loser or a
        torn partial object), in the background."""
        storage = self.storage

        def delete() -> None:
            try:
                storage.delete(a.path)
            except Exception:
                self._count(cleanup_failures=1)
                raise  # the deleter logs it; orphan cleanup after recovery covers it
            if landed:
                self._count(losers_deleted=1)
                log.info("deleted %s, the late loser of an upload won by %s", a.path,
                         winner.path if winner else "nobody")

        if not self.deleter.submit(delete, f"{a.path} (a losing upload attempt)"):
            self._count(cleanup_failures=1)

    # ------------------------------------------------------------------ write

    def write(self, path: str, data: bytes, trace: dict[str, str] | None = None) -> str:
        """Write ``data`` as a new object; returns the name it landed under (``path``, or an
        attempt's name when a retry or hedge won). ``trace`` (a W3C carrier) parents one
        ``dstl.dfs.attempt`` span per attempt. Raises StorageError naming ``path`` and the
        cause when every try failed or the upload's deadline passed."""
        cfg = self.config
        self._count(uploads=1)
        up = _Upload(path, data, time.monotonic() + cfg.upload_deadline_s)
        attempts: list[_Attempt] = []
        tries = 0
        last: BaseException | None = None
        current: _Attempt | None = None  # the current try's first attempt
        hedge_delay: float | None = None
        hedged = False
        retry_at: float | None = None

        def new_try() -> None:
            nonlocal tries, current, hedge_delay, hedged
            tries += 1
            if tries > 1:
                self._count(retries=1)
            current = self._launch(up, len(attempts) + 1, tries, False, trace)
            attempts.append(current)
            d = self.policy.delay()
            hedge_delay = d if d is not None and d < cfg.upload_timeout_s else None
            hedged = False

        with up.cond:
            try:
                new_try()
                while up.winner is None:
                    now = time.monotonic()
                    for a in attempts:
                        if a.done and not a.seen:  # finished since we last looked
                            a.seen = True
                            if not a.started:
                                last = TimeoutError(
                                    f"attempt {a.n} was still waiting for an upload thread "
                                    f"when the upload's deadline ({cfg.upload_deadline_s:g}s "
                                    f"= max_attempts x (upload_timeout_s + retry_delay_s)) "
                                    f"passed" if now >= up.deadline else
                                    f"attempt {a.n} was cancelled before it started (the "
                                    f"uploader is closed)")
                            elif a.error is not None and not a.timed_out:
                                last = a.error
                        elif (a.started and not a.done and not a.timed_out
                              and a.deadline is not None and now >= a.deadline):
                            a.timed_out = True  # it keeps running: it may still land
                            a.error = last = TimeoutError(
                                f"attempt {a.n} timed out after {cfg.upload_timeout_s:g}s")
                            self._count(timeouts=1)
                            tracing.end_span(a.span, error=a.error)
                            log.warning("upload of %s, attempt %d (try %d/%d) timed out after "
                                        "%gs", path, a.n, a.try_no, cfg.max_attempts,
                                        cfg.upload_timeout_s)
                    if now >= up.deadline and any(
                            a.future.cancel() for a in attempts  # type: ignore[union-attr]
                            if not a.started and not a.done):
                        continue  # queued attempts never start: look at them again
                    live = [a for a in attempts if not a.done and not a.timed_out]
                    wakes: list[float] = []
                    if not live:
                        if tries >= cfg.max_attempts or now >= up.deadline:
                            self._count(failures=1)
                            hedges = len(attempts) - tries
                            raise StorageError(
                                f"upload of {path} failed after {tries} attempt(s)"
                                f"{f' and {hedges} hedge(s)' if hedges else ''}"
                                f": {type(last).__name__}: {last}")
                        if retry_at is None:
                            retry_at = now + cfg.retry_delay_s
                        if now >= retry_at:
                            retry_at = None
                            new_try()
                            continue
                        wakes.append(retry_at)
                    else:
                        assert current is not None
                        hedge_at = (current.start + hedge_delay
                                    if hedge_delay is not None and current.start is not None
                                    and not hedged and not current.done
                                    and not current.timed_out else None)
                        if hedge_at is not None and now >= hedge_at:
                            hedged = True  # one hedge per try
                            attempts.append(self._launch(up, len(attempts) + 1, tries, True,
                                                         trace))
                            continue
                        wakes += [a.deadline for a in live if a.deadline is not None]
                        if now < up.deadline and any(not a.started for a in live):
                            wakes.append(up.deadline)
                        if hedge_at is not None:
                            wakes.append(hedge_at)
                    # attempts starting or finishing notify; the timeout is for our clocks
                    up.cond.wait(max(0.0, min(wakes) - now) if wakes else 1.0)
                winner = up.winner
            finally:
                up.ended = True  # from now on a landing attempt is discarded
                for a in attempts:
                    if not a.started and not a.done and a.future is not None:
                        a.future.cancel()
        assert winner.start is not None and winner.finished is not None
        if winner.timed_out:
            self._count(late_wins=1)
            log.info("upload of %s: attempt %d landed after its timeout, before any other; "
                     "it wins", path, winner.n)
        self.policy.record(winner.finished - winner.start)
        self._count(bytes=len(data), hedge_wins=int(winner.hedge))
        if not winner.timed_out:
            tracing.end_span(winner.span, won=True)
        return winner.path

    def close(self) -> None:
        """Stop: queued attempts never start; running ones finish, losers are still deleted
        (by the background deleter)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
