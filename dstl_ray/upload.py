"""DFS uploads with a retry policy (Flink's ``dstl.dfs.upload.*``: per-attempt timeout, max
attempts, delay after failure). Every attempt of one upload writes the same bytes under the same
name, so a slow attempt that lands after a retry leaves nothing stray behind."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

from . import tracing
from .config import ChangelogConfig
from .errors import StorageError
from .storage import Storage

log = logging.getLogger(__name__)


@dataclass
class UploadStats:
    uploads: int = 0
    attempts: int = 0
    retries: int = 0
    failures: int = 0
    bytes: int = 0


class Uploader:
    """Writes whole files with retries; thread-safe, blocking (run it off the event loop)."""

    def __init__(self, storage: Storage, config: ChangelogConfig, max_workers: int = 8) -> None:
        self.storage = storage
        self.config = config
        self.stats = UploadStats()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                           thread_name_prefix="dstl-upload")

    def write(self, path: str, data: bytes, trace: dict[str, str] | None = None) -> None:
        """Write ``data`` to ``path`` with retries; ``trace`` (a W3C carrier) parents one
        ``dstl.dfs.attempt`` span per attempt."""
        cfg = self.config
        last: BaseException | None = None
        with self._lock:
            self.stats.uploads += 1
        for attempt in range(1, cfg.max_attempts + 1):
            with self._lock:
                self.stats.attempts += 1
                if attempt > 1:
                    self.stats.retries += 1
            span = tracing.start_span("dstl.dfs.attempt", trace, attempt=attempt,
                                      bytes=len(data)) if trace else None
            fut = self._pool.submit(self.storage.write_file, path, data)
            try:
                fut.result(timeout=cfg.upload_timeout_s)
                with self._lock:
                    self.stats.bytes += len(data)
                tracing.end_span(span)
                return
            except concurrent.futures.TimeoutError:
                last = TimeoutError(f"attempt {attempt} timed out after {cfg.upload_timeout_s}s")
            except Exception as e:  # noqa: BLE001 - every failure is retried
                last = e
            tracing.end_span(span, error=last)
            log.warning("upload of %s, attempt %d/%d failed: %s", path, attempt,
                        cfg.max_attempts, last)
            if attempt < cfg.max_attempts and cfg.retry_delay_s:
                time.sleep(cfg.retry_delay_s)
        with self._lock:
            self.stats.failures += 1
        raise StorageError(f"upload of {path} failed after {cfg.max_attempts} attempts: "
                           f"{type(last).__name__}: {last}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
