"""DFS uploads with a retry policy and request hedging.

Retry policy (Flink's ``dstl.dfs.upload.*``): each try has a per-attempt timeout
(``upload_timeout_s``, 1 s), at most ``max_attempts`` tries (3), and ``retry_delay_s`` after a
failed one. Hedging (FLIP-158 "Request hedging", :mod:`dstl_ray.hedging`): when a try's attempt
is still running after the hedge delay, a second attempt of the same request starts; the first
attempt to succeed wins.

Every attempt writes its own object: the first under the requested name, attempt k under
``NAME-a{k}.dstl``. :meth:`Uploader.write` returns the name that won. Every other attempt is
cleaned up when it finishes: a loser that landed late, a timed-out attempt that landed after
all, a torn partial object. Its object is deleted, never the winner's, so nothing stray is left
behind and a late loser can never resurrect a file that was deleted meanwhile.

Counters: uploads, attempts (all, hedges included), retries (tries after the first), hedged
(hedge attempts started), hedge_wins, failures (uploads that failed), losers_deleted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import tracing
from .config import ChangelogConfig
from .errors import StorageError
from .format import FILE_SUFFIX
from .hedging import HedgePolicy
from .storage import Storage

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


@dataclass(eq=False)
class _Attempt:
    n: int
    path: str
    future: concurrent.futures.Future
    start: float
    deadline: float
    hedge: bool
    span: Any = None
    error: BaseException | None = field(default=None)


class Uploader:
    """Writes whole files with retries and hedging; thread-safe, blocking (run it off the
    event loop)."""

    def __init__(self, storage: Storage, config: ChangelogConfig, max_workers: int = 32,
                 policy: HedgePolicy | None = None) -> None:
        self.storage = storage
        self.config = config
        self.policy = policy or HedgePolicy.from_config(config)
        self.stats = UploadStats()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                           thread_name_prefix="dstl-upload")

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _launch(self, path: str, data: bytes, n: int, hedge: bool,
                trace: dict[str, str] | None) -> _Attempt:
        span = tracing.start_span("dstl.dfs.attempt", trace, attempt=n, hedged=hedge,
                                  bytes=len(data)) if trace else None
        now = time.monotonic()
        fut = self._pool.submit(self.storage.write_file, attempt_path(path, n), data)
        self._count(attempts=1, hedged=int(hedge))
        return _Attempt(n, attempt_path(path, n), fut, now, now + self.config.upload_timeout_s,
                        hedge, span)

    def write(self, path: str, data: bytes, trace: dict[str, str] | None = None) -> str:
        """Write ``data`` as a new object; returns the name it landed under (``path``, or an
        attempt's name when a retry or hedge won). ``trace`` (a W3C carrier) parents one
        ``dstl.dfs.attempt`` span per attempt. Raises StorageError naming ``path`` and the
        cause when every try failed."""
        cfg = self.config
        self._count(uploads=1)
        attempts: list[_Attempt] = []
        live: list[_Attempt] = []
        tries = 0
        winner: _Attempt | None = None
        last: BaseException | None = None
        hedge_at: float | None = None

        def new_try() -> None:
            nonlocal tries, hedge_at
            tries += 1
            if tries > 1:
                self._count(retries=1)
            a = self._launch(path, data, len(attempts) + 1, False, trace)
            attempts.append(a)
            live.append(a)
            d = self.policy.delay()
            hedge_at = a.start + d if d is not None and d < cfg.upload_timeout_s else None

        new_try()
        try:
            while winner is None:
                now = time.monotonic()
                for a in list(live):
                    if a.future.done():
                        live.remove(a)
                        err = a.future.exception()
                        if err is None:
                            winner = a
                            break
                        a.error = last = err
                        self._count(errors=1)
                        tracing.end_span(a.span, error=err)
                        log.warning("upload of %s, attempt %d (try %d/%d%s) failed: %s",
                                    path, a.n, tries, cfg.max_attempts,
                                    ", hedged" if a.hedge else "", err)
                    elif now >= a.deadline:
                        live.remove(a)
                        a.error = last = TimeoutError(
                            f"attempt {a.n} timed out after {cfg.upload_timeout_s:g}s")
                        self._count(timeouts=1)
                        tracing.end_span(a.span, error=a.error)
                        log.warning("upload of %s, attempt %d (try %d/%d) timed out after "
                                    "%gs", path, a.n, tries, cfg.max_attempts,
                                    cfg.upload_timeout_s)
                if winner is not None:
                    break
                if not live:
                    if tries >= cfg.max_attempts:
                        self._count(failures=1)
                        raise StorageError(
                            f"upload of {path} failed after {tries} attempt(s)"
                            f"{f' and {len(attempts) - tries} hedge(s)' if len(attempts) > tries else ''}"
                            f": {type(last).__name__}: {last}")
                    if cfg.retry_delay_s:
                        time.sleep(cfg.retry_delay_s)
                    new_try()
                    continue
                if hedge_at is not None and now >= hedge_at:
                    hedge_at = None  # one hedge per try
                    h = self._launch(path, data, len(attempts) + 1, True, trace)
                    attempts.append(h)
                    live.append(h)
                    continue
                wake = min(a.deadline for a in live)
                if hedge_at is not None:
                    wake = min(wake, hedge_at)
                concurrent.futures.wait([a.future for a in live], timeout=max(0.0, wake - now),
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            assert winner is not None
            self.policy.record(time.monotonic() - winner.start)
            self._count(bytes=len(data), hedge_wins=int(winner.hedge))
            tracing.end_span(winner.span, won=True)
            return winner.path
        finally:
            for a in attempts:
                if a is not winner:
                    a.future.add_done_callback(
                        lambda f, a=a, w=winner: self._schedule_cleanup(a, f, w))

    def _schedule_cleanup(self, a: _Attempt, f: concurrent.futures.Future,
                          winner: _Attempt | None) -> None:
        """Off the caller's path: a callback on a finished future runs in the caller."""
        try:
            self._pool.submit(self._cleanup, a, f, winner)
        except RuntimeError:  # the pool is shut down
            self._cleanup(a, f, winner)

    def _cleanup(self, a: _Attempt, f: concurrent.futures.Future, winner: _Attempt | None
                 ) -> None:
        """A non-winning attempt finished: delete whatever it left under its own name."""
        ok = not f.cancelled() and f.exception() is None
        if ok:
            self.policy.record(time.monotonic() - a.start)  # a true attempt latency too
            if a.span is not None and a.error is None:
                tracing.end_span(a.span, won=False)
        try:
            self.storage.delete(a.path)
            if ok:
                self._count(losers_deleted=1)
                log.info("deleted %s, the late loser of an upload won by %s", a.path,
                         winner.path if winner else "nobody")
        except Exception as e:  # noqa: BLE001 - orphan cleanup after recovery covers it
            self._count(cleanup_failures=1)
            log.warning("cannot delete %s (a losing upload attempt): %s", a.path, e)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
