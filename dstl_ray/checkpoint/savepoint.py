"""Savepoints (FLINK-5053; docs/architecture.md "Checkpoint lifecycle"): a full,
self-contained snapshot of every backend in ``{job}/savepoint-{n}/``.

A savepoint shares no file with any checkpoint, so it is restorable at any parallelism, by
any job, and the coordinator never deletes it. It is complete once its ``_metadata`` is
written; if any backend's part fails, everything written under its directory is deleted.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable

from ..errors import CheckpointDeclinedError
from ..state.backend import ChangelogKeyedStateBackend
from ..storage.base import Storage, join
from .recovery import CompletedCheckpoint
from .snapshot import METADATA_FILE, CheckpointMetadata

SAVEPOINT_PART_TIMEOUT_S = 300  # how long one backend's part may take


def start_savepoint(job_id: str, n: int, target: str,
                    backends: Iterable[ChangelogKeyedStateBackend], max_parallelism: int,
                    storage: Storage) -> concurrent.futures.Future[CompletedCheckpoint]:
    """Start savepoint ``n`` of job ``job_id`` in directory ``target``: every backend
    writes its part now; the metadata is written on a thread of its own (a savepoint must
    not queue behind checkpoints). The future fails with :class:`CheckpointDeclinedError`
    once the parts that did start are done and the directory is cleaned."""
    futures = [b.savepoint(target) for b in backends]

    def finish() -> CompletedCheckpoint:
        url = join(target, METADATA_FILE)
        try:
            snaps = tuple(f.result(timeout=SAVEPOINT_PART_TIMEOUT_S) for f in futures)
            meta = CheckpointMetadata(job_id, n, "savepoint", max_parallelism, snaps)
            text = meta.to_json().encode()
            storage.write_file(url, text)
        except BaseException as e:
            concurrent.futures.wait(futures)
            for u in storage.list_files(target):
                storage.delete(u)
            raise CheckpointDeclinedError(f"savepoint {n} failed: {e}") from e
        return CompletedCheckpoint(n, url, meta, meta.files(url), len(text))

    return _spawn(finish)


def _spawn(fn: Callable[[], CompletedCheckpoint]
           ) -> concurrent.futures.Future[CompletedCheckpoint]:
    """Run ``fn`` on its own daemon thread; its outcome goes to the returned future."""
    out: concurrent.futures.Future[CompletedCheckpoint] = concurrent.futures.Future()

    def run() -> None:
        try:
            out.set_result(fn())
        except BaseException as e:  # noqa: BLE001
            out.set_exception(e)

    threading.Thread(target=run, daemon=True, name="dstl-savepoint").start()
    return out
