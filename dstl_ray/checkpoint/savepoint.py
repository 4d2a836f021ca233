"""Savepoints (FLINK-5053; docs/architecture.md "Checkpoint lifecycle"): a full,
self-contained snapshot of every backend in a directory of its own,
``{job}/savepoint-{random}/``.

A savepoint belongs to the user. It shares no file with any checkpoint, so it is restorable
at any parallelism, by any job, and the coordinator never deletes it. Its directory name
never depends on the checkpoint counter: a restarted coordinator sets the counter from the
retained checkpoints only (from 1 once they were deleted), so a name taken from it would be
an earlier run's savepoint, whose ``_metadata`` a new savepoint would overwrite and whose
files a failed one would delete. As Flink's ``savepoint-<job>-<random>``, the name is random,
and a directory is used only if it is empty and its marker ``_savepoint`` could be created
where absent: no two savepoints, of any run, ever share a directory. The savepoint's id (in
its metadata) is still the checkpoint counter's value when it was taken, as in Flink.

It is complete once its ``_metadata`` is written. If any backend's part fails, the attempt
deletes what it wrote, once every part that started is done: everything in its directory
(nothing else writes there), its marker last.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from ..errors import CheckpointDeclinedError, DstlError
from ..state.backend import ChangelogKeyedStateBackend
from ..storage.base import Storage, join
from .recovery import SAVEPOINT_PREFIX, CompletedCheckpoint
from .snapshot import METADATA_FILE, CheckpointMetadata, KeyedStateSnapshot

log = logging.getLogger(__name__)

SAVEPOINT_PART_TIMEOUT_S = 300  # how long one backend's part may take
MARKER_FILE = "_savepoint"  # created first, only where absent: the directory is taken
_NAME_ATTEMPTS = 8  # random names tried before giving up (one collision is already rare)


def new_savepoint_dir(job_path: str, job_id: str, n: int, storage: Storage) -> str:
    """A new, empty directory for savepoint ``n`` under ``job_path``, taken by creating its
    marker: a random name (64 bits), used only if nothing is in it and the marker did not
    exist (``create_file`` where the store has it). Raises
    :class:`CheckpointDeclinedError` if no free name was found."""
    record = json.dumps({"type": "dstl-savepoint", "job": job_id, "id": n,
                         "created": time.time()}, sort_keys=True).encode()
    create = getattr(storage, "create_file", None)
    for _ in range(_NAME_ATTEMPTS):
        target = join(job_path, f"{SAVEPOINT_PREFIX}{uuid.uuid4().hex[:16]}")
        if storage.list_files(target):
            continue  # someone's directory: never reused
        marker = join(target, MARKER_FILE)
        if create is not None:
            if create(marker, record):
                return target
            continue
        storage.write_file(marker, record)  # no create-if-absent: the empty check must do
        return target
    raise CheckpointDeclinedError(f"savepoint {n} of job {job_id}: no free directory name "
                                  f"under {job_path} after {_NAME_ATTEMPTS} tries")


def start_savepoint(job_id: str, n: int, job_path: str,
                    backends: Iterable[ChangelogKeyedStateBackend], max_parallelism: int,
                    storage: Storage) -> concurrent.futures.Future[CompletedCheckpoint]:
    """Start savepoint ``n`` of job ``job_id`` in a new directory under ``job_path``
    (:func:`new_savepoint_dir`): every backend writes its part now; the metadata is written
    on a thread of its own (a savepoint must not queue behind checkpoints). The future fails
    with :class:`CheckpointDeclinedError` once the parts that did start are done and what
    the attempt wrote is deleted."""
    try:
        target = new_savepoint_dir(job_path, job_id, n, storage)
    except DstlError as e:
        return _failed(CheckpointDeclinedError(f"savepoint {n} of job {job_id} failed: {e}"))
    futures = [_part(b, target) for b in backends]

    def finish() -> CompletedCheckpoint:
        url = join(target, METADATA_FILE)
        try:
            snaps = tuple(f.result(timeout=SAVEPOINT_PART_TIMEOUT_S) for f in futures)
            meta = CheckpointMetadata(job_id, n, "savepoint", max_parallelism, snaps)
            text = meta.to_json().encode()
            storage.write_file(url, text)
        except BaseException as e:
            concurrent.futures.wait(futures)
            _discard_attempt(target, storage)
            raise CheckpointDeclinedError(f"savepoint {n} of job {job_id} failed: {e}") from e
        return CompletedCheckpoint(n, url, meta, meta.files(url), len(text))

    return _spawn(finish)


def _part(backend: ChangelogKeyedStateBackend, target: str
          ) -> concurrent.futures.Future[KeyedStateSnapshot]:
    """``backend``'s part; one that fails to start is a failed part (the parts already
    started still finish, and are cleaned up with the attempt)."""
    try:
        return backend.savepoint(target)
    except BaseException as e:  # noqa: BLE001
        out: concurrent.futures.Future[KeyedStateSnapshot] = concurrent.futures.Future()
        out.set_exception(e)
        return out


def _discard_attempt(target: str, storage: Storage) -> None:
    """Delete what a failed attempt wrote: its directory is its own (:func:`new_savepoint_dir`),
    so that is every file in it; the marker goes last, so a delete that fails leaves a
    directory no savepoint will take (the next recovery's orphan cleanup removes it)."""
    marker = join(target, MARKER_FILE)
    try:
        for url in storage.list_files(target):
            if url != marker:
                storage.delete(url)
        storage.delete(marker)
        remove_dir = getattr(storage, "delete_dir", None)
        if remove_dir is not None:
            remove_dir(target)
    except DstlError as e:
        log.warning("cannot clean up the failed savepoint in %s: %s", target, e)


def _failed(error: BaseException) -> concurrent.futures.Future[CompletedCheckpoint]:
    out: concurrent.futures.Future[CompletedCheckpoint] = concurrent.futures.Future()
    out.set_exception(error)
    return out


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
