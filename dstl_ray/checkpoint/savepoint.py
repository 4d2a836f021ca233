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

The marker names the incarnation of the job that writes the savepoint: orphan cleanup
(:func:`~dstl_ray.checkpoint.recovery.cleanup_orphans`) spares a directory without
``_metadata`` whose marker names the current incarnation, and deletes one of an older
incarnation (its driver lost the job). Such a driver may still be running: before its
``_metadata`` write it checks its lease (the ``guard``: a driver that lost the job is
fenced), that its marker is still its own and that every file the parts wrote is still
there, and then creates ``_metadata`` only where absent. Otherwise the savepoint fails.

It is complete once its ``_metadata`` is written. If any part fails, or the parts are not
all done within ``timeout_s``, or the checks before the metadata fail, the attempt deletes
what it wrote once every part that started is done (everything in its directory: nothing
else writes there; its marker last), provided its lease still holds: a fenced driver
deletes nothing, leaving the directory to the next recovery's orphan cleanup.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Protocol

from ..errors import CheckpointDeclinedError, ConfigError, DstlError
from ..key_hashes import BLAKE2B
from ..log.futures import when_all_done
from ..state.registry import SharedStateRegistry
from ..state.snapshot import KeyedStateSnapshot
from ..storage.base import Storage, join, normalize_url
from .metadata import METADATA_FILE, CheckpointMetadata
from .recovery import SAVEPOINT_MARKER, SAVEPOINT_PREFIX, CompletedCheckpoint, savepoint_marker
from .savepoint_parts import checkpoint_ranges

log = logging.getLogger(__name__)

SAVEPOINT_PART_TIMEOUT_S = 300.0  # how long the backends' parts may take, together
MARKER_FILE = SAVEPOINT_MARKER  # created first, only where absent: the directory is taken
_NAME_ATTEMPTS = 8  # random names tried before giving up (one collision is already rare)


def new_savepoint_dir(job_path: str, job_id: str, n: int, storage: Storage,
                     incarnation: str = "") -> str:
    """A new, empty directory for savepoint ``n`` under ``job_path``, taken by creating its
    marker (naming ``incarnation``, the run writing the savepoint): a random name (64 bits),
    used only if nothing is in it and the marker did not exist (``create_file`` where the
    store has it). Raises :class:`CheckpointDeclinedError` if no free name was found."""
    record = savepoint_marker(job_id, n, incarnation)
    create = getattr(storage, "create_file", None)
    job_path = normalize_url(job_path)  # the spelling listings use (the marker check)
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


class SavepointPart(Protocol):
    """What writes one part of a savepoint: a live backend
    (:meth:`~dstl_ray.state.backend.ChangelogKeyedStateBackend.savepoint`), or one range of
    a complete checkpoint (:class:`~dstl_ray.checkpoint.savepoint_parts.CheckpointRange`)."""

    def savepoint(self, target_dir: str) -> concurrent.futures.Future[KeyedStateSnapshot]:
        """Write the part under ``target_dir``; its snapshot when done. A part whose
        ``queued`` attribute is true promises that cancelling a future not yet running
        means the part never runs: a failed attempt cancels such parts."""


class Savepoints:
    """A job's savepoints (FLINK-5053, the module docstring): of its live backends, or of a
    complete checkpoint, whose key-group ranges are rewritten from its files in this process
    one at a time on a thread of their own (one range in memory;
    :mod:`~dstl_ray.checkpoint.savepoint_parts`). ``guard`` is the job lease's check.

    While a checkpoint is read, the files of it that the job's ``registry`` references are
    pinned there: a checkpoint subsumed meanwhile loses its files only once the savepoint is
    done. Files the registry does not know (another job's) are left out: the registry must
    never take them for its own, or unpinning would delete them."""

    def __init__(self, job_id: str, job_path: str, max_parallelism: int, storage: Storage,
                 guard: Callable[[], None], registry: SharedStateRegistry | None = None,
                 key_hash: Callable[[], str] = lambda: BLAKE2B.name) -> None:
        self.job_id, self.job_path, self.max_parallelism = job_id, job_path, max_parallelism
        self.key_hash = key_hash  # the job's (dstl_ray.key_hashes), asked at each savepoint
        self.storage, self.guard, self.registry = storage, guard, registry
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dstl-sp")

    def start(self, n: int, backends: Iterable[SavepointPart], incarnation: str,
              of: CompletedCheckpoint | None = None, table: str = "heap",
              local_dir: str | None = None, timeout_s: float | None = None
              ) -> concurrent.futures.Future[CompletedCheckpoint]:
        """Savepoint ``n`` of ``backends``, or of the checkpoint ``of`` (``table``: its
        throwaway tables' kind, under ``local_dir``); the parts get ``timeout_s``."""
        if of is not None:
            if of.metadata.max_parallelism != self.max_parallelism:
                raise ConfigError(f"checkpoint {of.metadata_url} has max parallelism "
                                  f"{of.metadata.max_parallelism}, job {self.job_id} "
                                  f"{self.max_parallelism}: its key groups would not match")
            backends = checkpoint_ranges(of, self.storage, self._pool, table, local_dir)
        unpin = self._pin(of)
        try:
            done = start_savepoint(self.job_id, n, self.job_path, backends,
                                   self.max_parallelism, self.storage, incarnation=incarnation,
                                   guard=self.guard, timeout_s=timeout_s,
                                   key_hash=of.metadata.key_hash if of is not None
                                   else self.key_hash())
        except BaseException:
            if unpin is not None:
                unpin()
            raise
        if unpin is not None:
            done.add_done_callback(lambda _f: unpin())
        return done

    def _pin(self, of: CompletedCheckpoint | None) -> Callable[[], None] | None:
        """Pin the files of ``of`` the registry references (own, retained); what unpins
        them, or None when nothing was pinned."""
        registry = self.registry
        if of is None or registry is None:
            return None
        known = {n: u for n, u in of.files.items() if registry.reference_count(u)}
        if not known:
            return None
        owner = f"savepoint-of-{of.checkpoint_id}-{uuid.uuid4().hex[:8]}"
        registry.set_pins(owner, known)
        return lambda: registry.unpin_all(owner)

    def close(self) -> None:
        """Wait for the checkpoint rewrites queued or running (a failed attempt's queued
        parts are cancelled)."""
        self._pool.shutdown(wait=True)


class _NotOurs(CheckpointDeclinedError):
    """The savepoint's ``_metadata`` exists already: the directory is not ours to clean."""


def start_savepoint(job_id: str, n: int, job_path: str,
                    backends: Iterable[SavepointPart], max_parallelism: int,
                    storage: Storage, *, incarnation: str = "",
                    guard: Callable[[], None] | None = None,
                    timeout_s: float | None = None, key_hash: str = BLAKE2B.name
                    ) -> concurrent.futures.Future[CompletedCheckpoint]:
    """Start savepoint ``n`` of job ``job_id`` in a new directory under ``job_path``
    (:func:`new_savepoint_dir`, its marker naming ``incarnation``): every backend writes
    its part now; the metadata is written on a thread of its own (a savepoint must not
    queue behind checkpoints), after ``guard`` (the job lease's check: it raises once this
    driver may no longer write) and the checks of the module docstring. The parts get
    ``timeout_s`` together (default :data:`SAVEPOINT_PART_TIMEOUT_S`); the metadata names
    ``key_hash``, the parts' (dstl_ray.key_hashes). The future fails
    with :class:`CheckpointDeclinedError` once the parts that did start are done (or the
    wait for them timed out) and what the attempt wrote is deleted."""
    timeout = SAVEPOINT_PART_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        if guard is not None:
            guard()  # a driver that lost the job (or closed it) takes no directory
        target = new_savepoint_dir(job_path, job_id, n, storage, incarnation)
    except DstlError as e:
        return _failed(CheckpointDeclinedError(f"savepoint {n} of job {job_id} failed: {e}"))
    record = savepoint_marker(job_id, n, incarnation)
    parts = list(backends)
    futures = [_part(b, target) for b in parts]
    # parts whose futures, once cancelled, never run (queued on an executor of their own)
    queued = [f for b, f in zip(parts, futures, strict=True) if getattr(b, "queued", False)]

    def finish() -> CompletedCheckpoint:
        url = join(target, METADATA_FILE)
        deadline = time.monotonic() + timeout
        try:
            _, late = concurrent.futures.wait(
                futures, timeout=timeout, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            if late:
                raise CheckpointDeclinedError(f"{len(late)} of {len(futures)} parts not "
                                              f"done after {timeout:g}s")
            snaps = tuple(f.result() for f in futures)
            meta = CheckpointMetadata(job_id, n, "savepoint", max_parallelism, snaps,
                                      key_hash=key_hash)
            text = meta.to_json().encode()
            _write_metadata(target, meta.files(url).values(), text, record, storage, guard)
        except BaseException as e:
            for f in queued:
                f.cancel()  # parts queued behind the failed or late one never start
            if not isinstance(e, _NotOurs):
                _, late = concurrent.futures.wait(
                    futures, timeout=max(0.0, deadline - time.monotonic()))
                _discard_when_done(target, storage, guard, late)
            raise CheckpointDeclinedError(f"savepoint {n} of job {job_id} failed: {e}") from e
        return CompletedCheckpoint(n, url, meta, meta.files(url), len(text))

    return _spawn(finish)


def _write_metadata(target: str, parts: Iterable[str], text: bytes, record: bytes,
                    storage: Storage, guard: Callable[[], None] | None) -> None:
    """Write ``target``'s ``_metadata`` (``text``) only while this driver holds the job
    (``guard``), the directory's marker is still its own (``record``) and every file of
    ``parts`` exists: another driver's orphan cleanup deletes a savepoint in progress of an
    older incarnation, and a metadata naming deleted files would be a savepoint that cannot
    be restored. Created only where absent (``create_file`` where the store has it)."""
    if guard is not None:
        guard()
    marker = join(target, MARKER_FILE)
    try:
        mine = storage.exists(marker) and storage.read_file(marker) == record
    except DstlError as e:
        raise CheckpointDeclinedError(f"cannot read its marker {marker}: {e}") from e
    if not mine:
        raise CheckpointDeclinedError(f"its marker {marker} is gone or not its own (another "
                                      f"driver's orphan cleanup?)")
    missing = [u for u in parts if not storage.exists(u)]
    if missing:
        raise CheckpointDeclinedError(f"files of its parts are gone: {', '.join(missing)}")
    url = join(target, METADATA_FILE)
    create = getattr(storage, "create_file", None)
    if create is not None:
        if not create(url, text):
            raise _NotOurs(f"{url} exists already")
        return
    if storage.exists(url):
        raise _NotOurs(f"{url} exists already")
    storage.write_file(url, text)


def _part(backend: SavepointPart, target: str
          ) -> concurrent.futures.Future[KeyedStateSnapshot]:
    """``backend``'s part; one that fails to start is a failed part (the parts already
    started still finish, and are cleaned up with the attempt)."""
    try:
        return backend.savepoint(target)
    except BaseException as e:  # noqa: BLE001
        out: concurrent.futures.Future[KeyedStateSnapshot] = concurrent.futures.Future()
        out.set_exception(e)
        return out


def _discard_when_done(target: str, storage: Storage, guard: Callable[[], None] | None,
                       late: set[concurrent.futures.Future]) -> None:
    """Discard the failed attempt in ``target`` now, or, while parts are still running
    (``late``: their wait timed out), once the last of them is done (the future has failed
    by then: nobody waits for the cleanup)."""
    if late:
        log.warning("savepoint in %s: %d parts still running; its files go once they are "
                    "done", target, len(late))
    when_all_done(late, lambda: _discard_attempt(target, storage, guard))


def _discard_attempt(target: str, storage: Storage,
                     guard: Callable[[], None] | None = None) -> None:
    """Delete what a failed attempt wrote: its directory is its own (:func:`new_savepoint_dir`),
    so that is every file in it; the marker goes last, so a delete that fails leaves a
    directory no savepoint will take (the next recovery's orphan cleanup removes it). A
    driver that no longer holds the job (``guard`` raises) deletes nothing: the directory
    is left to the next recovery's orphan cleanup."""
    marker = join(target, MARKER_FILE)
    try:
        if guard is not None:
            guard()
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
